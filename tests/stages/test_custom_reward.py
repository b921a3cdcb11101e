"""Your own reward function (reward.custom_reward_function, verl-compatible) on real components: a file in
tmp_path (outside the repository), Ray tasks of the session's local cluster, Delta tables and DuckDB SQL;
plus scorers that installed packages register under the `rlake.rewards` entry-point group."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from configs.schema import RewardConfig
from stages.data.custom_reward import read_custom_reward
from stages.data.rewards import ENTRY_POINT_GROUP, scorer_for
from stages.io import store
from stages.io.sql import query
from stages.scored_rollouts import RewardStage, score_rollouts, typed_extras
from stages.workers.tasks import map_with_tasks

ROOT = Path(__file__).resolve().parents[2]

FORMAT_REWARD = """
import os
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    found = re.findall(r"#### (-?[0-9]+)", solution_str)
    correct = bool(found) and found[-1] == ground_truth
    return {
        "score": float(correct) + bonus,
        "format_ok": bool(found),
        "idx": extra_info.get("index"),
        "pid": os.getpid(),
    }
"""


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    assert ROOT not in path.parents  # a file anywhere, not in rlake's tree
    return path


def _sha12(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:12]


def _rollouts(n: int, source: str = "my/own_task", with_extra_info: bool = True) -> pd.DataFrame:
    df = pd.DataFrame(
        {
            "rollout_id": range(n),
            "data_source": [source] * n,
            "response_text": [f"#### {i % 3}" if i % 2 == 0 else str(i) for i in range(n)],
            "ground_truth": ["0"] * n,
        }
    )
    if with_extra_info:
        df["extra_info"] = [json.dumps({"index": 100 + i, "split": "train"}) for i in range(n)]
    return df


def _table_rows(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the other columns of the rollouts table, so store.write_partition takes it."""
    n = len(df)
    return df.assign(
        policy_version=0,
        prompt_id=0,
        group_id=0,
        sample_index=list(range(n)),
        prompt_text="q",
        prompt_token_ids=[[1, 2]] * n,
        response_token_ids=[[3]] * n,
        rollout_logprobs=[[-0.1]] * n,
        response_length=1,
        finish_reason="stop",
        engine="hf",
        engine_sync="build",
        engine_weights_fingerprint="0123456789abcdef",
    )


def _cfg(path: Path, **custom) -> RewardConfig:
    return RewardConfig(custom_reward_function={"path": str(path), **custom})


@pytest.mark.ray
def test_custom_function_scores_in_ray_tasks_from_shipped_source(tmp_path, ray_session) -> None:
    path = _write(tmp_path, "format_reward.py", FORMAT_REWARD)
    df = _rollouts(12)
    stage = RewardStage(custom=read_custom_reward(_cfg(path, reward_kwargs={"bonus": 0.5}).custom_reward_function))
    path.unlink()  # the tasks run the source the stage carries: the file is not needed after the driver read it
    out = map_with_tasks(df, stage, parts=2, num_cpus=0.5)

    assert set(out["pid"]) and os.getpid() not in set(out["pid"])  # scored in Ray worker processes
    correct = [i % 2 == 0 and i % 3 == 0 for i in range(12)]
    assert out["reward"].tolist() == [float(c) + 0.5 for c in correct]  # reward_kwargs reached every call
    assert out["format_ok"].tolist() == [i % 2 == 0 for i in range(12)]  # an extra key is a column
    assert out["idx"].tolist() == [100 + i for i in range(12)]  # extra_info arrived as a dict
    assert out["reward_extra_keys"].tolist() == [["format_ok", "idx", "pid"]] * 12
    assert set(out["reward_fn"]) == {"format_reward.compute_score"}
    kwargs = _sha12('{"bonus":0.5}')  # reward_kwargs change the scores, so they are part of the version
    assert set(out["reward_version"]) == {f"format_reward.py:compute_score@{_sha12(FORMAT_REWARD)}+kwargs@{kwargs}"}
    assert out["reward_error"].isna().all()


@pytest.mark.ray
def test_score_rollouts_with_a_custom_function_through_ray(tmp_path, ray_session) -> None:
    path = _write(tmp_path, "format_reward.py", FORMAT_REWARD)
    out = score_rollouts(_rollouts(10), _cfg(path).model_copy(update={"num_workers": 2}))
    assert out["rollout_id"].tolist() == list(range(10))  # unknown data_source "my/own_task" is fine
    assert out["format_ok"].dtype == bool and out["idx"].tolist() == [100.0 + i for i in range(10)]


