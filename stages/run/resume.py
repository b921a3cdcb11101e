"""Resuming a run: where to restart, and checks that the restart continues the same run.

Every Delta write replaces exactly its (run_id, iteration) partition and the prompt cursor and all
seeds are pure functions of (seed, iteration), so re-running an iteration reproduces it. Resuming
is therefore: find the first iteration whose `iteration_metrics` partition is missing (the last
asset of an iteration), roll back to the newest kept checkpoint at or before it, and re-run from
there. Each checkpoint policy_v<N> carries a `trainer_state.json` (iteration, config hashes, data
cursor, seeds), committed with it (`trainer_state_files`), that is checked before resuming from it.
Checkpoints are read through the run's ModelStore (stages.io.checkpoints), so a run whose storage.root is
s3:// resumes from the bucket on any node.

Modes (`trainer.resume_mode`, verl's names):
- auto: continue the run named by trainer.run_id / --run-id if it exists; without a run id, the
  newest unfinished run of the same experiment_name and resume hash under output_dir; else fresh.
- disable: start at iteration 0 (an existing run id gets its partitions replaced).
- resume_path: continue from trainer.resume_from_path, a policy_v<N> directory of this output_dir.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from deltalake import DeltaTable

from configs.schema import ModelConfig, RunConfig
from stages import seeds
from stages.io import objects, uris
from stages.io.checkpoints import ModelStore, atomic_write_text
from stages.models.tiny import build_char_tokenizer

STATE_FILE = "trainer_state.json"
SETUP_ITERATION = -1
"""iteration_metrics partition -1 is written by initial_policy: the set-up of the run is complete."""
RUN_CONTROL_FIELDS = (
    "run_id",
    "resume_mode",
    "resume_from_path",
    "resume_allow_config_change",
    "max_iteration_retries",
    "total_training_steps",
    "save_freq",
    "test_freq",
    "output_dir",
    "mlflow_tracking_uri",
)
"""trainer fields that say how long / where a run goes, not what an iteration computes: a resume may change them."""
_VERSION_DIR = re.compile(r"^policy_v(\d+)$")


@dataclass(frozen=True)
class ResumePlan:
    run_id: str | None
    """None: start a fresh run with a generated id."""
    start_iteration: int
    """First iteration to (re-)run; its input is policy version start_iteration."""
    run_setup: bool
    """Run the set-up job (prompts table, policy v0) first."""
    reason: str
    """One log line saying what was decided and why."""


def resume_hash(cfg: RunConfig) -> str:
    """12-hex hash of everything that determines an iteration's result (cfg minus RUN_CONTROL_FIELDS)."""
    data = cfg.model_dump(mode="json")
    for key in RUN_CONTROL_FIELDS:
        data["trainer"].pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def cursor_batch_size(cfg: RunConfig) -> int:
    """Prompts the epoch cursor advances per iteration (gen_batch_size under DAPO's filter_groups)."""
    fg = getattr(cfg.algorithm, "filter_groups", None)
    if fg is not None and fg.enable:
        return getattr(cfg.data, "gen_batch_size", None) or cfg.data.train_batch_size
    return cfg.data.train_batch_size


def trainer_state(cfg: RunConfig, run_id: str, version: int, num_train_prompts: int) -> dict:
    """The state saved next to checkpoint policy_v<version>: the input of iteration `version`."""
    position = version * cursor_batch_size(cfg)
    return {
        "run_id": run_id,
        "iteration": version,
        "policy_version": version,
        "experiment_name": cfg.trainer.experiment_name,
        "config_hash": cfg.config_hash(),
        "resume_hash": resume_hash(cfg),
        "data_cursor": {
            "position": position,
            "epoch": position // max(num_train_prompts, 1),
            "position_in_epoch": position % max(num_train_prompts, 1),
            "num_train_prompts": num_train_prompts,
        },
        # the seeds iteration `version` uses (stages/seeds.py)
        "seeds": seeds.recorded(cfg, version),
    }


