"""The Dagster steps' memory on the reward -> advantages path does not grow with the partition (#36):
scored_rollouts streams the rollouts partition through the stage executor (stages/io/stage_exec.py), and the
advantages step streams scored_rollouts and joins old_logprobs batch by batch (stages/advantages.py)
instead of reading them whole.

Real Delta tables under tmp_path; each measurement runs in a fresh subprocess (ru_maxrss only ever grows, so a
process measures one size), which runs both steps as the assets do, one after the other.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = "mem"
SIZES = {0: 1_000, 1: 20_000, 2: 16}
"""iteration -> rollouts: the small and the large partition, and a 16-row one that warms the child up."""

pytestmark = pytest.mark.ray  # with the other table-stage tests (tests/stages/test_dataset_io.py)


def _rollouts(n: int, seed: int) -> pd.DataFrame:
    """n gsm8k rollouts in groups of 8 as the rollout stage writes them, ~128 prompt and ~256 response ids."""
    rng = np.random.default_rng(seed)
    group = np.arange(n) // 8
    resp = rng.integers(128, 385, n)
    answers = rng.integers(0, 1000, n // 8 + 1)[group]
    said = np.where(rng.random(n) < 0.5, answers, answers + 1)
    return pd.DataFrame(
        {
            "policy_version": 0,
            "rollout_id": np.arange(n),
            "prompt_id": group,
            "group_id": group,
            "sample_index": np.arange(n) % 8,
            "data_source": "openai/gsm8k",
            "ground_truth": [str(a) for a in answers.tolist()],
            "prompt_text": "what does she pay? " * 20,
            "prompt_token_ids": [rng.integers(0, 49152, 128, dtype=np.int32) for _ in range(n)],
            "response_token_ids": [rng.integers(0, 49152, k, dtype=np.int32) for k in resp.tolist()],
            "rollout_logprobs": [-rng.exponential(0.5, k).astype(np.float32) for k in resp.tolist()],
            "response_text": [f"{'she pays twelve ' * 30}#### {a}" for a in said.tolist()],
            "response_length": resp.astype(np.int32),
            "finish_reason": "stop",
            "engine": "hf",
            "engine_sync": "build",
            "engine_weights_fingerprint": "synthetic",
        }
    )


def _measure(tables: Path, iteration: int) -> float:
    """MB the child's peak RSS grew over partition `iteration`'s two steps, after a 16-row warm-up run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, str(tables), str(iteration)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"]


def _old_logprobs(rollouts: pd.DataFrame) -> pd.DataFrame:
    """The old_logprobs rows of `rollouts` as the old_logprobs stage writes them (engine log-probs + noise)."""
    rng = np.random.default_rng(7)
    old = [lp + rng.normal(0, 0.01, len(lp)).astype(np.float32) for lp in rollouts["rollout_logprobs"]]
    return pd.DataFrame({"rollout_id": rollouts["rollout_id"], "policy_version": 0, "old_logprobs": old}).assign(
        rollout_probs_diff_max=0.01, rollout_probs_diff_mean=0.005
    )


def test_reward_and_advantages_steps_peak_rss_does_not_grow_with_the_partition(tmp_path) -> None:
    from stages.io import store

    tables = tmp_path / "tables"
    for it, n in SIZES.items():
        rollouts = _rollouts(n, it)
        store.write_partition(str(tables / "rollouts"), "rollouts", rollouts, run_id=RUN, iteration=it, lineage={})
        olds = _old_logprobs(rollouts)
        store.write_partition(str(tables / "old_logprobs"), "old_logprobs", olds, run_id=RUN, iteration=it, lineage={})
    small, large = _measure(tables, 0), _measure(tables, 1)
    # Streamed, each step holds one batch (BATCH_ROWS = 1000 in the child) in and out, whatever the partition's
    # size, so 1k and 20k rows peak alike: measured 0 MB above the warm-up's peak at both sizes for the two steps.
    # The advantages step on the whole frame instead (stages.advantages.whole_frame, what it was before it
    # streamed) made the same child grow 0 MB at 1k and 992 MB at 20k; the reward step read whole (read_partition
    # + score_rollouts + write_partition) grew 242 MB at 20k on its own. The bound, 1.5x the 1k growth plus 40 MB
    # (pyarrow's pool keeping freed buffers, one-off caches), passes the streamed steps and fails either whole one.
    assert large <= 1.5 * small + 40, f"peak RSS grew {large:.0f} MB at 20k rows against {small:.0f} MB at 1k"


