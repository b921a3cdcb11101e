"""HF-format policy checkpoints: tokenizer and model load/save, chat encoding; never touches a hub."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

BACKEND_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_class of a checkpoint whose tokenizer.json is the whole tokenizer (rlake's char tokenizer)."""


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], str]:
    """(token ids, text) of chat messages with the generation prompt appended."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def observation_token_ids(tokenizer, content: str, role: str = "tool") -> list[int]:
    """The token ids appended after an assistant turn for a tool's observation `content` (multi-turn rollouts,
    stages/tools/agent_loop.py): the chat template's rendering of a `role` message plus the generation prompt, as the
    delta between rendering [user, role message] and [user] alone, tokenized on its own. Only these ids are
    encoded, never the conversation again, so the ids before them stay exactly as generated."""
    probe = [{"role": "user", "content": "x"}]
    head = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
    full = tokenizer.apply_chat_template(
        probe + [{"role": role, "content": content}], add_generation_prompt=True, tokenize=False
    )
    if not full.startswith(head):
        raise ValueError(
            "the tokenizer's chat template renders a conversation differently once a message follows it, so the "
            f"observation of a '{role}' message cannot be appended as a delta; use a chat template that renders "
            "messages independently (ChatML, Qwen, SmolLM2 and rlake's tiny template do)"
        )
    return list(tokenizer(full[len(head) :], add_special_tokens=False)["input_ids"])


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a local HF checkpoint (left padding, pad falls back to eos); no weights read."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"'{path}' is not a HF checkpoint directory (no config.json); set model.path to a "
            "directory written by save_pretrained, or to 'tiny'."
        )
    tok = read_tokenizer(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def read_tokenizer(path: Path):
    """AutoTokenizer's tokenizer of a local checkpoint, except for a tokenizer saved as a plain tokenizers
    backend (tokenizer_class TokenizersBackend / PreTrainedTokenizerFast, e.g. rlake's char tokenizer): that
    one is read from its tokenizer.json as is. AutoTokenizer (transformers 5) builds such a checkpoint's
    tokenizer as the model type's class (Qwen2Tokenizer for the tiny Qwen2), whose own pre-tokenizer drops
    spaces: "12 + 34" encoded as "12+34", unlike the tokenizer the model was trained with."""
    config = path / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if cls in BACKEND_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_policy(model_dir: str | Path, dtype: str = "float32"):
    """Load (model, tokenizer) from a local HF checkpoint; never touches a hub."""
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(Path(model_dir), local_files_only=True, dtype=getattr(torch, dtype))
    return model, tok


def save_policy(model, tokenizer, model_dir: str | Path) -> str:
    """Write an HF-format checkpoint (safetensors + tokenizer); returns the directory."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