def test_async_function_awaits_the_rows_of_a_block_concurrently(tmp_path) -> None:
    path = _write(
        tmp_path,
        "judge.py",
        "import asyncio\n\n\n"
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    await asyncio.sleep(0.3)  # e.g. a call to an LLM judge\n"
        "    return {'score': float(solution_str.endswith(ground_truth)), 'judge': 'stub'}\n",
    )
    t0 = time.perf_counter()
    out = score_rollouts(_rollouts(8), _cfg(path), use_ray=False)
    took = time.perf_counter() - t0
    assert took < 1.5, f"8 rows x 0.3 s took {took:.2f}s: not awaited concurrently"
    assert out["score"].tolist() == [1.0 if t.endswith("0") else 0.0 for t in _rollouts(8)["response_text"]]
    assert set(out["judge"]) == {"stub"}


BATCHED = """
CALLS = []


{prefix}def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    CALLS.append(len(solution_strs))
    return [
        {{"score": scale * float(s.endswith(g)), "calls": len(CALLS), "split": e["split"]}}
        for s, g, e in zip(solution_strs, ground_truths, extra_infos)
    ]
"""


@pytest.mark.parametrize("prefix", ["", "async "])
def test_batched_function_gets_lists_once_per_block(tmp_path, prefix: str) -> None:
    path = _write(tmp_path, f"batch_{len(prefix)}.py", BATCHED.format(prefix=prefix))
    cfg = _cfg(path, batched=True, reward_kwargs={"scale": 2.0})
    out = score_rollouts(_rollouts(6), cfg, use_ray=False)
    assert out["score"].tolist() == [2.0 * t.endswith("0") for t in _rollouts(6)["response_text"]]
    assert out["calls"].tolist() == [1.0] * 6  # one call with all 6 rows
    assert set(out["split"]) == {"train"}


def test_rows_without_extra_info_pass_an_empty_dict(tmp_path) -> None:
    path = _write(
        tmp_path,
        "keys.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.0, 'n_keys': len(extra_info)}\n",
    )
    out = score_rollouts(_rollouts(3, with_extra_info=False), _cfg(path), use_ray=False)  # an older rollouts table
    assert out["n_keys"].tolist() == [0.0, 0.0, 0.0]
    # a null in a batch Ray Data hands over (pandas' NA, as in a string column with a missing value) is no dict
    rows = _rollouts(3).astype({"extra_info": "string"})
    rows.loc[1, "extra_info"] = pd.NA
    out = score_rollouts(rows, _cfg(path), use_ray=False)
    assert out["n_keys"].tolist()[1] == 0.0 and out["reward"].notna().all()


def test_a_plain_float_return_has_no_extra_columns_and_the_version_follows_the_source(tmp_path) -> None:
    src = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n"
    path = _write(tmp_path, "one.py", src)
    out = score_rollouts(_rollouts(2), _cfg(path), use_ray=False)
    assert out["reward"].tolist() == [1.0, 1.0] and out["reward_extra_keys"].tolist() == [[], []]
    assert set(out["reward_version"]) == {f"one.py:compute_score@{_sha12(src)}"}
    path.write_text(src.replace("return 1", "return 2"))
    again = score_rollouts(_rollouts(2), _cfg(path), use_ray=False)
    assert set(again["reward_version"]) != set(out["reward_version"]) and again["reward"].tolist() == [2.0, 2.0]


def test_the_version_follows_reward_kwargs_in_canonical_json(tmp_path) -> None:
    """Same source, other reward_kwargs, other scores: another reward_version; the same kwargs written in
    another order: the same version; none: the source's version alone (as before kwargs counted)."""
    path = _write(tmp_path, "format_reward.py", FORMAT_REWARD)

    def scored(**kwargs):
        cfg = _cfg(path, reward_kwargs=kwargs) if kwargs else _cfg(path)
        return score_rollouts(_rollouts(2), cfg, use_ray=False)

    plain, half, tenth = scored(), scored(bonus=0.5), scored(bonus=0.1)
    source_version = f"format_reward.py:compute_score@{_sha12(FORMAT_REWARD)}"
    assert set(plain["reward_version"]) == {source_version}
    assert half["reward"].tolist() != tenth["reward"].tolist()
    assert set(half["reward_version"]) == {
        f"{source_version}+kwargs@{_sha12(json.dumps({'bonus': 0.5}, separators=(',', ':')))}"
    }
    assert set(tenth["reward_version"]) != set(half["reward_version"])
    two = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, a=0, b=()):\n    return a\n"
    path2 = _write(tmp_path, "two.py", two)
    ab, ba = (
        read_custom_reward(_cfg(path2, reward_kwargs=kw).custom_reward_function).version
        for kw in ({"a": 1, "b": [2, "x"]}, {"b": [2, "x"], "a": 1})
    )
    canonical = '{"a":1,"b":[2,"x"]}'
    assert ab == ba == f"two.py:compute_score@{_sha12(two)}+kwargs@{_sha12(canonical)}"


