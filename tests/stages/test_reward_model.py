"""The reward-model stage on a real tiny RM (a Qwen2ForSequenceClassification built in-process): fixed
scores per seed, the score is the head's logit at the last token (checked by hand through Ray), the
workers load the model once per run, replace / add by hand, the scored_rollouts stage reads only the rollouts
columns it keeps and the RM's own, and a checkpoint without a one-label head fails in preflight with a what / why /
fix message."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from configs.schema import load_config
from stages import scored_rollouts
from stages.io import store
from stages.io.checkpoints import CHECKPOINT_ID, model_version
from stages.io.stage_exec import run_table_stage
from stages.models.policy import encode_chat, load_tokenizer
from stages.models.tiny import build_tiny_reward_model
from stages.reward_model import (
    check_reward_model_dir,
    combine_rm_scores,
    reward_model_group,
    reward_model_scores,
)
from stages.run.preflight import preflight
from stages.scored_rollouts import ModelScores, ScoreBatch, reward_stage, score_partition
from stages.workers.reward_model_worker import RewardModelWorker, rm_input_ids

CI = "configs/ci_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=0)


def _cfg(rm_dir, *extra: str):
    return load_config(CI, ["reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}", *extra])


def _rollouts(rm_dir, n: int = 6) -> pd.DataFrame:
    """n rollouts of different lengths, tokenized as a run of the tiny policy does (the char tokenizer as
    loaded from a checkpoint, here the RM's); even rows ended with eos (finish 'stop')."""
    tok = load_tokenizer(rm_dir)
    rows = []
    for i in range(n):
        prompt, text = encode_chat(tok, [{"role": "user", "content": f"{i * 7}+{i}="}])
        response = f"#### {i * 8}" + "1" * (i % 3)
        ids = tok(response, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i % 2 == 0 else [])
        rows.append(
            {
                "rollout_id": 10 + i,
                "prompt_text": text,
                "prompt_token_ids": prompt,
                "response_token_ids": ids,
                "response_text": response,
                "finish_reason": "stop" if i % 2 == 0 else "length",
            }
        )
    return pd.DataFrame(rows)


def _table_rows(rm_dir, n: int = 8) -> pd.DataFrame:
    """_rollouts as a rollouts partition holds them: every column of the table filled (rollout_logprobs, a
    response_mask on some rows, a multi-turn `turns` on one), two samples per prompt, half of them correct."""
    df = _rollouts(rm_dir, n)
    k = df["response_token_ids"].map(len).to_numpy()
    turn = {"turn_index": 0, "role": "assistant", "token_start": 0, "token_end": 1, "text": "#"}
    return df.assign(
        policy_version=0,
        prompt_id=np.arange(n) // 2,
        group_id=np.arange(n) // 2,
        sample_index=np.arange(n) % 2,
        data_source="openai/gsm8k",
        ground_truth=[t.removeprefix("#### ") if i % 2 == 0 else "7" for i, t in enumerate(df["response_text"])],
        extra_info=None,
        rollout_logprobs=[[-0.5] * m for m in k],
        response_mask=[[1] * m if i % 3 == 0 else None for i, m in enumerate(k)],
        response_length=k.astype(np.int32),
        engine="hf",
        engine_sync="build",
        engine_weights_fingerprint="f",
        turns=[[turn] if i == 0 else None for i in range(n)],
    )


def _score_by_hand(rm_dir, ids: list[int]) -> float:
    """The head's logit at the sequence's last token: the base model's last hidden state, then `score`."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, local_files_only=True).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state  # (1, T, H)
        return float(model.score(hidden[0, -1])[0])


def test_tiny_reward_model_is_deterministic_per_seed(tmp_path) -> None:
    a, b, c = (build_tiny_reward_model(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    wa, wb, wc = (load_file(d / "model.safetensors") for d in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and not torch.equal(wa["score.weight"], wc["score.weight"])
    conf = check_reward_model_dir(a)
    assert conf["architectures"] == ["Qwen2ForSequenceClassification"] and conf["pad_token_id"] == 0
    df = _rollouts(a, 4)
    sa, sb, sc = (reward_model_scores(_cfg(d), df, use_ray=False) for d in (a, b, c))
    np.testing.assert_array_equal(sa["rm_score"], sb["rm_score"])
    assert not np.allclose(sa["rm_score"], sc["rm_score"])
    # rm_version: the same checkpoint rebuilt keeps its digest; another seed (same config.json, same file
    # sizes) gets another one; a checkpoint id wins
    assert sa["rm_version"].iloc[0] == sb["rm_version"].iloc[0] == model_version(a)
    assert model_version(a).startswith("sha256:") and sc["rm_version"].iloc[0] != model_version(a)
    (b / CHECKPOINT_ID).write_text("rm-ckpt-7\n")
    assert model_version(b) == "rm-ckpt-7"


@pytest.mark.ray
def test_scores_through_ray_are_the_last_tokens_logit(tiny_rm, ray_session) -> None:
    """Two workers, micro-batches of 4 rows of different lengths (right padding): each score is the one
    computed by hand on the row alone, rows back in rollout_id order."""
    df = _rollouts(tiny_rm, 6).sample(frac=1.0, random_state=0).reset_index(drop=True)
    cfg = _cfg(tiny_rm, "rollout.num_workers=2", "reward.reward_model.micro_batch_size=4")
    out = reward_model_scores(cfg, df)
    assert out["rollout_id"].tolist() == sorted(df["rollout_id"]) and set(out["rm_version"]) == {model_version(tiny_rm)}
    by_id = df.set_index("rollout_id")
    for rid in (10, 13):  # an eos-ended row and a truncated one
        row = by_id.loc[rid]
        want = _score_by_hand(tiny_rm, list(row["prompt_token_ids"]) + list(row["response_token_ids"]))
        got = float(out.loc[out["rollout_id"] == rid, "rm_score"].iloc[0])
        assert got == pytest.approx(want, abs=1e-5)
    alone = reward_model_scores(_cfg(tiny_rm), df, use_ray=False)  # one process, micro-batches of 8
    np.testing.assert_allclose(out["rm_score"], alone["rm_score"], atol=1e-5)


@pytest.mark.ray
def test_workers_load_the_model_once_for_two_calls(tiny_rm, ray_session) -> None:
    cfg = _cfg(tiny_rm, "rollout.num_workers=2")
    df = _rollouts(tiny_rm, 4)
    first = reward_model_scores(cfg, df)
    group = reward_model_group(cfg, 2)
    pids = group.call(RewardModelWorker.pid)
    second = reward_model_scores(cfg, df.iloc[::-1].reset_index(drop=True))
    group = reward_model_group(cfg, 2)
    assert group.call(RewardModelWorker.pid) == pids and len(set(pids)) == 2
    assert group.call(RewardModelWorker.loads) == [1, 1]
    pd.testing.assert_frame_equal(first, second)


def test_text_path_reads_what_the_id_path_reads_for_the_char_tokenizer(tiny_rm) -> None:
    """Re-tokenizing prompt_text + response_text (+ the RM's eos after a 'stop') with the char tokenizer
    gives the policy's ids back, so both paths score alike; truncation keeps the last max_length tokens."""
    df = _rollouts(tiny_rm, 6)
    ids = RewardModelWorker(0, 1, 1, model_dir=str(tiny_rm), reuse_policy_ids=True)
    text = RewardModelWorker(0, 1, 1, model_dir=str(tiny_rm), reuse_policy_ids=False)
    want = [list(p) + list(r) for p, r in zip(df["prompt_token_ids"], df["response_token_ids"])]
    assert rm_input_ids(df, text.tokenizer, reuse_policy_ids=False, max_length=512) == want
    np.testing.assert_allclose(ids.compute_rm_score(df)["rm_score"], text.compute_rm_score(df)["rm_score"], atol=1e-6)
    short = RewardModelWorker(0, 1, 1, model_dir=str(tiny_rm), max_length=5, reuse_policy_ids=True)
    assert rm_input_ids(df, short.tokenizer, reuse_policy_ids=True, max_length=5) == [w[-5:] for w in want]
    got = short.compute_rm_score(df)["rm_score"].iloc[1]
    assert got == pytest.approx(_score_by_hand(tiny_rm, want[1][-5:]), abs=1e-5)


@pytest.mark.ray
def test_the_stage_reads_only_the_token_columns_the_reward_model_reads(tiny_rm, ray_session, tmp_path, monkeypatch):
    """score_partition with the reward model reads the rollouts columns scored_rollouts keeps and, of the token
    columns, only those the RM reads: prompt_token_ids and response_token_ids when it shares the policy's
    tokenizer, none when it re-tokenizes the texts (a policy with tool tokens has another vocabulary); never
    rollout_logprobs, response_mask or turns. It writes the table a read of every column wrote (as it read before)."""
    src = str(tmp_path / "rollouts")
    store.write_partition(src, "rollouts", _table_rows(tiny_rm), run_id="rm", iteration=0, lineage={})
    reads = []

    def spy(*args, columns=None, **kw):  # the real stage executor; records what score_partition asked it to read
        reads.append(columns)
        return run_table_stage(*args, columns=columns, **kw)

    monkeypatch.setattr(scored_rollouts, "run_table_stage", spy)
    kw = {"run_id": "rm", "iteration": 0, "version": None, "lineage": {}}
    # every rollouts column but the five token columns (scored_rollouts keeps them all; the rule scorer's are among
    # them), in the table's order, and the RM's ids (RewardModelWorker with reuse_policy_ids) where the policy's
    # tokenizer is the RM's; with tool tokens the RM reads prompt_text, response_text and finish_reason, kept anyway
    ids = [
        "policy_version", "rollout_id", "prompt_id", "group_id", "sample_index", "data_source", "ground_truth",
        "extra_info", "prompt_text", "prompt_token_ids", "response_token_ids", "response_text", "response_length",
        "finish_reason", "engine", "engine_sync", "engine_weights_fingerprint", "gen_round", "is_baseline",
    ]  # fmt: skip
    texts = [
        "policy_version", "rollout_id", "prompt_id", "group_id", "sample_index", "data_source", "ground_truth",
        "extra_info", "prompt_text", "response_text", "response_length", "finish_reason", "engine", "engine_sync",
        "engine_weights_fingerprint", "gen_round", "is_baseline",
    ]  # fmt: skip
    scores = []
    for extra, want in (((), ids), (("model.tiny.tool_tokens=true",), texts)):
        cfg, out = _cfg(tiny_rm, *extra), str(tmp_path / f"scored{len(reads)}")
        score_partition(cfg.reward, src, out, **kw, then=ModelScores(cfg))
        assert reads[-1] == want
        every = ScoreBatch(reward_stage(cfg.reward, ["openai/gsm8k"]), ModelScores(cfg))
        run_table_stage(every, src, out + "_every", "scored_rollouts", **kw)  # columns=None: every column
        got, was = store.read_partition(out, "rm", 0), store.read_partition(out + "_every", "rm", 0)
        pd.testing.assert_frame_equal(got, was)
        assert store.open_table(out).schema().to_arrow() == store.open_table(out + "_every").schema().to_arrow()
        assert got["rm_score"].notna().all() and set(got["rm_version"]) == {model_version(tiny_rm)}
        assert got["score"].tolist() == [1.0, 0.1] * 4  # the rule score: even rows right, odd ones format_score
        scores.append(got["rm_score"].to_numpy())
    np.testing.assert_allclose(scores[0], scores[1], atol=1e-6)  # the char tokenizer gives the texts' ids back


def test_combine_replace_and_add_by_hand() -> None:
    scored = pd.DataFrame(
        {
            "rollout_id": [0, 1, 2, 3],
            "score": [1.0, 0.0, np.nan, 0.1],  # row 2: its rule function failed (reward.on_error=flag)
            "overlong_penalty": [0.0, -0.5, 0.0, 0.0],
            "reward": [1.0, -0.5, np.nan, 0.1],
        }
    )
    rm = pd.DataFrame({"rollout_id": [3, 1, 0, 2], "rm_score": [0.05, -0.2, 0.3, 0.7], "rm_version": "v"})
    rep = combine_rm_scores(scored, rm, "replace")
    # replace: rm_score + overlong_penalty = 0.3, -0.2 - 0.5, 0.7 (the rule score is not used), 0.05
    np.testing.assert_allclose(rep["reward"], [0.3, -0.7, 0.7, 0.05])
    add = combine_rm_scores(scored, rm, "add")
    # add: score + rm_score + overlong_penalty = 1.3, -0.7, NaN (still flagged), 0.15
    np.testing.assert_allclose(add["reward"], [1.3, -0.7, np.nan, 0.15])
    for out in (rep, add):
        assert out["rollout_id"].tolist() == [0, 1, 2, 3] and out["rm_version"].tolist() == ["v"] * 4
        np.testing.assert_array_equal(out["score"], scored["score"])  # the rule score is kept
        np.testing.assert_allclose(out["rm_score"], [0.3, -0.2, 0.7, 0.05])
    with pytest.raises(ValueError, match=r"one to one .*unscored rollout_ids \[3\]"):
        combine_rm_scores(scored, rm[rm["rollout_id"] != 3], "add")
    with pytest.raises(ValueError, match=r"Valid: \['add', 'replace'\]"):
        combine_rm_scores(scored, rm, "max")


def test_a_causal_lm_or_a_two_label_head_fails_in_preflight(tiny_checkpoint, tiny_rm, tmp_path) -> None:
    with pytest.raises(ValueError) as err:
        preflight(_cfg(tiny_checkpoint))
    msg = str(err.value)
    assert "['Qwen2ForCausalLM'] model" in msg and "not a reward model" in msg  # what
    assert "one scalar head" in msg and "num_labels=1" in msg  # why
    assert "point model_path at a *ForSequenceClassification checkpoint with one label" in msg  # fix
    two = shutil.copytree(tiny_rm, tmp_path / "two_labels")
    conf = json.loads((two / "config.json").read_text())
    conf["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (two / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"with 2 label\(s\), not a reward model"):
        check_reward_model_dir(two)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_reward_model_dir(tmp_path / "missing")
    assert preflight(_cfg(tiny_rm))["rows"] > 0


def test_config_rules() -> None:
    with pytest.raises(ValidationError, match=r"enable=true needs reward.reward_model.model_path"):
        load_config(CI, ["reward.reward_model.enable=true"])
    with pytest.raises(ValidationError, match=r"metric='seq_reward' with reward.reward_model.enable=true"):
        load_config(
            "configs/dapo.yaml",
            [
                "reward.reward_model.enable=true",
                "reward.reward_model.model_path=x",
                "algorithm.filter_groups.metric=seq_reward",
            ],
        )
    with pytest.raises(ValidationError, match="replace"):
        load_config(CI, ["reward.reward_model.combine=mean"])
