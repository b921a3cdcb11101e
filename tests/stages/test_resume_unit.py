"""stages.run.resume over real Delta tables and checkpoint dirs under tmp_path; worker-group retry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from configs.schema import load_config
from stages.io import store
from stages.io.checkpoints import ModelStore
from stages.run.resume import (
    STATE_FILE,
    check_architecture,
    completed_iterations,
    find_resumable_run,
    plan_resume,
    read_trainer_state,
    resume_hash,
    resume_point,
    trainer_state,
    write_trainer_state,
)
from stages.workers.group import Worker

CI = "configs/ci_tiny.yaml"


def _cfg(out: Path, *more: str):
    return load_config(CI, [f"trainer.output_dir={out}", *more])


def _fake_checkpoint(ms: ModelStore, version: int, cfg=None, run_id: str = "R") -> Path:
    """A checkpoint dir with the tiny model's config.json (architecture signature only, no weights)."""
    d = ms.policy_dir(version)
    d.mkdir(parents=True, exist_ok=True)
    t = cfg.model.tiny if cfg else None
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "vocab_size": 84,
                "hidden_size": t.hidden_size if t else 64,
                "num_hidden_layers": 2,
            }
        )
    )
    if cfg is not None:
        write_trainer_state(d, trainer_state(cfg, run_id, version, 184))
    return d


def _metrics_partition(out: Path, run_id: str, it: int) -> None:
    rows = pd.DataFrame({"policy_version": it + 1, "metric": ["m"], "value": [1.0]})
    store.write_partition(
        str(out / "tables" / "iteration_metrics"),
        "iteration_metrics",
        rows,
        run_id=run_id,
        iteration=it,
        lineage={"stage": "t"},
    )


def test_resume_point_rolls_back_to_the_newest_kept_checkpoint() -> None:
    # setup (-1) and iterations 0..4 done, 5 missing; save_freq=2 kept 0, 2, 4 and latest 5, 6
    assert resume_point({-1, 0, 1, 2, 3, 4}, [0, 2, 4, 5, 6]) == (False, 5)
    # v5 was lost (pruned / never written): roll back to v4 and re-run iteration 4
    assert resume_point({-1, 0, 1, 2, 3, 4}, [0, 2, 4]) == (False, 4)
    # set-up incomplete: run set-up and start at 0
    assert resume_point({0}, [0]) == (True, 0) and resume_point({-1}, []) == (True, 0)
    # a hole: iteration 2 missing although 3 is done -> first missing wins
    assert resume_point({-1, 0, 1, 3}, [0, 1, 2, 3, 4]) == (False, 2)


def test_one_step_off_resumes_where_the_sampling_version_is_kept_too() -> None:
    # iterations 0..4 done, killed after v6 was written: iteration 5 needs v5 and its rollouts v4 (lag 1)
    assert resume_point({-1, 0, 1, 2, 3, 4}, [0, 2, 4, 5, 6], lag=1) == (False, 5)
    # kept 0, 2, 5, 6 (v4 lost): 5 needs v4 and 2 needs v1, neither kept -> 0; with v1 kept too -> 2
    assert resume_point({-1, 0, 1, 2, 3, 4}, [0, 2, 5, 6], lag=1) == (False, 0)
    assert resume_point({-1, 0, 1, 2, 3, 4}, [0, 1, 2, 5, 6], lag=1) == (False, 2)
    # iteration 1 samples from v0 as iteration 0 does
    assert resume_point({-1, 0}, [0, 1], lag=1) == (False, 1)


