"""Stages on a real local Ray: rollouts on the rollout workers, the update on the actor group (gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from configs.schema import ActorConfig, OptimConfig, RolloutConfig
from stages.io import store
from stages.models.policy import encode_chat, load_policy
from stages.policy_checkpoint import run_update
from stages.rollouts import generate_rollouts
from stages.train.actor import ppo_update
from stages.train.optim import make_optimizer
from stages.train.ppo_loop import global_minibatch_count, minibatches
from stages.workers.actor_worker import METRICS_FILE, shard_for_rank
from stages.workers.requests import UpdateRequest

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import as_trainer_rows, make_rows

pytestmark = pytest.mark.ray


def _plain(value):
    """A list cell as a plain list (a Delta read gives numpy arrays, rows sent back give lists)."""
    return [float(v) for v in value] if hasattr(value, "__len__") and not isinstance(value, str) else value


def test_shard_for_rank_splits_every_mini_batch() -> None:
    assert shard_for_rank(8, 4, 0, 2) == [0, 1, 4, 5] and shard_for_rank(8, 4, 1, 2) == [2, 3, 6, 7]


def test_a_batch_short_of_whole_mini_batches_keeps_its_steps_on_every_rank() -> None:
    """31 of 32 rollouts left (one flagged by the reward stage, reward.on_error=flag): every row on exactly one
    rank (the read used to index past the table: IndexError), the same 2 optimizer steps per epoch as 32 rows,
    and a whole batch cut exactly as before (mini-batches of per_worker_mini rows, in permutation order)."""
    shards = [shard_for_rank(31, 16, rank, 2) for rank in range(2)]
    assert [len(s) for s in shards] == [15, 16] and sorted(shards[0] + shards[1]) == list(range(31))
    assert shard_for_rank(31, 16, 0, 1) == list(range(31))
    sizes = [len(m) for m in minibatches(31, 16, 2, torch.Generator().manual_seed(0))]
    assert sizes == [16, 15, 16, 15] and global_minibatch_count(31, 16) == (31, 2)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    cut = list(minibatches(32, 16, 1, torch.Generator().manual_seed(0)))
    assert [m.tolist() for m in cut] == [order[:16].tolist(), order[16:].tolist()]
    # ranks with 15 and 16 rows of 31 both take ceil(31 / 16) = 2 steps
    assert [len(list(minibatches(len(s), 8, 1, torch.Generator(), steps=2))) for s in shards] == [2, 2]


def test_rollouts_on_rollout_workers(ray_session, tiny_checkpoint) -> None:
    _, tok = load_policy(tiny_checkpoint)
    import pandas as pd

    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i}+1="}])[0] for i in range(6)]
    batch = pd.DataFrame(
        {"prompt_id": range(6), "prompt_token_ids": prompts, "group_id": range(6), "policy_version": 0}
    )
    cfg = RolloutConfig(name="hf", n=3, num_workers=2)
    out = generate_rollouts(batch, model_dir=str(tiny_checkpoint), rollout_cfg=cfg, max_tokens=5, seed=0)
    assert len(out) == 18 and out["rollout_id"].tolist() == list(range(18))
    assert out.groupby("prompt_id")["sample_index"].apply(sorted).tolist() == [[0, 1, 2]] * 6
    assert (out["response_length"] == out["response_token_ids"].map(len)).all()
    assert (out["rollout_logprobs"].map(len) == out["response_length"]).all()
    assert set(out["finish_reason"]) <= {"stop", "length"} and set(out["engine"]) == {"hf"}
    again = generate_rollouts(
        batch, model_dir=str(tiny_checkpoint), rollout_cfg=cfg, max_tokens=5, seed=0, use_ray=False
    )
    # sampling is seeded per batch: Ray's 2 shards see different seeds than one in-process batch, but
    # both runs produce valid rows for every prompt
    assert again["prompt_id"].tolist() == out["prompt_id"].tolist()


def test_two_rollout_ranks_write_the_partition_in_rollout_id_order(ray_session, tiny_checkpoint, tmp_path) -> None:
    """The ranks number and write their own rows; the step commits the files once and never holds a row. Prompt
    ids out of order and one repeated: the table still reads in rollout_id order, each rank's file one contiguous
    id range, and it equals the rows the same two ranks send back."""
    import pandas as pd

    from stages.io import dataset_io
    from stages.rollouts import generate_shards
    from stages.workers.shard_io import Sink
    from stages.workers.sharded import commit_shards

    _, tok = load_policy(tiny_checkpoint)
    ids = [4, 0, 3, 0, 5]  # prompt 0 twice: its rows come in row order, (prompt_id, row) ascending
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i}+1="}])[0] for i in ids]
    batch = pd.DataFrame({"prompt_id": ids, "prompt_token_ids": prompts, "group_id": range(5), "policy_version": 0})
    batch = batch.assign(prompt_text=[f"{i}+1=" for i in ids], data_source="rlake/arith", ground_truth="1")
    cfg = RolloutConfig(name="hf", n=2, num_workers=2)
    kw = {"model_dir": str(tiny_checkpoint), "rollout_cfg": cfg, "max_tokens": 4, "seed": 0}
    sink = Sink(str(tmp_path / "rollouts"), "rollouts", "r", 0)
    results = generate_shards(batch, sink=sink, first_id=10, stamp={"gen_round": 0}, **kw)
    assert [r.frame for r in results] == [None, None] and [r.rows for r in results] == [4, 6]
    written = [dataset_io.read_file_records(sink.uri, r.files, ["rollout_id"])["rollout_id"].tolist() for r in results]
    assert written == [list(range(10, 14)), list(range(14, 20))]  # one contiguous id range per rank, sorted
    version = commit_shards(sink, results, {"stage": "test"})
    table = store.read_partition(sink.uri, "r", 0, version=version)
    # by hand: (prompt_id, row) order is 0 (row 1), 0 (row 3), 3, 4, 5; n = 2 ids each from 10
    assert table["rollout_id"].tolist() == list(range(10, 20))
    assert table["group_id"].tolist() == [1, 1, 3, 3, 2, 2, 0, 0, 4, 4]
    assert table["sample_index"].tolist() == [0, 1] * 5 and set(table["gen_round"]) == {0}
    back = generate_rollouts(batch, first_id=10, stamp={"gen_round": 0}, **kw)
    for column in ["rollout_id", "group_id", "response_token_ids", "rollout_logprobs", "finish_reason"]:
        assert table[column].map(_plain).tolist() == back[column].map(_plain).tolist(), column
    summary = results[0].summary
    assert summary["rows"] == 4 and [s["rollout_id"] for s in summary["samples"]] == [10, 11, 12, 13]


def test_two_gloo_workers_equal_single_process(ray_session, tiny_checkpoint, tmp_path) -> None:
    """DDP over 2 gloo workers == one process on the whole batch (one mini-batch, seq-mean-token-mean)."""
    df = make_rows(16)
    uri = str(tmp_path / "advantages")
    version = store.write_partition(uri, "advantages", df, run_id="r", iteration=0, lineage={"stage": "test"})
    actor = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size=4,
        num_workers=2,
        loss_agg_mode="seq-mean-token-mean",
        optim=OptimConfig(lr=1e-3),
    )
    req = UpdateRequest(
        run_id="r",
        iteration=0,
        advantages_uri=uri,
        advantages_version=version,
        policy_dir=str(tiny_checkpoint),
        out_dir=str(tmp_path / "v1"),
        actor=actor,
        n_per_prompt=4,
        seed=0,
    )
    metrics = run_update(req)
    # the metrics return through Ray; the file beside the checkpoint is a record of the same numbers
    assert metrics["actor/num_rollouts"] == 16.0
    assert json.loads((tmp_path / "v1" / METRICS_FILE).read_text())["actor/num_rollouts"] == 16.0
    assert (tmp_path / "v1" / "optimizer.pt").is_file() and metrics["timing_s/update"] > 0
    ddp, _ = load_policy(tmp_path / "v1")

    model, tok = load_policy(tiny_checkpoint)
    single = actor.model_copy(update={"num_workers": 1, "ppo_micro_batch_size": 8})
    opt, sched = make_optimizer(model, single.optim)
    ref = ppo_update(model, opt, sched, as_trainer_rows(df), single, n_per_prompt=4, pad_id=tok.pad_token_id)
    assert metrics["actor/pg_loss"] == pytest.approx(ref["actor/pg_loss"], abs=1e-6)
    worst = max((a - b).abs().max().item() for a, b in zip(ddp.state_dict().values(), model.state_dict().values()))
    assert worst < 1e-5, f"max |w_ddp - w_single| = {worst:.2e}"
    changed = sum(
        not torch.equal(a, b)
        for a, b in zip(ddp.state_dict().values(), load_policy(tiny_checkpoint)[0].state_dict().values())
    )
    assert changed == len(ddp.state_dict())


@pytest.mark.parametrize("weight_sync", ["object_store", "storage"])
def test_new_weights_reach_the_engines_through_the_object_store(
    ray_session, tiny_checkpoint, tmp_path, weight_sync
) -> None:
    """rollout.weight_sync=object_store: the trainer's rank 0 puts version 1 in Ray's object store and the rollout
    engine takes it from there, reading no weight file (they are deleted first); `storage` loads the checkpoint."""
    import pandas as pd

    from stages.models.fingerprint import fingerprint_checkpoint

    df = make_rows(16)
    uri = str(tmp_path / "advantages")
    version = store.write_partition(uri, "advantages", df, run_id="r", iteration=0, lineage={"stage": "test"})
    actor = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=8, num_workers=1, optim=OptimConfig(lr=1e-2))
    v1 = tmp_path / "v1"
    req = UpdateRequest(
        run_id="r", iteration=0, advantages_uri=uri, advantages_version=version, policy_dir=str(tiny_checkpoint),
        out_dir=str(v1), actor=actor, n_per_prompt=4, seed=0, weight_sync=weight_sync,
    )  # fmt: skip
    _, tok = load_policy(tiny_checkpoint)
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i}+1="}])[0] for i in range(2)]
    batch = pd.DataFrame(
        {"prompt_id": range(2), "prompt_token_ids": prompts, "group_id": range(2), "policy_version": 0}
    )
    cfg = RolloutConfig(name="hf", n=2, num_workers=1, weight_sync=weight_sync)
    first = generate_rollouts(batch, model_dir=str(tiny_checkpoint), rollout_cfg=cfg, max_tokens=3, seed=0)
    assert set(first["engine_sync"]) <= {"build", "cached", "in_place"}  # version 0 is not the trainer's
    run_update(req)
    want = fingerprint_checkpoint(v1)
    assert want != fingerprint_checkpoint(tiny_checkpoint)
    if weight_sync == "object_store":
        for f in v1.glob("*.safetensors"):
            f.unlink()
    out = generate_rollouts(batch, model_dir=str(v1), rollout_cfg=cfg, max_tokens=3, seed=0)
    expected = "object_store" if weight_sync == "object_store" else "in_place"
    assert set(out["engine_sync"]) == {expected}
    assert set(out["engine_weights_fingerprint"]) == {want}
