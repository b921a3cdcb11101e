"""The teacher_logprobs stage: per-token log-probs of every rollout's response under the distillation teacher
(algorithm.distillation), for on-policy distillation's reverse-KL advantage (stages/algos/distill.py).

Flow: assets/teacher_logprobs.py `materialize` -> `teacher_logprobs(cfg, rollouts, student_dir)`, which checks that
the teacher reads the student's tokens as the student does (same tokenizer vocabulary) and runs
stages.ref_logprobs.ref_logprob_shards with the teacher's checkpoint on the run's own "teacher" worker group:
RefWorkers, loaded once per run and kept resident, placed as the reference model's (stages/workers/placement.py).
Log-probs are taken at the rollout's sampling temperature, as the reference model's and the student's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from configs.schema import RunConfig
from stages.io.checkpoints import resolve_model_dir
from stages.io.stage_exec import Partition
from stages.models.policy import load_tokenizer
from stages.ref_logprobs import ref_logprob_shards
from stages.train.batching import logprob_temperature
from stages.workers.placement import GpuPool
from stages.workers.shard_io import ShardResult, Sink

TEACHER_ROLE = "teacher"
"""The teacher's worker group (a role of its own beside "ref": a run may use both)."""


def teacher_dir(cfg: RunConfig) -> Path:
    """The teacher's checkpoint directory (absolute, so every worker opens the same one); a clear error if absent."""
    path = cfg.algorithm.distillation.teacher_model_path
    if not path or not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"algorithm.distillation.teacher_model_path={path!r} is not a HF checkpoint directory (no config.json), "
            "so there is no teacher to distill from; set it to a local directory written by save_pretrained, e.g. "
            "a finished run's <trainer.output_dir>/checkpoints/<run_id>/policy_v<N>"
        )
    return Path(path).resolve()


def check_same_tokenizer(teacher: Path, student: Path) -> None:
    """Raise unless the teacher's tokenizer maps every token to the student's (checkpoint `student`) id and its
    embedding covers them: the teacher scores the student's token ids as they are (no re-tokenization)."""
    check_teacher_tokenizer(teacher, load_tokenizer(student))


def check_teacher_tokenizer(teacher: Path, student_tokenizer) -> None:
    """check_same_tokenizer against the student's tokenizer object (preflight: before the student is saved)."""
    t_vocab, s_vocab = load_tokenizer(teacher).get_vocab(), student_tokenizer.get_vocab()
    t_size = json.loads((teacher / "config.json").read_text()).get("vocab_size", len(t_vocab))
    if t_vocab != s_vocab or t_size < len(s_vocab):
        differ = sorted(set(t_vocab.items()) ^ set(s_vocab.items()))[:5]
        raise ValueError(
            f"the distillation teacher {teacher} does not share the student's tokenizer ({len(t_vocab)} tokens, "
            f"embedding {t_size} vs the student's {len(s_vocab)}; first differing (token, id): {differ}), "
            "because its log-probs are read at the student's sampled token ids, which must mean the same tokens; "
            "use a teacher of the same tokenizer family (same vocabulary), or distill off-policy instead"
        )


def teacher_logprobs(
    cfg: RunConfig, rollouts: pd.DataFrame | Partition, student_dir: str | Path, sink: Sink | None = None
) -> list[ShardResult]:
    """The teacher_logprobs rows (rollout_id, policy_version, teacher_logprobs) of an iteration's rollouts, sorted
    by rollout_id per rank, and each rank's reverse-KL sums (stages.ref_logprobs.mean_log_ratio); student_dir: the
    student's policy version 0 (for the tokenizer check). With a Partition handle and a sink, each rank reads its
    slice and writes its rows."""
    dcfg = cfg.algorithm.distillation
    teacher = teacher_dir(cfg)
    check_same_tokenizer(teacher, resolve_model_dir(student_dir))
    return ref_logprob_shards(
        rollouts,
        model_dir=str(teacher),
        micro_batch_size=cfg.actor.ppo_micro_batch_size,
        num_workers=dcfg.num_workers,
        temperature=logprob_temperature(cfg.rollout.temperature),
        param_dtype=cfg.actor.mixed_precision.param_dtype,
        gpus=GpuPool.of(cfg.trainer),
        role=TEACHER_ROLE,
        sink=sink,
        column="teacher_logprobs",
    )
