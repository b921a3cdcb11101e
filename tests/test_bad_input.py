"""Bad input fails with a what / why / fix message before any expensive work (warm start, Ray, Dagster).

Each `rlake train` case goes through the real CLI entry point (`pipelines.cli.main`) and checks the
exit code, the message, the time taken, and that no table, checkpoint or Dagster instance was made.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from pipelines.cli import main

CI = "configs/ci_tiny.yaml"


def _fails_early(tmp_path: Path, capsys, *overrides: str, match: list[str], existing: tuple[str, ...] = ()) -> str:
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc = main(["train", "--config", CI, "--run-id", "bad", f"trainer.output_dir={out}", *overrides])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2, err
    for pattern in match:
        assert pattern in err, f"{pattern!r} not in: {err}"
    assert took < 30, f"bad input took {took:.1f}s to report"
    for made in {"tables", "checkpoints", "dagster_home", "mlflow.db"} - set(existing):
        assert not (out / made).exists(), f"{made} was created before the error"
    return err


def _verl_rows(n: int = 12, **replace) -> pd.DataFrame:
    df = pd.DataFrame(
        {
            "data_source": ["rlake/arith"] * n,
            "prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(n)],
            "ability": ["math"] * n,
            "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(n)],
            "extra_info": [{"index": i} for i in range(n)],
        }
    )
    for k, v in replace.items():
        df[k] = v
    return df


def _parquet(tmp_path: Path, df: pd.DataFrame, name: str = "train.parquet") -> str:
    path = tmp_path / name
    df.to_parquet(path)
    return str(path)


def test_missing_parquet_columns(tmp_path, capsys) -> None:
    bad = _parquet(tmp_path, _verl_rows().drop(columns=["reward_model", "ability"]))
    _fails_early(
        tmp_path,
        capsys,
        f"data.train_files=[{bad}]",
        match=["missing verl columns ['ability', 'reward_model']", "found", "Each row needs"],
    )


def test_malformed_prompt_column(tmp_path, capsys) -> None:
    bad = _parquet(tmp_path, _verl_rows(prompt=[f"{i}+1=" for i in range(12)]))  # a string, not chat messages
    _fails_early(
        tmp_path,
        capsys,
        f"data.train_files=[{bad}]",
        match=["row 0 column 'prompt' must be a non-empty list of {role, content} messages (verl format)"],
    )


def test_missing_data_file(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        f"data.train_files=[{tmp_path / 'nope.parquet'}]",
        match=["nope.parquet' does not exist", "data.train_files"],
    )


def test_unknown_data_source(tmp_path, capsys) -> None:
    bad = _parquet(tmp_path, _verl_rows(data_source=["my/unknown_set"] * 12))
    _fails_early(
        tmp_path,
        capsys,
        f"data.train_files=[{bad}]",
        match=[
            "No reward function for data_source 'my/unknown_set'",
            "Known: [",
            "register a scorer for it (stages.data.rewards.REWARD_FNS, or an installed package's 'rlake.rewards' "
            "entry point), set reward.custom_reward_function.path to your own function",
        ],
    )


_VERL_ARGS = "data_source, solution_str, ground_truth, extra_info=None"
BAD_REWARDS = {
    # case: (file source, extra overrides, message parts: what / why / fix)
    "missing_file": (None, [], ["does not exist", "no reward function to load", "point it at a Python file"]),
    "syntax_error": (
        f"import re\n\ndef compute_score({_VERL_ARGS})\n    return 1.0\n",
        [],
        [
            "fails to import",
            "line 3: SyntaxError: expected ':'",
            f"def compute_score({_VERL_ARGS})",
            "must import cleanly",
        ],
    ),
    "import_error": (
        f"import not_a_real_package_xyz\n\n\ndef compute_score({_VERL_ARGS}):\n    return 1.0\n",
        [],
        ["line 1: ModuleNotFoundError: No module named 'not_a_real_package_xyz'", "import not_a_real_package_xyz"],
    ),
    "missing_name": (
        f"def compute_score({_VERL_ARGS}):\n    return 1.0\n",
        ["reward.custom_reward_function.name=my_score"],
        ["name 'my_score' is not a function defined in", "functions there: ['compute_score']", "Set reward."],
    ),
    "wrong_signature": (
        "def compute_score(solution_str, ground_truth):\n    return 1.0\n",
        [],
        ["does not accept ['data_source', 'extra_info']", "(verl's contract)", "define it as def compute_score("],
    ),
    "batched_flag_missing": (
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0]\n",
        [],
        ["does not accept", "set reward.custom_reward_function.batched=true"],
    ),
    "batched_not_a_list": (
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n    return 1.0\n",
        ["reward.custom_reward_function.batched=true"],
        ["returns one result per row (a list of 1), got float", "return a list with one number or dict per row"],
    ),
    "required_parameter": (
        f"def compute_score({_VERL_ARGS.replace('=None', '')}, tokenizer):\n    return 1.0\n",
        [],
        ["requires ['tokenizer']", "set it in reward_kwargs"],
    ),
    "returns_a_string": (
        f"def compute_score({_VERL_ARGS}):\n    return '1.0'\n",
        [],
        ["called once on the first training prompt", "returned str '1.0'", "returns a number", "Fix what"],
    ),
    "dict_without_score": (
        f"def compute_score({_VERL_ARGS}):\n    return {{'acc': True}}\n",
        [],
        ["returned a dict without 'score' (keys ['acc'])", "a dict with the number under 'score'"],
    ),
    "clobbering_key": (
        f"def compute_score({_VERL_ARGS}):\n    return {{'score': 1.0, 'reward': 2.0}}\n",
        [],
        ["returned extra keys ['reward']", "rlake's own scored_rollouts columns", "rename those keys"],
    ),
    "raises_on_the_probe": (
        f"def compute_score({_VERL_ARGS}):\n    return float(extra_info['no_such_key'])\n",
        [],
        ["raised", "line 2: KeyError: 'no_such_key'", "should score 0.0, not raise"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REWARDS))
def test_bad_custom_reward_function(tmp_path, capsys, case: str) -> None:
    source, overrides, match = BAD_REWARDS[case]
    path = tmp_path / "elsewhere" / "my_reward.py"
    if source is not None:
        path.parent.mkdir()
        path.write_text(source)
    err = _fails_early(tmp_path, capsys, f"reward.custom_reward_function.path={path}", *overrides, match=match)
    assert str(path) in err


FAST_CHECK = """
import contextlib, io, json, sys, time
from pipelines.cli import main

