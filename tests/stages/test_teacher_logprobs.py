"""On-policy distillation's stages: the teacher_logprobs stage (the "teacher" worker group), its refusals (no
teacher, another tokenizer), and the advantages table's per-token reverse-KL term, mixed and alone."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from configs.schema import AlgorithmConfig, DistillationConfig, load_config
from stages.advantage_table import compute_advantage_table
from stages.dag import iteration_stages
from stages.ref_logprobs import compute_ref_logprobs
from stages.teacher_logprobs import TEACHER_ROLE, check_same_tokenizer, teacher_dir, teacher_logprobs
from stages.workers.group import _find
from stages.workers.sharded import shard_frames

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import scored_rows
from test_ref_logprobs import _rollouts

ROOT = Path(__file__).resolve().parents[2]
STUDENT = [[-1.0, -1.0]] * 4
TEACHER = [[-1.0, -2.0], [-1.0, -1.0], [-3.0, -1.0], [-1.0, -0.5]]


def _distill(use_task_rewards: bool, teacher: pd.DataFrame | None = None) -> pd.DataFrame:
    scored = scored_rows([1, 0, 0, 1], [2, 2, 2, 2]).assign(rollout_logprobs=STUDENT)
    if teacher is None:
        teacher = pd.DataFrame({"rollout_id": [3, 2, 1, 0], "teacher_logprobs": TEACHER[::-1]})  # joined by id
    dcfg = DistillationConfig(enable=True, teacher_model_path="t", use_task_rewards=use_task_rewards)
    return compute_advantage_table(scored, AlgorithmConfig(distillation=dcfg), teacher=teacher)


def test_distillation_term_mixed_with_grpo_and_alone_hand_derived() -> None:
    # rkl = student - teacher: [0, 1], [0, 0], [2, 0], [0, -0.5]; GRPO of rewards [1, 0, 0, 1] is +-0.866025
    mixed = _distill(True)
    want = [[0.866025, -0.133975], [-0.866025, -0.866025], [-2.866025, -0.866025], [0.866025, 1.366025]]
    for got, w in zip(mixed["token_advantages"], want, strict=True):
        assert got == pytest.approx(w, abs=1e-5)
    assert mixed["teacher_kl"].tolist() == pytest.approx([0.5, 0.0, 1.0, -0.25])  # token means of rkl
    assert mixed["teacher_logprobs"].tolist() == TEACHER
    alone = _distill(False)  # -rkl only: the rewards do not enter
    for got, w in zip(alone["token_advantages"], [[0, -1], [0, 0], [-2, 0], [0, 0.5]], strict=True):
        assert got == pytest.approx(w, abs=1e-6)
    assert alone["advantage"].tolist() == pytest.approx([0, 0, -2, 0])  # the first token's


def test_distillation_without_its_table_or_with_other_rollouts_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the iteration's teacher_logprobs table"):
        compute_advantage_table(
            scored_rows([1, 0, 0, 1], [2, 2, 2, 2]),
            AlgorithmConfig(distillation=DistillationConfig(enable=True, teacher_model_path="t")),
        )
    other = pd.DataFrame({"rollout_id": [0, 1, 2, 9], "teacher_logprobs": TEACHER})
    with pytest.raises(ValueError, match=r"rollouts \[3\] have no teacher log-probs"):
        _distill(True, teacher=other)


def test_config_refuses_a_teacherless_distillation_and_the_dag_has_the_stage_only_when_enabled() -> None:
    with pytest.raises(ValidationError, match="needs algorithm.distillation.teacher_model_path"):
        load_config(None, ["algorithm.distillation.enable=true"])
    on = load_config(None, ["algorithm.distillation.enable=true", "algorithm.distillation.teacher_model_path=x"])
    assert "teacher_logprobs" in iteration_stages(on) and "teacher_logprobs" not in iteration_stages(load_config(None))


def test_missing_teacher_checkpoint_says_what_to_set(tmp_path: Path) -> None:
    cfg = load_config(
        None, ["algorithm.distillation.enable=true", f"algorithm.distillation.teacher_model_path={tmp_path / 'no'}"]
    )
    with pytest.raises(FileNotFoundError, match=r"teacher_model_path=.* is not a HF checkpoint directory"):
        teacher_dir(cfg)


def test_teacher_with_another_tokenizer_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(tool_tokens=True)  # the tiny vocabulary plus tool-call tokens: ids differ
    other = save_policy(build_tiny_model(TinyModelConfig(hidden_size=32), len(tok)), tok, tmp_path / "other")
    with pytest.raises(ValueError, match="does not share the student's tokenizer"):
        check_same_tokenizer(Path(other), tiny_checkpoint)
    check_same_tokenizer(tiny_checkpoint, tiny_checkpoint)  # the same one passes


def test_preflight_checks_the_teacher_before_any_run(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model
    from stages.run.preflight import preflight

    def cfg(teacher: Path):
        over = [f"trainer.output_dir={tmp_path}", f"algorithm.distillation.teacher_model_path={teacher}"]
        return load_config(ROOT / "configs" / "ci_tiny_distill.yaml", over)

    assert preflight(cfg(tiny_checkpoint))["rows"] > 0  # the tiny student's char tokenizer: the same vocabulary
    with pytest.raises(FileNotFoundError, match="teacher_model_path"):
        preflight(cfg(tmp_path / "missing"))
    tok = build_char_tokenizer(tool_tokens=True)
    other = save_policy(build_tiny_model(TinyModelConfig(hidden_size=32), len(tok)), tok, tmp_path / "other")
    with pytest.raises(ValueError, match="does not share the student's tokenizer"):
        preflight(cfg(Path(other)))


@pytest.mark.ray
def test_teacher_logprobs_on_the_teacher_group_equal_an_in_process_forward(tiny_checkpoint, ray_session) -> None:
    rollouts = _rollouts(tiny_checkpoint, n_prompts=3, n=2)
    overrides = ["algorithm.distillation.enable=true", f"algorithm.distillation.teacher_model_path={tiny_checkpoint}"]
    cfg = load_config(None, overrides)
    out = shard_frames(teacher_logprobs(cfg, rollouts, tiny_checkpoint))
    assert list(out.columns) == ["rollout_id", "policy_version", "teacher_logprobs"]
    here = compute_ref_logprobs(rollouts, model_dir=str(tiny_checkpoint), use_ray=False)
    got, want = (
        np.concatenate([np.asarray(x) for x in lists]) for lists in (out["teacher_logprobs"], here["ref_logprobs"])
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    # computed on the teacher's own resident worker group (rlake:<run>:teacher:...)
    assert len(_find(TEACHER_ROLE)) == 1
