"""The multi-turn agent loop (stages/tools/agent_loop.py) with a scripted engine: the exact token layout, mask and turn
spans, the budget, the turn limit, and tool failures as observations. The end-to-end run with the real tiny
model is tests/e2e/test_multiturn_train.py."""

from __future__ import annotations

import json

import pytest

from configs.schema import MultiTurnConfig
from stages.models.engines import Generation, RolloutEngine, SamplingSpec
from stages.models.policy import observation_token_ids
from stages.models.tiny import build_char_tokenizer
from stages.tools import load_tools, run_agent_loop

TOOLS = "configs/tools/calculator.yaml"


def call(expression: str, name: str = "calculator") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "</tool_call>"


class ScriptedEngine(RolloutEngine):
    """Answers call i with script[i] (one text per prompt of the call), as token ids of the tokenizer + EOS,
    log-prob -0.5 per token; records the prompts and max_tokens it was given."""

    name = "scripted"

    def __init__(self, tok, script: list[list[str]]):
        self.tok, self.script, self.calls = tok, list(script), []

    def generate(self, prompt_token_ids, sampling):
        self.calls.append(([list(p) for p in prompt_token_ids], sampling.max_tokens, sampling.n))
        texts = self.script.pop(0)
        out = []
        for i in range(len(prompt_token_ids)):
            gens = []
            for _ in range(sampling.n):
                ids = self.tok(texts[i], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                finish = "stop"
                if len(ids) > sampling.max_tokens:
                    ids, finish = ids[: sampling.max_tokens], "length"
                gens.append(Generation(ids, [-0.5] * len(ids), finish, self.tok.decode(ids, skip_special_tokens=True)))
            out.append(gens)
        return out

    def load_checkpoint(self, model_dir):
        raise NotImplementedError

    def weights_fingerprint(self, *, refresh=False):
        return "scripted"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(tool_tokens=True)


@pytest.fixture(scope="module")
def tools():
    return load_tools(TOOLS)


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_tool_call_then_answer_has_the_exact_layout(tok, tools) -> None:
    prompt = tok("<|user|>What is 123*45?<|assistant|>", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tok, [[call("123*45")], ["#### 5535"]])
    cfg = MultiTurnConfig(enable=True, tool_config_path=TOOLS, max_assistant_turns=3)
    (traj,) = run_agent_loop(
        engine, tok, [prompt], SamplingSpec(max_tokens=200, n=1, seed=3), cfg, tools, use_ray=False
    )[0]
    first, obs, answer = enc(tok, call("123*45")), observation_token_ids(tok, "5535"), enc(tok, "#### 5535")
    # the tiny template renders a tool message as <|tool|>content and the generation prompt as <|assistant|>
    assert tok.decode(obs, skip_special_tokens=False) == "<|tool|>5535<|assistant|>"
    assert traj.token_ids == first + obs + answer
    assert traj.mask == [1] * len(first) + [0] * len(obs) + [1] * len(answer)
    assert traj.logprobs == [-0.5] * len(first) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert traj.finish_reason == "stop"
    # the second engine call continued from the prompt and every token so far, never re-tokenized text
    assert engine.calls[1][0] == [prompt + first + obs]
    assert engine.calls[1][1] == 200 - len(first) - len(obs)
    spans = [(t["role"], t["token_start"], t["token_end"]) for t in traj.turns]
    assert spans == [
        ("assistant", 0, len(first)),
        ("tool", len(first), len(first) + len(obs)),
        ("assistant", len(first) + len(obs), len(traj.token_ids)),
    ]
    tool_turn = traj.turns[1]
    assert tool_turn["tool_name"] == "calculator" and tool_turn["observation"] == "5535"
    assert json.loads(tool_turn["tool_arguments"]) == {"expression": "123*45"} and tool_turn["error"] is None


def test_samples_per_prompt_and_turn_limit(tok, tools) -> None:
    p = tok("<|user|>x<|assistant|>", add_special_tokens=False)["input_ids"]
    # n=2 samples of 2 prompts; every turn calls the tool again: the turn limit (2) ends them
    engine = ScriptedEngine(tok, [[call("1+1"), call("2+2")], [call("3+3")] * 4])
    cfg = MultiTurnConfig(enable=True, tool_config_path=TOOLS, max_assistant_turns=2)
    trajs = run_agent_loop(engine, tok, [p, p], SamplingSpec(max_tokens=300, n=2, seed=0), cfg, tools, use_ray=False)
    assert [len(s) for s in trajs] == [2, 2]
    assert len(engine.calls) == 2 and engine.calls[1][2] == 1  # continuations are one sample each
    for samples in trajs:
        for tr in samples:
            # turn 1, its observation, turn 2 (its tool call is not run: the limit)
            assert [t["role"] for t in tr.turns] == ["assistant", "tool", "assistant"]
            assert tr.finish_reason == "stop" and len(tr.mask) == len(tr.token_ids)
    assert trajs[1][0].turns[1]["observation"] == "4"


def test_budget_cuts_the_observation_and_ends_with_length(tok, tools) -> None:
    p = tok("<|user|>x<|assistant|>", add_special_tokens=False)["input_ids"]
    first = enc(tok, call("99*99"))
    engine = ScriptedEngine(tok, [[call("99*99")]])
    cfg = MultiTurnConfig(enable=True, tool_config_path=TOOLS)
    budget = len(first) + 3  # room for 3 of the observation's 7 tokens
    (tr,) = run_agent_loop(engine, tok, [p], SamplingSpec(max_tokens=budget, n=1), cfg, tools, use_ray=False)[0]
    assert len(tr.token_ids) == budget and tr.mask == [1] * len(first) + [0] * 3
    assert tr.finish_reason == "length" and len(engine.calls) == 1


def test_tool_errors_are_observations(tok, tools) -> None:
    p = tok("<|user|>x<|assistant|>", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(
        tok, [[call("1/0"), call("2", name="search"), "<tool_call>{not json</tool_call>"], ["#### 1"] * 3]
    )
    cfg = MultiTurnConfig(enable=True, tool_config_path=TOOLS, max_tool_response_length=32)
    trajs = run_agent_loop(engine, tok, [p, p, p], SamplingSpec(max_tokens=300, n=1), cfg, tools, use_ray=False)
    for (tr,) in trajs:
        tool = tr.turns[1]
        assert tool["role"] == "tool" and tool["error"], tool
        assert tool["observation"].startswith("Error") or "rror" in tool["observation"]
        assert tr.turns[-1]["role"] == "assistant" and tr.finish_reason == "stop"
        # the observation's content is at most max_tool_response_length tokens of its own
        content = tok(tool["observation"], add_special_tokens=False)["input_ids"]
        assert len(content) <= 32