def test_builtin_version_hashes_the_rule_reward_sources() -> None:
    out = RewardStage()(_rollouts(2, source="openai/gsm8k"))
    data = ROOT / "stages" / "data"
    digest = _sha12((data / "rewards.py").read_bytes() + (data / "math_grader.py").read_bytes())
    assert set(out["reward_version"]) == {f"stages.data.rewards:score_gsm8k@{digest}"}


def test_extra_keys_that_would_replace_rlake_columns_fail_under_either_on_error(tmp_path) -> None:
    path = _write(
        tmp_path,
        "clobber.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'reward': 5.0, 'response_length': 0}\n",
    )
    for on_error in ("raise", "flag"):
        with pytest.raises(ValueError, match=r"extra keys \['response_length', 'reward'\], which are rlake's own"):
            score_rollouts(_rollouts(2), _cfg(path).model_copy(update={"on_error": on_error}), use_ray=False)


def test_bad_returns_name_the_row_or_are_flagged(tmp_path) -> None:
    path = _write(
        tmp_path,
        "flaky.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['index'] == 101:\n"
        "        return 'oops'\n"
        "    if extra_info['index'] == 102:\n"
        "        return {'acc': True}\n"
        "    if extra_info['index'] == 103:\n"
        "        raise RuntimeError('judge unreachable')\n"
        "    return {'score': 1.0, 'note': 'fine'}\n",
    )
    with pytest.raises(
        ValueError, match=r"flaky.compute_score failed on rollout 1 \(data_source 'my/own_task'\): returned str 'oops'"
    ):
        score_rollouts(_rollouts(4), _cfg(path), use_ray=False)
    out = score_rollouts(_rollouts(4), _cfg(path).model_copy(update={"on_error": "flag"}), use_ray=False)
    assert out["reward"].iloc[0] == 1.0 and out["reward"].iloc[1:].isna().all()
    assert out["reward_error"].iloc[1].startswith("TypeError: returned str 'oops'")
    assert "returned a dict without 'score' (keys ['acc'])" in out["reward_error"].iloc[2]
    assert out["reward_error"].iloc[3] == "RuntimeError: judge unreachable"
    assert out["note"].tolist() == ["fine", None, None, None]  # a flagged row has no extra values


def test_a_key_only_some_blocks_return_is_none_elsewhere(tmp_path) -> None:
    path = _write(
        tmp_path,
        "late.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    late = extra_info['index'] >= 102\n"
        "    return {'score': 0.0, **({'verdict': 'late', 'late': True} if late else {})}\n",
    )
    stage = RewardStage(custom=read_custom_reward(_cfg(path).custom_reward_function))
    df = _rollouts(4)
    out = typed_extras(pd.concat([stage(df.iloc[:2]), stage(df.iloc[2:])], ignore_index=True))  # two blocks
    assert out["verdict"].tolist() == [None, None, "late", "late"]
    assert out["late"].tolist() == [None, None, True, True]
    assert out["reward_extra_keys"].tolist() == [[], [], ["late", "verdict"], ["late", "verdict"]]


def test_an_extra_key_mixing_strings_and_numbers_is_an_error(tmp_path) -> None:
    path = _write(
        tmp_path,
        "mixed.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.0, 'pred': 7 if extra_info['index'] % 2 else 'seven'}\n",
    )
    with pytest.raises(ValueError, match=r"reward extra key 'pred' has values of types \['int', 'str'\]"):
        score_rollouts(_rollouts(2), _cfg(path), use_ray=False)


def test_delta_gets_the_extra_columns_and_commits_record_reward_versions(tmp_path) -> None:
    uri = str(tmp_path / "tables" / "scored_rollouts")
    rollouts = _table_rows(_rollouts(4, source="openai/gsm8k"))
    v0 = store.write_partition(
        uri,
        "scored_rollouts",
        score_rollouts(rollouts, RewardConfig(), use_ray=False),
        run_id="r",
        iteration=0,
        lineage={"stage": "scored_rollouts"},
    )
    builtin = store.commit_lineage(uri)[0]["reward_versions"]
    assert len(builtin) == 1 and builtin[0].startswith("stages.data.rewards:score_gsm8k@")
    # re-score under a custom function: its extra columns merge into the table, its version into the commit
    path = _write(tmp_path, "format_reward.py", FORMAT_REWARD)
    scored = score_rollouts(rollouts, _cfg(path, reward_kwargs={"bonus": 0.5}), use_ray=False)
    store.write_partition(uri, "scored_rollouts", scored, run_id="r", iteration=0, lineage={"stage": "scored_rollouts"})
    kwargs = _sha12('{"bonus":0.5}')  # reward_kwargs are part of the version
    custom = f"format_reward.py:compute_score@{_sha12(FORMAT_REWARD)}+kwargs@{kwargs}"
    assert store.commit_lineage(uri)[0]["reward_versions"] == [custom]
    changed = query(
        tmp_path / "tables",
        "SELECT s.rollout_id, b.reward_version AS version_before, s.reward_version AS version_after, "
        "b.reward AS before, s.reward AS after, s.format_ok FROM scored_rollouts s "
        "JOIN old b USING (run_id, iteration, rollout_id) WHERE s.reward <> b.reward ORDER BY s.rollout_id",
        {"old:scored_rollouts": v0},
    )
    assert changed["rollout_id"].tolist() == [0, 1, 2, 3]  # +0.5 bonus on every row
    assert set(changed["version_before"]) == set(builtin) and set(changed["version_after"]) == {custom}
    assert changed["format_ok"].tolist() == [True, False, True, False]
    at_v0 = store.read_partition(uri, "r", 0, version=v0)  # time travel: the old version has no such column
    assert "format_ok" not in at_v0.columns


