"""Initial policy (version 0): the tiny model warm-started in-process, or a local HF checkpoint, committed as
policy version 0 of the run (stages.io.checkpoints: out_dir a checkpoint_target) or written to a directory."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from configs.schema import ModelConfig, TinyModelConfig
from stages.data.custom_reward import parse_extra_info
from stages.data.tool_arith import CALCULATOR, TOOL_ARITH_SOURCE, hermes_tool_call
from stages.io.checkpoints import writing
from stages.models.policy import load_policy, observation_token_ids, save_policy
from stages.models.smollm2 import resolve_model_path
from stages.models.tiny import Segment, build_char_tokenizer, build_tiny_model, warmstart_loss_floor, warmstart_sft


def tool_demo(tok, expression: str, answer: str, *, opens: bool = True) -> list[Segment]:
    """A calculator trajectory as warm-start segments: the call + EOS (trained; its opening `<tool_call>` token
    only when `opens`), the observation `answer` as the rollout appends it (observation_token_ids, not trained),
    then `#### answer` + EOS (trained)."""
    eos = [tok.eos_token_id]
    call = tok(hermes_tool_call(CALCULATOR, {"expression": expression}), add_special_tokens=False)["input_ids"]
    return [
        (call[:1], opens),
        (call[1:] + eos, True),
        (observation_token_ids(tok, answer), False),
        (tok(f"#### {answer}", add_special_tokens=False)["input_ids"] + eos, True),
    ]


def warmstart_examples(
    tiny_cfg: TinyModelConfig, tok, train_prompts: pd.DataFrame
) -> list[tuple[list[dict], str | list[Segment]]]:
    """(messages, response) warm-start examples: per train prompt one answer in each warmstart_answer_formats
    format (a format listed k times, k rows: the model learns the formats' shares on every prompt, not which
    prompt had which; with one format, one row), except for rlake/tool_arith rows. Those show the calculator
    trajectory (tool_demo) at an even spread of warmstart_tool_call_fraction f of them (row k of them when
    floor((k+1)f) > floor(kf)) and answer directly otherwise, so the model opens a call on about f of the
    prompts. Every direct-answer row also gets its trajectory with the opening token not trained: the call's body
    and the copy of the observation are learned from every row, the decision to call from f of them."""
    formats, frac = tiny_cfg.warmstart_answer_formats, tiny_cfg.warmstart_tool_call_fraction
    examples: list[tuple[list[dict], str | list[Segment]]] = []
    k = 0  # index among the tool rows
    for i, (p, rm, source, extra) in enumerate(
        zip(*(train_prompts[c] for c in ("prompt", "reward_model", "data_source", "extra_info")), strict=True)
    ):
        answer = formats[i % len(formats)].format(answer=rm["ground_truth"])
        if source != TOOL_ARITH_SOURCE:
            examples += [(list(p), f.format(answer=rm["ground_truth"])) for f in formats]
            continue
        if not tiny_cfg.tool_tokens:
            raise ValueError(
                f"{TOOL_ARITH_SOURCE} prompts warm-start the tiny model on calculator calls, whose JSON and "
                "<tool_call> tags its character vocab lacks; set model.tiny.tool_tokens=true "
                "(configs/tool_tiny_cpu.yaml does)"
            )
        opens = int((k + 1) * frac) > int(k * frac)
        k += 1
        examples.append(
            (list(p), tool_demo(tok, parse_extra_info(extra)["expression"], str(rm["ground_truth"]), opens=opens))
        )
        if not opens:
            examples.append((list(p), answer))
    return examples


def _warmstarted_tiny(model_cfg: ModelConfig, train_prompts: pd.DataFrame, *, seed: int) -> tuple:
    """(model, tokenizer, warm-start metadata) of the tiny model after its SFT on the train prompts."""
    tok = build_char_tokenizer(tool_tokens=model_cfg.tiny.tool_tokens)
    model = build_tiny_model(model_cfg.tiny, len(tok), seed=seed)
    examples = warmstart_examples(model_cfg.tiny, tok, train_prompts)
    losses = warmstart_sft(model, tok, examples, model_cfg.tiny, seed=seed)
    meta = (
        {"warmstart_first_loss": losses[0], "warmstart_last_loss": losses[-1], "warmstart_steps": len(losses)}
        if losses
        else {}
    )
    if losses and len(model_cfg.tiny.warmstart_answer_formats) > 1:
        meta["warmstart_loss_floor"] = warmstart_loss_floor(tok, examples)
    return model, tok, meta


def create_initial_policy(
    model_cfg: ModelConfig,
    train_prompts: pd.DataFrame,
    out_dir: str | Path,
    *,
    seed: int,
    extra_files: dict[str, str] | None = None,
) -> dict:
    """Write policy version 0 (+ extra_files, e.g. its trainer_state.json) to out_dir: committed for a
    checkpoint_target, else a directory written whole or not at all; returns metadata (params, warm-start loss)."""
    meta: dict = {"source": model_cfg.path}
    with writing(out_dir) as tmp:
        if model_cfg.path == "tiny":
            model, tok, warm = _warmstarted_tiny(model_cfg, train_prompts, seed=seed)
            meta |= warm
        else:
            src = Path(resolve_model_path(model_cfg.path))
            model, tok = load_policy(src, model_cfg.dtype)  # validates it loads before copying
        save_policy(model, tok, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    meta["num_parameters"] = int(sum(p.numel() for p in model.parameters()))
    return meta
