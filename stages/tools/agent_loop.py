"""Multi-turn tool-calling rollouts (rollout.multi_turn; verl's AgentLoop): the agent loop over a rollout engine.

Each assistant turn is generated until EOS (or the response budget). A turn whose text holds tool calls
(`format: hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) runs them (stages/tools: Ray
tasks in a Ray worker, bounded in time and output; an error or timeout is the observation, never a crash) and
appends the observation: `observation_token_ids` of the tool message (the chat template's delta plus the
generation prompt, tokenized alone). Generation then resumes on prompt + every token so far. A turn without a
tool call ends the trajectory, as do max_assistant_turns and data.max_response_length (model and observation
tokens together: the sequence the trainer sees).

Token ids are kept exactly as generated and as appended: the conversation is never re-tokenized, so the
tokens trained on are the tokens sampled. `mask` is 1 on model tokens (trained) and 0 on observation tokens
(no loss, no KL, no advantage); `logprobs` holds the engine's log-prob of each model token and 0.0 on
observation tokens. `turns` spans [token_start, token_end) concatenate to the response's token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from stages.models.engines import RolloutEngine, SamplingSpec
from stages.models.policy import observation_token_ids
from stages.tools.parse import parse_tool_calls
from stages.tools.runner import run_tool_calls

TRUNCATED = "...[truncated]"


@dataclass
class Trajectory:
    """One multi-turn response: the tokens after the prompt, per-token engine log-probs and loss mask, and its turns."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"

    def append(self, ids: list[int], logprobs: list[float], trained: bool, **turn) -> None:
        start = len(self.token_ids)
        self.token_ids += list(ids)
        self.logprobs += list(logprobs)
        self.mask += [int(trained)] * len(ids)
        self.turns.append(
            {
                "turn_index": len(self.turns),
                "role": "assistant" if trained else "tool",
                "token_start": start,
                "token_end": len(self.token_ids),
                "text": "",
                "tool_name": None,
                "tool_arguments": None,
                "observation": None,
                "latency_s": None,
                "error": None,
                **turn,
            }
        )


def truncate_tokens(tokenizer, content: str, max_tokens: int) -> str:
    """content cut to at most max_tokens tokens of its own, marked TRUNCATED when cut."""
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return content
    keep = max(0, max_tokens - len(tokenizer(TRUNCATED, add_special_tokens=False)["input_ids"]))
    return tokenizer.decode(ids[:keep], skip_special_tokens=False) + TRUNCATED


def _arguments_json(calls) -> str:
    args = [c.arguments for c in calls]
    return json.dumps(args[0] if len(args) == 1 else args, sort_keys=True, default=str)


def run_agent_loop(
    engine: RolloutEngine,
    tokenizer,
    prompts: list[list[int]],
    sampling: SamplingSpec,
    multi_turn,
    tools: dict,
    *,
    use_ray: bool,
) -> list[list[Trajectory]]:
    """For each prompt, sampling.n trajectories of up to multi_turn.max_assistant_turns assistant turns.

    sampling.max_tokens is the whole response's budget (model + observation tokens). Turn t > 0 continues each
    open trajectory with n=1 and seed sampling.seed + t (the engines seed once per call), so the same seed gives
    the same trajectories. multi_turn: configs.schema.MultiTurnConfig; tools: name -> stages.tools Tool; use_ray:
    the tool calls of a step run as a Ray task (stages.tools.runner)."""
    budget = sampling.max_tokens
    first = engine.generate(prompts, sampling)
    trajs = [[Trajectory() for _ in gens] for gens in first]
    pending = [(i, k, g) for i, gens in enumerate(first) for k, g in enumerate(gens)]  # open trajectories' turn
    for turn in range(multi_turn.max_assistant_turns):
        last = turn == multi_turn.max_assistant_turns - 1
        calls_of = {
            (i, k): calls for i, k, g in pending if (calls := _take_turn(trajs[i][k], g, budget, last, multi_turn))
        }
        if not calls_of:
            break
        open_keys = _observe(trajs, calls_of, tokenizer, budget, multi_turn, tools, use_ray)
        if not open_keys:
            break
        room = max(budget - len(trajs[i][k].token_ids) for i, k in open_keys)
        spec = SamplingSpec(
            **{
                **sampling.__dict__,
                "n": 1,
                "seed": None if sampling.seed is None else sampling.seed + turn + 1,
                # the engines take one max_tokens per call: each continuation is cut to its own budget below
                "max_tokens": room,
            }
        )
        outs = engine.generate([prompts[i] + trajs[i][k].token_ids for i, k in open_keys], spec)
        pending = [
            (i, k, _fit(gens[0], budget - len(trajs[i][k].token_ids), tokenizer))
            for (i, k), gens in zip(open_keys, outs, strict=True)
        ]
    return trajs


def _take_turn(tr: Trajectory, g, budget: int, last: bool, multi_turn) -> list:
    """Append generation g as an assistant turn of tr; its tool calls when they are to run, else [] (tr ends)."""

    tr.append(g.token_ids, g.logprobs, True, text=g.text)
    if g.finish_reason == "length" or len(tr.token_ids) >= budget:
        tr.finish_reason = "length"
        return []
    calls = parse_tool_calls(g.text, multi_turn.format)
    if not calls or last:
        tr.finish_reason = "stop"
        return []
    return calls


def _observe(trajs, calls_of: dict, tokenizer, budget: int, multi_turn, tools: dict, use_ray: bool) -> list:
    """Run every open trajectory's tool calls (one batch), append each one's observation; the keys that go on."""
    cap = multi_turn.max_parallel_calls
    flat = [(key, c) for key, calls in calls_of.items() for c in calls[:cap]]
    results = run_tool_calls(tools, [c for _, c in flat], use_ray=use_ray, timeout_s=multi_turn.tool_timeout_s)
    by_key: dict[tuple[int, int], list] = {}
    for (key, _), res in zip(flat, results, strict=True):
        by_key.setdefault(key, []).append(res)
    open_keys = []
    for key, calls in calls_of.items():
        tr, res = trajs[key[0]][key[1]], by_key[key]
        outputs, errors = [r.output for r in res], [r.error for r in res if r.error]
        if len(calls) > cap:
            outputs.append(f"Error: {len(calls) - cap} tool calls beyond max_parallel_calls={cap} were not run")
            errors.append(f"too_many_calls: {len(calls) - cap} over max_parallel_calls")
        content = truncate_tokens(tokenizer, "\n".join(outputs), multi_turn.max_tool_response_length)
        obs = observation_token_ids(tokenizer, content)
        room = budget - len(tr.token_ids)
        tr.append(
            obs[:room],
            [0.0] * len(obs[:room]),
            False,
            text=tokenizer.decode(obs[:room], skip_special_tokens=False),
            tool_name=",".join(r.name for r in res if r.name) or None,  # None: no call could be parsed
            tool_arguments=_arguments_json(calls[:cap]),
            observation=content,
            latency_s=float(max(r.latency_s for r in res)),
            error="; ".join(errors) or None,
        )
        if len(obs) >= room:  # no token left for the model after it: the trajectory ends here
            tr.finish_reason = "length"
        else:
            open_keys.append(key)
    return open_keys


def _fit(g, room: int, tokenizer):
    """Generation g cut to `room` tokens (finish 'length' when cut)."""
    if len(g.token_ids) <= room:
        return g
    ids = g.token_ids[:room]
    return type(g)(
        token_ids=ids,
        logprobs=g.logprobs[:room],
        finish_reason="length",
        text=tokenizer.decode(ids, skip_special_tokens=True),
    )