def trainer_state_files(cfg: RunConfig, version: int, num_train_prompts: int) -> dict[str, str]:
    """{STATE_FILE: text} of trainer_state(...) for run cfg.run_id: committed with checkpoint policy_v<version> by
    the asset that writes it (initial_policy, policy_checkpoint), so a run from `rlake train` and an iteration
    launched from the Dagster UI leave the same state, inside the checkpoint's one commit."""
    return {
        STATE_FILE: json.dumps(trainer_state(cfg, cfg.run_id, version, num_train_prompts), indent=1, sort_keys=True)
    }


def write_trainer_state(policy_dir: str | Path, state: dict) -> Path:
    """policy_dir/trainer_state.json, written whole or not at all (atomic_write_text)."""
    return atomic_write_text(Path(policy_dir) / STATE_FILE, json.dumps(state, indent=1, sort_keys=True))


def save_trainer_state(cfg: RunConfig, policy_dir: str | Path, version: int, num_train_prompts: int) -> Path:
    """Write trainer_state(...) next to checkpoint policy_v<version> of run cfg.run_id. The one driver of it:
    the asset that wrote the checkpoint calls it (initial_policy, policy_checkpoint), so a run from
    `rlake train` and an iteration launched from the Dagster UI leave the same state file."""
    return write_trainer_state(policy_dir, trainer_state(cfg, cfg.run_id, version, num_train_prompts))


def read_trainer_state(policy_dir: str | Path) -> dict | None:
    path = Path(policy_dir) / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def completed_iterations(metrics_uri: str, run_id: str, storage_options: dict | None = None) -> set[int]:
    """Iterations of run_id whose iteration_metrics partition exists (-1 = set-up done)."""
    if not DeltaTable.is_deltatable(metrics_uri, storage_options=storage_options):
        return set()
    table = DeltaTable(metrics_uri, storage_options=storage_options)
    df = table.to_pandas(partitions=[("run_id", "=", run_id)], columns=["iteration"])
    return {int(i) for i in df["iteration"].unique()}


def resume_point(done: set[int], versions: list[int], lag: int = 0) -> tuple[bool, int]:
    """(run_setup, start_iteration) from completed iterations and kept checkpoint versions.

    The first iteration without metrics is k; it needs policy v_k, and its rollouts need v_{k-lag}
    (lag = trainer.policy_lag: 1 with one_step_off). Roll back to the newest kept version s <= k whose
    sampling version max(s - lag, 0) is kept too (older iterations are re-run; their writes replace their
    partitions)."""
    if SETUP_ITERATION not in done or 0 not in versions:
        return True, 0
    k = 0
    while k in done:
        k += 1
    kept = set(versions)
    return False, max(v for v in versions if v <= k and max(v - lag, 0) in kept)


def find_resumable_run(
    checkpoints_root: str | Path,
    experiment_name: str,
    rhash: str,
    total: int,
    *,
    options: dict[str, str] | None = None,
    cache_dir: str | None = None,
) -> str | None:
    """Run id of the newest unfinished run of this experiment and resume hash (by its newest checkpoint's commit
    time), among the runs under checkpoints_root (a local directory or a storage URI)."""
    root = uris.normalize(checkpoints_root)
    if uris.is_local(root) and not Path(root).is_dir():
        return None
    best: tuple[float, str] | None = None
    for run in objects.list_prefixes(objects.open_store(root, options), ""):
        ms = ModelStore(root, run, cache_dir=cache_dir, options=options)
        versions = ms.versions()
        if not versions or versions[-1] >= total:
            continue  # not a run, or finished (policy v_total exists)
        state = next((s for v in reversed(versions) if (s := ms.read_file(v, STATE_FILE)) is not None), None)
        if state is None:
            continue
        state = json.loads(state)
        if state.get("experiment_name") != experiment_name or state.get("resume_hash") != rhash:
            continue
        when = _committed_at(ms, int(state["iteration"]))
        if best is None or when > best[0]:
            best = (when, run)
    return best[1] if best else None


def _committed_at(ms: ModelStore, version: int) -> float:
    """When a version was committed (its manifest's time; a local pre-manifest checkpoint: its state's mtime)."""
    m = ms.manifest(version) or {}
    if "committed_at" in m:
        return float(m["committed_at"])
    return (ms.policy_dir(version) / STATE_FILE).stat().st_mtime if ms.local else 0.0


