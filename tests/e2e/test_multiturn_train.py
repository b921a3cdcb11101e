"""`rlake train` with multi-turn tool calling on the ci-size tool task (configs/ci_tiny_tools.yaml): the real tiny
model calls the real calculator (Ray tasks), every turn is a row of the `turns` table, the spans of a rollout's
turns concatenate to its token ids exactly, and observation tokens carry no advantage."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stages.io import store
from stages.io.advantage_rows import advantage_frame

pytestmark = [pytest.mark.slow, pytest.mark.ray]
RUN = "mt-run"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_session):
    from pipelines.runner import run_training

    out = tmp_path_factory.mktemp("mt")
    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    summary = run_training("configs/ci_tiny_tools.yaml", [f"trainer.output_dir={out}"], run_id=RUN, log=lambda s: None)
    yield out, summary
    os.environ.pop("DAGSTER_HOME", None)


def read(out, table: str, it: int):
    if table == "advantages":  # its rows with the columns joined from rollouts (response_mask)
        return advantage_frame(str(out / "tables" / table), RUN, it)
    return store.read_partition(str(out / "tables" / table), RUN, it)


def test_turn_spans_concatenate_to_the_rollout_tokens(trained) -> None:
    out, _ = trained
    calculator_calls = 0
    for it in (0, 1):
        rollouts = read(out, "rollouts", it).set_index("rollout_id")
        turns = read(out, "turns", it).sort_values(["rollout_id", "turn_index"])
        assert set(turns["rollout_id"]) == set(rollouts.index)
        tool_rollouts = 0
        for rid, rows in turns.groupby("rollout_id"):
            r = rollouts.loc[rid]
            ids, mask = list(r["response_token_ids"]), list(r["response_mask"])
            pieces = [ids[s:e] for s, e in zip(rows["token_start"], rows["token_end"], strict=True)]
            assert [t for p in pieces for t in p] == ids
            spans = zip(rows["role"], rows["token_start"], rows["token_end"], strict=True)
            expected_mask = [int(role == "assistant") for role, s, e in spans for _ in range(s, e)]
            assert mask == expected_mask
            assert rows["role"].iloc[0] == "assistant"
            tool_rollouts += int((rows["role"] == "tool").any())
            # observation tokens: no engine log-prob (placeholders 0.0)
            lp = np.asarray(r["rollout_logprobs"])
            assert (lp[np.asarray(mask) == 0] == 0).all()
        # the warm-started model calls the calculator in some of its rollouts, and it answers
        assert tool_rollouts > 0
        tools = turns[turns["role"] == "tool"]
        assert tools["latency_s"].notna().all()
        # a call the model wrote badly (no parsable name, a misspelled tool) is an error observation, recorded
        assert tools.loc[tools["tool_name"].isna(), "error"].str.startswith("parse_error").all()
        assert tools.loc[~tools["tool_name"].isin(["calculator", None]), "error"].notna().all()
        calculator_calls += int((tools["tool_name"] == "calculator").sum())
        assert tools["observation"].str.len().gt(0).all()
    assert calculator_calls > 0


def test_observation_tokens_get_no_advantage(trained) -> None:
    out, _ = trained
    adv = read(out, "advantages", 0)
    masked = 0
    for m, a in zip(adv["response_mask"], adv["token_advantages"], strict=True):
        m, a = np.asarray(m), np.asarray(a)
        assert len(m) == len(a)
        assert (a[m == 0] == 0).all()
        masked += int((m == 0).sum())
    assert masked > 0


def test_lineage_and_metrics(trained) -> None:
    out, summary = trained
    (c,) = store.commit_lineage(str(out / "tables" / "turns"), run_id=RUN, iteration=1)
    rv = store.commit_lineage(str(out / "tables" / "rollouts"), run_id=RUN, iteration=1)[0]["version"]
    assert c["upstream"] == {"rollouts": rv} and c["policy_version"] == "1"
    metrics = read(out, "iteration_metrics", 1).set_index("metric")["value"]
    assert metrics["num_turns/mean"] >= 1 and 0 < metrics["multi_turn/tool_call_rate"] <= 1