def _child(tables: str, iteration: int) -> None:
    """Score the warm-up partition and compute its advantages, then `iteration`'s, as the scored_rollouts and
    advantages assets do; print the peak RSS growth."""
    from configs.schema import RewardConfig, RunConfig
    from stages.advantages import Upstream, stream_advantages
    from stages.io import stage_exec
    from stages.scored_rollouts import score_partition
    from stages.scored_tokens import ScoredRollouts

    stage_exec.BATCH_ROWS = 1000
    src, scored = f"{tables}/rollouts", f"{tables}/scored_rollouts_{iteration}"

    def both_steps(it: int) -> None:
        run = score_partition(
            RewardConfig(), src, scored, run_id=RUN, iteration=it, version=None, lineage={}, data_min_rows=None
        )
        up = Upstream(  # the token columns come from the rollouts partition (stages/scored_tokens.py)
            ScoredRollouts(
                stage_exec.Partition(scored, RUN, it, run.version), stage_exec.Partition(src, RUN, it, None)
            ),
            old=stage_exec.Partition(f"{tables}/old_logprobs", RUN, it, None),
        )
        stream_advantages(RunConfig(), up, f"{tables}/advantages_{iteration}", lineage={}, batch_rows=1000)

    both_steps(2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    both_steps(iteration)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"growth_mb": after - before}))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))


@pytest.mark.parametrize("data_min_rows", [None, 0], ids=["in-process", "ray-data"])
def test_streamed_scoring_writes_what_the_whole_frame_path_wrote(tmp_path, ray_session, monkeypatch, data_min_rows):
    """Batches of 16 over 40 rows (3 files, one commit) hold the rows, types and lineage that score_rollouts on
    the whole frame and write_partition hold."""
    from configs.schema import RewardConfig
    from stages.io import stage_exec, store
    from stages.scored_rollouts import score_partition, score_rollouts

    monkeypatch.setattr(stage_exec, "BATCH_ROWS", 16)
    src, cfg = str(tmp_path / "rollouts"), RewardConfig(on_error="flag")
    rollouts = _rollouts(40, 0).sample(frac=1.0, random_state=0)  # shuffled: each batch is sorted by rollout_id
    store.write_partition(src, "rollouts", rollouts, run_id=RUN, iteration=0, lineage={})
    whole = score_rollouts(store.read_partition(src, RUN, 0), cfg, use_ray=False)
    store.write_partition(str(tmp_path / "whole"), "scored_rollouts", whole, run_id=RUN, iteration=0, lineage={})
    meta = {"stage": "scored_rollouts", "upstream": {"rollouts": 0}}
    run = score_partition(
        cfg,
        src,
        str(tmp_path / "streamed"),
        run_id=RUN,
        iteration=0,
        version=0,
        lineage=lambda s: meta,
        data_min_rows=data_min_rows,
    )
    assert (run.rows, run.mode, run.version) == (40, "local" if data_min_rows is None else "ray", 0)
    got, want = (
        store.read_partition(str(tmp_path / name), RUN, 0).sort_values("rollout_id").reset_index(drop=True)
        for name in ("streamed", "whole")
    )
    pd.testing.assert_frame_equal(got[list(want.columns)], want)
    (commit,) = store.commit_lineage(str(tmp_path / "streamed"))
    assert commit["upstream"] == {"rollouts": 0} and commit["table"] == "scored_rollouts"


@pytest.mark.cluster  # the S3 server, as tests/stages/test_storage_s3.py
def test_streamed_scoring_reads_and_writes_s3(s3_env, monkeypatch) -> None:
    """On s3:// the in-process mode reads the files through the table's object store and writes through
    stages/io/objects.py: the same rows as score_rollouts on the whole frame, in one commit."""
    import uuid

    from assets.resources import RolloutStoreResource
    from configs.schema import RewardConfig
    from stages.io import stage_exec
    from stages.scored_rollouts import score_partition, score_rollouts

    monkeypatch.setattr(stage_exec, "BATCH_ROWS", 8)
    res = RolloutStoreResource(root=s3_env.root(f"exec-{uuid.uuid4().hex[:8]}"), storage_options=s3_env.storage_options)
    res.write("rollouts", _rollouts(20, 0), run_id=RUN, iteration=0, lineage={})
    run = score_partition(
        RewardConfig(), res.uri("rollouts"), res.uri("scored_rollouts"), run_id=RUN, iteration=0, version=0, lineage={}
    )
    got, version = res.read("scored_rollouts", RUN, 0)
    want = score_rollouts(res.read("rollouts", RUN, 0)[0], RewardConfig(), use_ray=False)
    assert (run.mode, run.version, version) == ("local", 0, 0)
    got = got.sort_values("rollout_id").reset_index(drop=True)
    assert got["reward"].tolist() == want["reward"].tolist() and got["score"].tolist() == want["score"].tolist()
