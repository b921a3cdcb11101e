"""Replay a policy update from stored tables: iteration N's update re-run from the advantages partition
at the version its lineage recorded, starting from the stored checkpoint policy_vN, into a scratch
directory; the replayed update metrics are compared to the logged ones (iteration_metrics) and the
replayed weights to the stored policy_v(N+1) when it is kept.

On CPU with the same worker count the replay is deterministic: the measured max relative difference
was 0 (bitwise) on ci_tiny. The default tolerance is REPLAY_RTOL relative (plus REPLAY_ATOL absolute,
for values near 0), to absorb a different thread count or BLAS build.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from configs.schema import RunConfig
from stages.io import store, uris
from stages.io.checkpoints import ModelStore
from stages.io.tables import PROMPTS_ITERATION
from stages.policy_checkpoint import run_update, update_request
from stages.run.resume import STATE_FILE, resume_hash
from stages.workers.group import ensure_ray_for, existing_workers, gc_run

REPLAY_RTOL = 1e-4
REPLAY_ATOL = 1e-7
SKIP_METRICS = ("actor/weights_loaded_from_disk",)
"""Update metrics that describe how the update ran, not what it computed."""


@dataclass
class ReplayReport:
    run_id: str
    iteration: int
    advantages_version: int
    rows: list[tuple[str, float, float, float, bool]] = field(default_factory=list)
    """(name, logged, replayed, relative difference, within tolerance)."""
    weights: tuple[float, float, bool] | None = None
    """Replayed vs stored policy_v(N+1): (max abs difference, max relative difference, within tolerance)."""

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(ok for *_, ok in self.rows) and (self.weights is None or self.weights[2])

    @property
    def max_rel_diff(self) -> float:
        return max([r[3] for r in self.rows] + ([self.weights[1]] if self.weights else []), default=0.0)

    def table(self) -> str:
        lines = [
            f"replay of run {self.run_id} iteration {self.iteration} (advantages version {self.advantages_version})",
            f"{'quantity':<34}{'logged':>16}{'replayed':>16}{'rel diff':>12}  ok",
        ]
        for name, a, b, rel, ok in self.rows:
            lines.append(f"{name:<34}{a:>16.8g}{b:>16.8g}{rel:>12.3g}  {'yes' if ok else 'NO'}")
        if self.weights is None:
            lines.append(f"weights: policy_v{self.iteration + 1} is not kept, not compared")
        else:
            lines.append(
                f"weights vs stored policy_v{self.iteration + 1}: max abs diff {self.weights[0]:.3g}, "
                f"max rel diff {self.weights[1]:.3g}  {'yes' if self.weights[2] else 'NO'}"
            )
        lines.append(f"max rel diff {self.max_rel_diff:.3g}: {'reproduced' if self.passed else 'NOT reproduced'}")
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-30)


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(a)


def recorded_inputs(cfg: RunConfig, iteration: int) -> tuple[int, dict[str, float], str]:
    """(advantages version, logged metrics, config hash) of the iteration, from iteration_metrics' lineage."""
    uri = uris.table_uri(cfg, "iteration_metrics")
    if iteration == PROMPTS_ITERATION or not store.table_exists(uri):
        raise FileNotFoundError(
            f"no iteration_metrics table at {uri}: replay needs a finished iteration of a run; "
            "check --config / storage.root / trainer.output_dir"
        )
    commits = store.commit_lineage(uri, run_id=cfg.run_id, iteration=iteration)
    if not commits:
        raise ValueError(
            f"run '{cfg.run_id}' has no iteration_metrics for iteration {iteration} in {uri}: "
            "replay needs an iteration whose policy update finished; check --run-id and --iteration "
            "(`rlake lineage iteration_metrics --run-id R` lists them)"
        )
    commit = commits[0]
    adv_version = commit["upstream"].get("advantages")
    if adv_version is None:
        raise ValueError(
            f"iteration_metrics commit {commit['version']} records no advantages version: "
            "it was written by an rlake without lineage of the advantages read; re-run the iteration"
        )
    rows = store.read_partition(uri, cfg.run_id, iteration, version=commit["version"])
    return int(adv_version), dict(zip(rows["metric"], rows["value"].astype(float), strict=True)), commit["config_hash"]