out = []
for path, extra in json.loads(sys.argv[1]):
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = main(["train", "--config", sys.argv[2], f"trainer.output_dir={sys.argv[3]}",
                   f"reward.custom_reward_function.path={path}", *extra])
    out.append({"rc": rc, "err": err.getvalue(), "s": time.perf_counter() - t0})
heavy = [m for m in ("torch", "ray", "dagster", "mlflow", "transformers", "pandas") if m in sys.modules]
print(json.dumps({"cases": out, "imported": heavy}))
"""
FAST_CASES = ("missing_file", "syntax_error", "missing_name", "wrong_signature")


def test_a_broken_reward_file_fails_in_a_second_before_torch_ray_or_dagster(tmp_path) -> None:
    """The four ways a new user's reward file is broken are reported (what / why / fix) before `rlake train`
    imports torch, Ray, Dagster or MLflow: about a second instead of the 7 s those imports take on 2 idle cores.
    A fresh process, so "imported" means imported by rlake train itself."""
    cases = []
    for case in FAST_CASES:
        source, overrides, _ = BAD_REWARDS[case]
        path = tmp_path / case / "my_reward.py"
        if source is not None:
            path.parent.mkdir()
            path.write_text(source)
        cases.append((str(path), overrides))
    args = [json.dumps(cases), CI, str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-c", FAST_CHECK, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["imported"] == [], f"imported before the reward file was checked: {got['imported']}"
    for case, (path, _), result in zip(FAST_CASES, cases, got["cases"], strict=True):
        assert result["rc"] == 2 and path in result["err"], (case, result)
        for pattern in BAD_REWARDS[case][2]:
            assert pattern in result["err"], (case, pattern, result["err"])
        assert result["s"] < 5, f"{case} took {result['s']:.1f}s to report"
    assert not (tmp_path / "out").exists()  # nothing written: no log file, no tables


def test_custom_reward_scores_any_data_source(tmp_path) -> None:
    from configs.schema import load_config
    from stages.run.preflight import preflight

    data = _parquet(tmp_path, _verl_rows(data_source=["my/unknown_set"] * 12))
    fn = tmp_path / "my_reward.py"
    fn.write_text(f"def compute_score({_VERL_ARGS}):\n    return {{'score': 0.5, 'index': extra_info['index']}}\n")
    cfg = load_config(CI, [f"data.train_files=[{data}]", f"reward.custom_reward_function.path={fn}"])
    assert preflight(cfg)["reward_probe"] == (0.5, {"index": 0})  # the first training row's extra_info


def test_prompt_longer_than_the_limit(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        "data.max_prompt_length=4",
        match=["tokens, over data.max_prompt_length (4)", "raise the limit or filter long prompts"],
    )


def test_config_typo_names_the_key_and_the_fix(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        "actor.ppo_mini_bach_size=4",
        match=[
            "unknown config key 'actor.ppo_mini_bach_size'",
            "typo cannot be silently ignored",
            "did you mean 'actor.ppo_mini_batch_size'?",
        ],
    )


def test_grpo_with_one_sample_per_prompt(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        "rollout.n=1",
        match=[
            "rollout.n (1) must be >= 2 for GRPO",
            "because the advantage is computed within a group",
            "set rollout.n >= 2",
        ],
    )


def test_mini_batch_not_dividing_the_batch(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        "actor.ppo_mini_batch_size=3",
        match=[
            "actor.ppo_mini_batch_size (3) must divide data.train_batch_size (8)",
            "because each iteration's batch is split",
            "pick a divisor of 8",
        ],
    )


def test_resume_path_without_resume_mode(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        f"trainer.resume_from_path={tmp_path}",
        match=["a resume path is used exactly when resume_mode='resume_path'", "set both"],
    )


def test_model_path_that_is_not_a_causal_lm(tmp_path, capsys) -> None:
    from transformers import BertConfig

    enc = tmp_path / "bert"
    BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        architectures=["BertForMaskedLM"],
    ).save_pretrained(enc)
    _fails_early(
        tmp_path,
        capsys,
        f"model.path={enc}",
        match=[
            "holds a ['BertForMaskedLM'] model, not a causal LM",
            "RL training generates with",
            "point it at a causal-LM checkpoint",
        ],
    )


def test_model_path_that_is_not_a_checkpoint(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    _fails_early(
        tmp_path,
        capsys,
        f"model.path={tmp_path / 'empty'}",
        match=["is not an HF checkpoint directory (no config.json)"],
    )


def test_resume_from_a_checkpoint_of_another_architecture(tmp_path, capsys, tiny_checkpoint) -> None:
    """tiny_checkpoint has hidden_size 64 (ci_tiny's); the run asks for 128."""
    from configs.schema import load_config
    from stages.run.resume import trainer_state, write_trainer_state

    ckpt = tmp_path / "out" / "checkpoints" / "bad" / "policy_v1"
    shutil.copytree(tiny_checkpoint, ckpt)
    write_trainer_state(ckpt, trainer_state(load_config(CI), "bad", 1, 184))
    err = _fails_early(
        tmp_path,
        capsys,
        "model.tiny.hidden_size=128",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt}",
        match=[
            "is another architecture than this run's model",
            "hidden_size: checkpoint 64 vs config 128",
            "Resume with the config the checkpoint was trained with",
        ],
        existing=("checkpoints",),
    )
    assert "policy_v1" in err