def check_trainer_state(state: dict | None, cfg: RunConfig, policy_dir: Path, version: int) -> None:
    """A resume from policy_dir must continue the same computation: same resume hash, same iteration."""
    if state is None:
        return  # killed between the checkpoint and its state file: the Delta tables decided the point
    if state.get("iteration") != version:
        raise ValueError(
            f"{policy_dir / STATE_FILE} says iteration {state.get('iteration')}, but the directory is "
            f"policy_v{version}: the checkpoint directory was renamed or copied over; "
            "resume from the directory its state names, or delete the stale state file."
        )
    if state.get("resume_hash") != resume_hash(cfg) and not cfg.trainer.resume_allow_config_change:
        raise ValueError(
            f"cannot resume from {policy_dir}: it was written under config hash {state.get('resume_hash')} "
            f"(config_hash {state.get('config_hash')}), this config hashes to {resume_hash(cfg)}, so the resumed "
            "iterations would not continue the same run. Resume with the run's original config, start a new run "
            "(trainer.resume_mode=disable or another --run-id), or set trainer.resume_allow_config_change=true."
        )
    cursor = state.get("data_cursor", {})
    if cursor.get("position") != version * cursor_batch_size(cfg):
        raise ValueError(
            f"{policy_dir / STATE_FILE}: data cursor position {cursor.get('position')} != iteration "
            f"{version} x {cursor_batch_size(cfg)} prompts per iteration; the batch size changed "
            "since the checkpoint: resume with the original data.train_batch_size / gen_batch_size."
        )


