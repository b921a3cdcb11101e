"""A policy checkpoint's tokenizer, loaded back, encodes exactly as the tokenizer the policy was built and
warm-started with: transformers 5's AutoTokenizer builds the tiny Qwen2 checkpoint's char tokenizer as a
Qwen2Tokenizer whose pre-tokenizer drops spaces ("12 + 34" -> "12+34"), so load_tokenizer reads it from
tokenizer.json instead."""

from __future__ import annotations

from transformers import AutoTokenizer

from stages.models.policy import encode_chat, load_tokenizer
from stages.models.tiny import build_char_tokenizer

TEXTS = ["a  b", "What is 12 + 34?", "Tom has 3 apples. #### 7", " leading and trailing "]


def test_saved_char_tokenizer_encodes_like_the_one_in_memory(tiny_checkpoint) -> None:
    built, loaded = build_char_tokenizer(), load_tokenizer(tiny_checkpoint)
    for text in TEXTS:
        ids = built(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids, text
        assert loaded.decode(ids) == text
    # "a  b": a, space, space, b -- one id per character, spaces included (hand count: 4)
    assert len(loaded("a  b", add_special_tokens=False)["input_ids"]) == 4
    msgs = [{"role": "user", "content": "What is 12 + 34?"}]
    assert encode_chat(loaded, msgs) == encode_chat(built, msgs)
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (
        built.pad_token_id,
        built.eos_token_id,
        "left",
    )


def test_auto_tokenizer_alone_would_drop_the_spaces(tiny_checkpoint) -> None:
    """Why load_tokenizer does not call AutoTokenizer for this checkpoint (fails, and can go, once it doesn't)."""
    auto = AutoTokenizer.from_pretrained(tiny_checkpoint, local_files_only=True)
    assert len(auto("a  b", add_special_tokens=False)["input_ids"]) == 2