def test_trainer_state_records_cursor_and_seeds(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    st = trainer_state(cfg, "R", 3, num_train_prompts=20)
    # iteration 3 of batch 8 starts at cursor position 24 = epoch 1, position 4 of 20
    assert st["data_cursor"] == {"position": 24, "epoch": 1, "position_in_epoch": 4, "num_train_prompts": 20}
    assert st["seeds"]["rollout_seed"] == cfg.rollout.seed + 3 and st["iteration"] == 3
    write_trainer_state(tmp_path, st)
    assert read_trainer_state(tmp_path) == st and not (tmp_path / (STATE_FILE + ".tmp")).exists()


def test_resume_hash_ignores_run_control_but_not_training_settings(tmp_path) -> None:
    base = resume_hash(_cfg(tmp_path))
    assert resume_hash(_cfg(tmp_path, "trainer.total_training_steps=9", "trainer.save_freq=3")) == base
    assert resume_hash(_cfg(tmp_path, "actor.optim.lr=0.5")) != base


def test_auto_resume_of_a_given_run_and_of_the_newest_unfinished_one(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    ms = ModelStore(tmp_path / "checkpoints", "R")
    assert plan_resume(cfg, "R").run_setup and plan_resume(cfg, None).run_id is None  # nothing yet: fresh
    for v in (0, 1):
        _fake_checkpoint(ms, v, cfg)
    for it in (-1, 0):
        _metrics_partition(tmp_path, "R", it)
    assert completed_iterations(str(tmp_path / "tables" / "iteration_metrics"), "R") == {-1, 0}
    plan = plan_resume(cfg, "R")
    assert (plan.run_id, plan.start_iteration, plan.run_setup) == ("R", 1, False)
    assert plan_resume(cfg, None).run_id == "R"  # newest unfinished run of ci_tiny with this hash
    assert find_resumable_run(tmp_path / "checkpoints", "ci_tiny", "other-hash", 2) is None
    _fake_checkpoint(ms, 2, cfg)  # v2 = total_training_steps: finished
    assert plan_resume(cfg, None).run_id is None
    plan = plan_resume(_cfg(tmp_path, "trainer.resume_mode=disable"), "R")
    assert plan.start_iteration == 0 and plan.run_setup and "replaced" in plan.reason


def test_a_finished_run_does_nothing_and_can_be_extended(tmp_path) -> None:
    cfg = _cfg(tmp_path)  # total_training_steps = 2
    ms = ModelStore(tmp_path / "checkpoints", "R")
    for v in (0, 1, 2):
        _fake_checkpoint(ms, v, cfg)
    for it in (-1, 0, 1):
        _metrics_partition(tmp_path, "R", it)
    done = plan_resume(cfg, "R")
    assert done.start_iteration == 2 and "nothing to do" in done.reason
    longer = plan_resume(_cfg(tmp_path, "trainer.total_training_steps=4"), "R")  # same resume hash
    assert (longer.start_iteration, longer.run_setup) == (2, False) and "at iteration 2 from policy_v2" in longer.reason
    assert plan_resume(cfg, "R", total=4).start_iteration == 2  # --steps 4


def test_config_change_is_a_clear_error_unless_allowed(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    ms = ModelStore(tmp_path / "checkpoints", "R")
    for v in (0, 1):
        _fake_checkpoint(ms, v, cfg)
    for it in (-1, 0):
        _metrics_partition(tmp_path, "R", it)
    changed = _cfg(tmp_path, "actor.optim.lr=0.5")
    with pytest.raises(
        ValueError,
        match=r"written under config hash .* this config hashes to .*"
        r"resume_allow_config_change=true",
    ):
        plan_resume(changed, "R")
    assert (
        plan_resume(
            _cfg(tmp_path, "actor.optim.lr=0.5", "trainer.resume_allow_config_change=true"), "R"
        ).start_iteration
        == 1
    )


def test_resume_path_checks_location_run_and_architecture(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    ms = ModelStore(tmp_path / "checkpoints", "R")
    d = _fake_checkpoint(ms, 1, cfg)
    plan = plan_resume(_cfg(tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={d}"), None)
    assert (plan.run_id, plan.start_iteration, plan.run_setup) == ("R", 1, False)
    with pytest.raises(ValueError, match="differs from the run of resume_from_path"):
        plan_resume(_cfg(tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={d}"), "S")
    elsewhere = _cfg(tmp_path / "other", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={d}")
    with pytest.raises(ValueError, match="not under this run's checkpoints"):
        plan_resume(elsewhere, None)
    wide = _cfg(tmp_path, "model.tiny.hidden_size=128")
    with pytest.raises(
        ValueError, match=r"another architecture .*hidden_size: checkpoint 64 vs config 128.*Resume with"
    ):
        check_architecture(d, wide.model)


def test_remove_partial_deletes_only_tmp_dirs(tmp_path) -> None:
    ms = ModelStore(tmp_path, "R")
    _fake_checkpoint(ms, 0)
    (ms.dir / "policy_v1.tmp").mkdir()
    (ms.dir / "policy_v1.tmp" / "model.safetensors").write_bytes(b"partial")
    assert ms.remove_partial() == ["policy_v1.tmp"] and ms.versions() == [0]


class DiesOnce(Worker):
    """A worker whose process dies (os._exit: no exception, the process is gone) on the first block
    it sees; module level so Ray workers import it by name (tests.stages.test_resume_unit:DiesOnce)."""

    def __init__(self, rank: int, world: int, threads: int, shape: str = "", *, marker: str) -> None:
        super().__init__(rank, world, threads, shape)
        self.marker = marker

    def run(self, batch: pd.DataFrame) -> pd.DataFrame:
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return batch.assign(value=batch["x"] * 2.0, pid=os.getpid())


@pytest.mark.ray
def test_killed_stage_worker_is_retried_and_the_table_written_once(ray_session, tmp_path) -> None:
    from stages.workers.group import call_with_retry, worker_group
    from stages.workers.tasks import MAX_ACTOR_RESTARTS, split_frame

    marker = tmp_path / "died_once"
    df = pd.DataFrame({"x": range(10)})
    parts = call_with_retry(
        lambda: worker_group(DiesOnce, "dies-once", 2, marker=str(marker)),
        lambda g: g.call_each(DiesOnce.run, [(b,) for b in split_frame(df, 2)]),
        retries=MAX_ACTOR_RESTARTS,
    )
    out = pd.concat(parts, ignore_index=True)
    assert marker.exists()  # a worker really died
    assert sorted(out["x"]) == list(range(10)) and (out["value"] == out["x"] * 2.0).all()  # each row once
    rows = pd.DataFrame({"policy_version": 0, "metric": [f"x{i}" for i in out["x"]], "value": out["value"]})
    uri = str(tmp_path / "iteration_metrics")
    store.write_partition(uri, "iteration_metrics", rows, run_id="R", iteration=0, lineage={"stage": "t"})
    back = store.read_partition(uri, "R", 0)
    assert len(back) == 10 and back["metric"].is_unique and store.table_version(uri) == 0