def expected_model_signature(model_cfg: ModelConfig) -> dict | None:
    """architectures / vocab / width / depth the run's model has (None when it cannot be known cheaply)."""
    if model_cfg.path == "tiny":
        t = model_cfg.tiny
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": len(build_char_tokenizer(tool_tokens=t.tool_tokens)),
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_hidden_layers,
        }
    path = Path(model_cfg.path) / "config.json"
    if not path.is_file():
        return None
    conf = json.loads(path.read_text())
    return {k: conf.get(k) for k in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers")}


def check_causal_lm_dir(path: str | Path, *, what: str) -> dict:
    """config.json of an HF causal-LM checkpoint dir, or a clear error; returns the config dict."""
    p = Path(path)
    conf_path = p / "config.json"
    if not conf_path.is_file():
        raise FileNotFoundError(
            f"{what} '{p}' is not an HF checkpoint directory (no config.json); point it at a "
            "directory written by save_pretrained (e.g. output_dir/checkpoints/<run>/policy_vN)."
        )
    conf = json.loads(conf_path.read_text())
    archs = conf.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(
            f"{what} '{p}' holds a {archs or conf.get('model_type')} model, not a causal LM "
            "(architectures must name a *ForCausalLM class): RL training generates with and updates "
            "a causal LM; point it at a causal-LM checkpoint (e.g. Qwen2ForCausalLM, LlamaForCausalLM)."
        )
    return conf


def check_architecture(ckpt_dir: str | Path, model_cfg: ModelConfig) -> None:
    """The checkpoint must be the run's model architecture (else loading it would fail or mis-train)."""
    conf = check_causal_lm_dir(ckpt_dir, what="checkpoint")
    want = expected_model_signature(model_cfg)
    if want is None:
        return
    diff = {k: (conf.get(k), v) for k, v in want.items() if conf.get(k) != v}
    if diff:
        listed = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise ValueError(
            f"checkpoint '{ckpt_dir}' is another architecture than this run's model "
            f"(model.path={model_cfg.path!r}): {listed}. Resume with the config the checkpoint was "
            "trained with, or start a fresh run (trainer.resume_mode=disable)."
        )


# long: one decision table (disable / fresh / resumable / done / resume), each case a return with its reason
def plan_resume(cfg: RunConfig, run_id: str | None, total: int | None = None) -> ResumePlan:
    """Decide where `rlake train` starts. run_id: --run-id or trainer.run_id (None: not given);
    total: iterations the run should reach (default trainer.total_training_steps)."""
    ckpt_root, metrics_uri = uris.checkpoints_root(cfg), uris.join(uris.tables_root(cfg), "iteration_metrics")
    total = cfg.trainer.total_training_steps if total is None else total
    mode = cfg.trainer.resume_mode
    if mode == "resume_path":
        return _plan_from_path(cfg, run_id, Path(uris.local_path(ckpt_root)), total)
    if mode == "disable":
        exists = run_id and ModelStore.for_config(cfg, run_id).versions()
        note = f" (run {run_id} exists: its partitions are replaced)" if exists else ""
        return ResumePlan(run_id, 0, True, f"resume_mode=disable: starting at iteration 0{note}")
    given = run_id is not None
    if run_id is None:
        run_id = find_resumable_run(
            ckpt_root,
            cfg.trainer.experiment_name,
            resume_hash(cfg),
            total,
            options=uris.storage_options(cfg),
            cache_dir=cfg.storage.cache_dir,
        )
        if run_id is None:
            return ResumePlan(
                None,
                0,
                True,
                "resume_mode=auto: no unfinished run of experiment "
                f"'{cfg.trainer.experiment_name}' with resume hash {resume_hash(cfg)}: starting fresh",
            )
    ms = ModelStore.for_config(cfg, run_id)
    done, versions = completed_iterations(metrics_uri, run_id, uris.storage_options(cfg)), ms.versions()
    if not done and not versions:
        return ResumePlan(run_id, 0, True, f"resume_mode=auto: run {run_id} does not exist yet: starting fresh")
    setup, start = resume_point(done, versions, cfg.trainer.policy_lag)
    if not setup:
        start_dir = ms.fetch(start, needed_by="the resume checks")  # a remote root: this node's cached copy
        check_architecture(start_dir, cfg.model)
        check_trainer_state(read_trainer_state(start_dir), cfg, start_dir, start)
    if not setup and start >= total:
        return ResumePlan(
            run_id,
            start,
            False,
            f"resume_mode=auto: run {run_id} already ran {start} of "
            f"trainer.total_training_steps={total} iterations: nothing to do (raise "
            "total_training_steps to continue it, or pass another --run-id)",
        )
    first_missing = next((k for k in range(total + 1) if k not in done), total)
    how = "given run id" if given else "newest unfinished run of this experiment and config"
    where = "set-up (incomplete)" if setup else f"iteration {start} from policy_v{start}"
    rolled = (
        f", rolled back from iteration {first_missing} to the newest kept checkpoint"
        if not setup and start < first_missing
        else ""
    )
    return ResumePlan(
        run_id,
        start,
        setup,
        f"resume_mode=auto: resuming {run_id} ({how}) at {where}{rolled}; "
        f"completed iterations: {sorted(i for i in done if i >= 0)}",
    )


def _plan_from_path(cfg: RunConfig, run_id: str | None, ckpt_root: Path, total: int) -> ResumePlan:
    path = Path(cfg.trainer.resume_from_path).resolve()
    m = _VERSION_DIR.match(path.name)
    if not path.is_dir() or m is None:
        raise FileNotFoundError(
            f"trainer.resume_from_path '{path}' is not a policy_v<N> checkpoint directory; "
            f"pick one of {sorted(str(p) for p in ckpt_root.glob('*/policy_v*'))[:8]}."
        )
    if path.parent.parent != ckpt_root:
        raise ValueError(
            f"trainer.resume_from_path '{path}' is not under this run's checkpoints ({ckpt_root}): "
            "a resumed run continues the Delta tables of the same output_dir; set trainer.output_dir "
            f"to '{path.parent.parent.parent}' or copy the checkpoint there."
        )
    ckpt_run = path.parent.name
    if run_id is not None and run_id != ckpt_run:
        raise ValueError(
            f"--run-id/trainer.run_id '{run_id}' differs from the run of resume_from_path ('{ckpt_run}'); "
            "drop the run id or resume from a checkpoint of that run."
        )
    version = int(m.group(1))
    check_architecture(path, cfg.model)
    check_trainer_state(read_trainer_state(path), cfg, path, version)
    return ResumePlan(
        ckpt_run, version, False, f"resume_mode=resume_path: resuming {ckpt_run} at iteration {version} from {path}"
    )