def test_resume_with_a_changed_config_is_refused(tmp_path, capsys, tiny_checkpoint) -> None:
    from configs.schema import load_config
    from stages.run.resume import trainer_state, write_trainer_state

    ckpt = tmp_path / "out" / "checkpoints" / "bad" / "policy_v1"
    shutil.copytree(tiny_checkpoint, ckpt)
    write_trainer_state(ckpt, trainer_state(load_config(CI), "bad", 1, 184))
    _fails_early(
        tmp_path,
        capsys,
        "actor.optim.lr=0.5",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt}",
        match=[
            "was written under config hash",
            "would not continue the same run",
            "trainer.resume_allow_config_change=true",
        ],
        existing=("checkpoints",),
    )


def _rollouts(texts: list[str], source: str) -> pd.DataFrame:
    n = len(texts)
    return pd.DataFrame(
        {
            "rollout_id": range(n),
            "group_id": [0] * n,
            "policy_version": 0,
            "data_source": source,
            "response_text": texts,
            "ground_truth": ["1"] * n,
            "response_length": [2] * n,
            "prompt_token_ids": [[5, 6]] * n,
            "response_token_ids": [[7, 8]] * n,
        }
    )


@pytest.fixture
def broken_reward(monkeypatch):
    """A user reward function (registered the way users register one) that raises or returns NaN."""
    from stages.data.rewards import REWARD_FNS

    def broken(text, gt, **kw):
        if text == "boom":
            raise RuntimeError("parser crashed")
        return math.nan if text == "nan" else 1.0

    monkeypatch.setitem(REWARD_FNS, "test/broken", broken)
    return "test/broken"