def test_a_table_from_before_reward_versions_gains_the_columns(tmp_path) -> None:
    from deltalake import write_deltalake

    from stages.io.tables import SCHEMAS

    uri = str(tmp_path / "scored_rollouts")
    rollouts = _table_rows(_rollouts(2))
    path = _write(tmp_path, "format_reward.py", FORMAT_REWARD)
    scored = score_rollouts(rollouts, _cfg(path), use_ray=False)
    new_fields = {"extra_info", "reward_version", "reward_extra_keys"}
    old_schema = SCHEMAS["scored_rollouts"]
    for name in new_fields:
        old_schema = old_schema.remove(old_schema.get_field_index(name))
    old = store.to_arrow("scored_rollouts", scored.assign(run_id="old", iteration=0)).select(old_schema.names)
    write_deltalake(uri, old, partition_by=["run_id", "iteration"])  # what an older rlake wrote
    store.write_partition(uri, "scored_rollouts", scored, run_id="new", iteration=0, lineage={"stage": "t"})
    old_rows = store.read_partition(uri, "old", 0)
    assert old_rows["reward_version"].isna().all() and old_rows["format_ok"].isna().all()
    assert store.read_partition(uri, "new", 0)["format_ok"].tolist() == [True, False]


def test_extra_key_names_must_be_column_names(tmp_path) -> None:
    path = _write(
        tmp_path,
        "spaces.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.0, 'has space': 1}\n",
    )
    with pytest.raises(ValueError, match="returned extra key 'has space', which is not a column name"):
        score_rollouts(_rollouts(1), _cfg(path), use_ray=False)


def _install_entry_point(tmp_path: Path, monkeypatch, entries: dict[str, str]) -> None:
    """A distribution `rlake-test-scorers` with `rlake.rewards` entry points, on sys.path for this test."""
    site = tmp_path / "site"
    (site / "rlake_test_scorers-0.1.dist-info").mkdir(parents=True)
    (site / "rlake_test_scorers-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rlake-test-scorers\nVersion: 0.1\n"
    )
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (site / "rlake_test_scorers-0.1.dist-info" / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    (site / "rlake_test_scorers.py").write_text(
        "def exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'source_seen': data_source}\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "rlake_test_scorers", raising=False)


def test_installed_package_scorer_via_entry_point(tmp_path, monkeypatch) -> None:
    _install_entry_point(
        tmp_path, monkeypatch, {"corp/qa": "rlake_test_scorers:exact", "openai/gsm8k": "rlake_test_scorers:exact"}
    )
    scorer = scorer_for("corp/qa")
    assert scorer.verl_call and scorer.name == "rlake_test_scorers.exact"
    assert scorer_for("openai/gsm8k").fn.__module__ == "stages.data.rewards"  # built-ins come first
    df = _rollouts(3, source="corp/qa").assign(response_text=["0", " 0 ", "1"])
    out = RewardStage()(df)
    assert out["reward"].tolist() == [1.0, 1.0, 0.0] and set(out["source_seen"]) == {"corp/qa"}
    source = (tmp_path / "site" / "rlake_test_scorers.py").read_text()
    assert set(out["reward_version"]) == {f"rlake_test_scorers:exact@{_sha12(source)}"}
    assert scorer_for("corp/qa").fn is sys.modules["rlake_test_scorers"].exact


def test_two_packages_registering_one_data_source_is_ambiguous(tmp_path, monkeypatch) -> None:
    _install_entry_point(tmp_path, monkeypatch, {"corp/qa": "rlake_test_scorers:exact"})
    other = tmp_path / "other" / "other_scorers-0.2.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: other-scorers\nVersion: 0.2\n")
    (other / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ncorp/qa = other_scorers:score\n")
    monkeypatch.syspath_prepend(str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"registered by several installed packages .*other_scorers:score"):
        scorer_for("corp/qa")
