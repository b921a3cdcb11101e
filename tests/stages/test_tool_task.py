"""The tool task (issue #21): multiplication prompts answered with the calculator, the tiny tokenizer's
tool-call tokens, and the multi-turn warm start whose observation tokens carry no loss."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from configs.schema import SyntheticTaskConfig, TinyModelConfig
from stages.data.datasets import generate_synthetic_task, load_prompt_rows
from stages.data.rewards import scorer_for
from stages.data.tool_arith import TOOL_ARITH_SOURCE, hermes_tool_call
from stages.initial_policy import tool_demo, warmstart_examples
from stages.models.policy import load_tokenizer, observation_token_ids, save_policy
from stages.models.tiny import (
    CHARS,
    SPECIAL_TOKENS,
    _response_ids,
    _sft_batch,
    build_char_tokenizer,
    build_tiny_model,
    warmstart_sft,
)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "47*83"}}</tool_call>'
SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def _expression(rows: pd.DataFrame, i: int) -> str:
    return json.loads(rows["extra_info"].iloc[i])["expression"]


def _pairs(df: pd.DataFrame) -> set[frozenset[int]]:
    return {frozenset(map(int, json.loads(e)["expression"].split("*"))) for e in df["extra_info"]}


def test_task_is_verl_format_disjoint_and_scored_by_the_strict_rule(tmp_path) -> None:
    cfg = SyntheticTaskConfig(task="tool_arithmetic", num_train=300, num_val=40)
    train, val = generate_synthetic_task(tmp_path / "a", cfg)
    assert pd.read_parquet(train).equals(pd.read_parquet(generate_synthetic_task(tmp_path / "b", cfg)[0]))
    df = load_prompt_rows([train], [val])
    t, v = df[df["split"] == "train"], df[df["split"] == "val"]
    assert (len(t), len(v), set(df["data_source"])) == (300, 40, {TOOL_ARITH_SOURCE})
    assert not _pairs(t) & _pairs(v)  # no pair in both splits, in either order
    row = t.iloc[0]
    a, b = map(int, json.loads(row["extra_info"])["expression"].split("*"))
    assert 10 <= a <= 99 and 10 <= b <= 99
    assert row["prompt"] == [{"role": "user", "content": f"What is {a}*{b}? Use the calculator."}]
    gt = row["reward_model"]["ground_truth"]
    assert gt == str(a * b)
    score = scorer_for(TOOL_ARITH_SOURCE).fn
    assert score(f"{CALL}{gt}#### {gt}", gt) == 1.0  # the decoded trajectory: call, observation, answer
    assert score(gt, gt) == 0.0 and score(f"#### {a * b + 1}", gt) == 0.0


def test_system_prompt_lists_the_tool_schemas_hermes_style(tmp_path) -> None:
    tools = tmp_path / "calc.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "x.Calc", "config": {}, "tool_schema": SCHEMA}]}))
    cfg = SyntheticTaskConfig(task="tool_arithmetic", num_train=20, num_val=4, tool_schema_path=str(tools))
    system, user = pd.read_parquet(generate_synthetic_task(tmp_path / "d", cfg)[1])["prompt"][0]
    assert system["role"] == "system" and user["role"] == "user"
    assert f"<tools>\n{json.dumps(SCHEMA)}\n</tools>" in system["content"]
    assert "<tool_call></tool_call> XML tags" in system["content"] and system["content"].endswith('"#### 42".')
    with pytest.raises(FileNotFoundError, match="tool_schema_path"):
        generate_synthetic_task(tmp_path / "e", cfg.model_copy(update={"tool_schema_path": "no/such.yaml"}))


def test_without_tool_tokens_the_vocab_is_unchanged() -> None:
    tok = build_char_tokenizer()
    assert tok.get_vocab() == {t: i for i, t in enumerate(SPECIAL_TOKENS + list(CHARS))}
    assert "<|tool|>" not in tok.all_special_tokens and TinyModelConfig().tool_tokens is False


def test_tool_tokens_extend_the_vocab_and_round_trip_a_call(tmp_path) -> None:
    base, tok = build_char_tokenizer(), build_char_tokenizer(tool_tokens=True)
    vocab = tok.get_vocab()
    assert all(vocab[t] == i for t, i in base.get_vocab().items())  # existing ids kept; new ones at the end
    assert [vocab[t] for t in ("<|tool|>", "<tool_call>", "</tool_call>")] == [len(tok) - 3, len(tok) - 2, len(tok) - 1]
    ids = tok(CALL, add_special_tokens=False)["input_ids"]
    # <tool_call>, 60 JSON characters, </tool_call>: the tags are one token each
    assert len(ids) == 62 and ids[0] == vocab["<tool_call>"] and ids[-1] == vocab["</tool_call>"]
    assert tok.decode(ids, skip_special_tokens=True) == CALL == hermes_tool_call("calculator", {"expression": "47*83"})
    obs = observation_token_ids(tok, "3901")
    assert tok.convert_ids_to_tokens(obs) == ["<|tool|>", "3", "9", "0", "1", "<|assistant|>"]
    save_policy(build_tiny_model(TinyModelConfig(hidden_size=16, intermediate_size=32), len(tok)), tok, tmp_path)
    loaded = load_tokenizer(tmp_path)  # what the rollout workers read from the checkpoint
    assert loaded(CALL, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids + [tok.eos_token_id] + obs, skip_special_tokens=True) == CALL + "3901"
    assert observation_token_ids(loaded, "3901") == obs


def test_segments_mask_the_observation_and_a_text_response_is_unchanged() -> None:
    tok = build_char_tokenizer(tool_tokens=True)
    demo = tool_demo(tok, "47*83", "3901")
    ids, trained = _response_ids(tok, demo)
    obs = observation_token_ids(tok, "3901")
    # 62 call tokens + EOS (trained), 6 observation tokens (not), "#### 3901" = 9 + EOS (trained)
    assert trained == [True] * 63 + [False] * 6 + [True] * 10
    assert ids[63:69] == obs and ids[62] == ids[-1] == tok.eos_token_id
    text_ids, text_trained = _response_ids(tok, "#### 7")
    assert (
        text_ids == tok("#### 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] and text_trained is None
    )
    prompt = [5, 6, 7]
    _, labels, attn = _sft_batch([(prompt, ids, trained), (prompt, text_ids, None)])
    assert labels[0, :3].tolist() == [-100] * 3
    assert labels[0, 3:].tolist() == [t if k else -100 for t, k in zip(ids, trained)]
    assert labels[1, 3 : 3 + len(text_ids)].tolist() == text_ids and (labels[1, 3 + len(text_ids) :] == -100).all()
    assert attn.sum(dim=1).tolist() == [3 + len(ids), 3 + len(text_ids)]


def test_warm_start_spreads_tool_demos_and_runs(tmp_path) -> None:
    train, val = generate_synthetic_task(tmp_path, SyntheticTaskConfig(task="tool_arithmetic", num_train=10, num_val=2))
    rows = load_prompt_rows([train], [val])
    rows = rows[rows["split"] == "train"]
    cfg = TinyModelConfig(
        hidden_size=16, intermediate_size=32, tool_tokens=True, warmstart_steps=3, warmstart_batch_size=4
    )
    tok = build_char_tokenizer(tool_tokens=True)
    examples = warmstart_examples(cfg, tok, rows)
    # fraction 0.3 over 10 rows: row k opens the call when floor(0.3 (k+1)) > floor(0.3 k), i.e. k = 3, 6, 9;
    # the other 7 rows answer directly and also get their trajectory with <tool_call> not trained: 3 + 2 * 7
    kinds = ["text" if isinstance(r, str) else r[0][1] for _, r in examples]  # a text, or: <tool_call> trained
    skip = [False, "text"]
    assert kinds == skip * 3 + [True] + skip * 2 + [True] + skip * 2 + [True]
    gt = rows["reward_model"].iloc[0]["ground_truth"]
    assert examples[0] == (list(rows["prompt"].iloc[0]), tool_demo(tok, _expression(rows, 0), gt, opens=False))
    assert examples[1][1] == f"#### {gt}" and examples[6][1][0] == ([tok.convert_tokens_to_ids("<tool_call>")], True)
    losses = warmstart_sft(build_tiny_model(cfg, len(tok)), tok, examples, cfg)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    with pytest.raises(ValueError, match="model.tiny.tool_tokens=true"):
        warmstart_examples(cfg.model_copy(update={"tool_tokens": False}), tok, rows)


def test_resume_and_preflight_see_the_tool_vocabulary() -> None:
    """A tool run's checkpoint has the extended vocabulary: resume's signature check and preflight's tokenizer
    must expect it, or a resumed tool run is refused as another model."""
    from configs.schema import load_config
    from stages.run.preflight import preflight_tokenizer
    from stages.run.resume import expected_model_signature

    cfg = load_config("configs/ci_tiny_tools.yaml")
    plain = load_config("configs/ci_tiny.yaml")
    size = len(build_char_tokenizer(tool_tokens=True))
    assert expected_model_signature(cfg.model)["vocab_size"] == size == len(preflight_tokenizer(cfg.model))
    assert expected_model_signature(plain.model)["vocab_size"] == len(build_char_tokenizer()) < size