def test_reward_that_raises_stops_the_run_naming_the_rollout(broken_reward) -> None:
    from configs.schema import RewardConfig
    from stages.scored_rollouts import score_rollouts

    with pytest.raises(
        ValueError,
        match=r"^reward function \S*\.broken failed on rollout 1 \(data_source 'test/broken'\): raised at "
        rf"{re.escape(__file__)}:\d+: RuntimeError: parser crashed\. Fix the function .* set reward.on_error=flag ",
    ):
        score_rollouts(_rollouts(["ok", "boom"], broken_reward), RewardConfig(on_error="raise"), use_ray=False)
    with pytest.raises(ValueError, match=r"failed on rollout 1 \(data_source 'test/broken'\): returned non-finite nan"):
        score_rollouts(_rollouts(["ok", "nan"], broken_reward), RewardConfig(on_error="raise"), use_ray=False)


def test_reward_flagged_rows_are_kept_and_training_continues_without_them(broken_reward) -> None:
    """on_error=flag: every row stays in scored_rollouts, the bad ones with reward NaN + reward_error; the
    advantages asset drops them and trains on the rest (the advantage math itself refuses NaN rewards)."""
    from configs.schema import AlgorithmConfig, RewardConfig
    from stages.advantage_table import compute_advantage_table, drop_flagged_rollouts
    from stages.scored_rollouts import score_rollouts

    scored = score_rollouts(
        _rollouts(["ok", "boom", "nan", "ok"], broken_reward), RewardConfig(on_error="flag"), use_ray=False
    )
    assert len(scored) == 4 and scored["reward"].iloc[[0, 3]].tolist() == [1.0, 1.0]
    assert scored["reward_error"].iloc[1] == "RuntimeError: parser crashed"
    assert "non-finite" in scored["reward_error"].iloc[2] and scored["reward"].iloc[1:3].isna().all()
    with pytest.raises(
        ValueError, match=r"non-finite rewards for rollouts \[1, 2\] \(see reward_error in scored_rollouts\)"
    ):
        compute_advantage_table(scored, AlgorithmConfig())
    kept, dropped = drop_flagged_rollouts(scored)
    assert dropped == 2 and kept["rollout_id"].tolist() == [0, 3]
    assert len(compute_advantage_table(kept, AlgorithmConfig())) == 2
    with pytest.raises(ValueError, match=r"all 2 rollouts were flagged by the reward stage .* fix the reward function"):
        drop_flagged_rollouts(scored.iloc[1:3])


def test_export_of_a_missing_checkpoint(tmp_path, capsys) -> None:
    rc = main(["export", "--checkpoint", str(tmp_path / "policy_v9"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and "is not an HF checkpoint directory (no config.json)" in err and not (tmp_path / "hf").exists()


def test_export_writes_a_plain_hf_dir_that_transformers_loads(tmp_path, capsys, tiny_checkpoint) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tmp_path / "out" / "checkpoints" / "R" / "policy_v3"
    shutil.copytree(tiny_checkpoint, ckpt)
    torch.save({"optimizer": {}, "scheduler": {}}, ckpt / "optimizer.pt")
    (ckpt / "update_metrics.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"defaults: ['{Path(CI).resolve()}']\ntrainer:\n  output_dir: {tmp_path / 'out'}\n")  # an overlay
    rc = main(["export", "--config", str(cfg), "--run-id", "R", "--version", "3", "--out", str(tmp_path / "hf")])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["architecture"] == "Qwen2ForCausalLM"
    assert {"optimizer.pt", "update_metrics.json", "trainer_state.json"} <= set(summary["skipped"])
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "optimizer.pt" not in names
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, local_files_only=True)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert tok("1+2=")["input_ids"] == AutoTokenizer.from_pretrained(tiny_checkpoint)("1+2=")["input_ids"]
    rc = main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")])
    assert rc == 2 and "exists and is not empty" in capsys.readouterr().err


def test_cluster_without_token_auth_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    _fails_early(tmp_path, capsys, "ray.address=10.1.2.3:6379", match=["RAY_AUTH_MODE", "token", "ray.address=local"])


def test_credentials_in_storage_options_are_refused(tmp_path, capsys) -> None:
    _fails_early(
        tmp_path,
        capsys,
        "storage.root=s3://bucket/rlake",
        "storage.options={AWS_SECRET_ACCESS_KEY: hunter2}",
        match=["storage.options", "AWS_SECRET_ACCESS_KEY", "environment"],
    )


def test_a_storage_root_that_is_not_a_uri_is_refused(tmp_path, capsys) -> None:
    _fails_early(tmp_path, capsys, "storage.root=bucket/rlake", match=["storage.root", "s3://", "file://"])