def _state(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return torch.load(path / "pytorch_model.bin", weights_only=True)
    out = {}
    for f in files:
        out |= load_file(str(f))
    return out


def compare_weights(replayed: Path | dict, stored: Path) -> tuple[float, float]:
    """(max abs difference, max relative difference = abs diff / max |stored| per tensor) over every tensor of the
    stored checkpoint. replayed: a checkpoint directory, or a state dict (HF names; it may also hold the tied
    lm_head a saved checkpoint leaves out)."""
    a, b = (replayed if isinstance(replayed, dict) else _state(replayed)), _state(stored)
    extra = set(a) - set(b) - ({"lm_head.weight"} if isinstance(replayed, dict) else set())
    if set(b) - set(a) or extra:
        raise ValueError(
            f"replayed weights and stored {stored} hold different tensors: {sorted((set(b) - set(a)) | extra)[:5]}"
        )
    max_abs = max_rel = 0.0
    for k, t in b.items():
        d = float((a[k].double() - t.double()).abs().max())
        max_abs = max(max_abs, d)
        max_rel = max(max_rel, d / max(float(t.double().abs().max()), 1e-30))
    return max_abs, max_rel


def _check_same_config(cfg: RunConfig, ms: ModelStore, iteration: int, lineage_hash: str) -> None:
    """Raise unless cfg computes what the run computed. The start checkpoint's trainer state records resume_hash
    (the config minus where outputs go and how long the run is), so a moved or copied output directory replays;
    a checkpoint without one is compared by the lineage's config_hash."""
    state = ms.read_file(iteration, STATE_FILE)
    recorded = json.loads(state).get("resume_hash") if state else None
    theirs, ours = (recorded, resume_hash(cfg)) if recorded else (lineage_hash, cfg.config_hash())
    if theirs != ours:
        raise ValueError(
            f"the config given (hash {ours}) is not the one run '{cfg.run_id}' trained "
            f"with (hash {theirs}), so the replay would not reproduce its update; pass the run's "
            "--config and the same key=value overrides (its config.yaml is logged to the MLflow run)"
        )


def replay_update(
    cfg: RunConfig, iteration: int, scratch_dir: str | Path, *, rtol: float = REPLAY_RTOL, atol: float = REPLAY_ATOL
) -> ReplayReport:
    """Re-run iteration `iteration`'s policy update of run cfg.run_id into scratch_dir and compare (the
    policy_checkpoint asset's request builder and update function, stages.policy_checkpoint)."""
    adv_version, logged, cfg_hash = recorded_inputs(cfg, iteration)
    ms = ModelStore.for_config(cfg)
    if iteration not in ms.versions():
        raise FileNotFoundError(
            f"replay of iteration {iteration} starts from policy_v{iteration} under {ms.uri}, which is not kept "
            f"(kept: {ms.versions()}); trainer.save_freq={cfg.trainer.save_freq} keeps every save_freq-th version "
            "plus the newest two, so replay an iteration whose version is kept or train with trainer.save_freq=1"
        )
    _check_same_config(cfg, ms, iteration, cfg_hash)
    scratch = Path(scratch_dir).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    req = update_request(
        cfg,
        iteration,
        advantages_uri=uris.table_uri(cfg, "advantages"),  # carries storage.options to the update workers
        advantages_version=adv_version,
        policy_dir=ms.require(iteration, needed_by=f"replay of iteration {iteration}"),
        out_dir=scratch / f"policy_v{iteration + 1}",
    )
    # the replayed weights come back through Ray's object store, so the comparison works whichever node trained
    # them (the scratch copy is on that node's disk); Megatron publishes none: its scratch copy is read here
    req = dataclasses.replace(req, weight_sync="object_store")
    ensure_ray_for(cfg)
    replayed = run_update(req)
    report = ReplayReport(cfg.run_id, iteration, adv_version)
    for name in sorted(k for k in replayed if k.startswith("actor/") and k in logged and k not in SKIP_METRICS):
        a, b = logged[name], float(replayed[name])
        report.rows.append((name, a, b, _rel(a, b), _close(a, b, rtol, atol)))
    if iteration + 1 in ms.versions():
        stored = ms.fetch(iteration + 1, needed_by="the replay's weight comparison")
        refs = ray.get(existing_workers("actor")[0].published_weights.remote(req.checkpoint_id))
        max_abs, max_rel = compare_weights(ray.get(refs[0]) if refs else Path(req.out_dir), stored)
        report.weights = (max_abs, max_rel, max_rel <= rtol)
    if cfg.ray.is_cluster:  # detached on a cluster: the replay's trainer group goes with the replay
        gc_run(cfg.run_id)
    return report
