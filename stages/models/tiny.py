"""The tiny policy of the CPU configs: a Qwen2 with an in-process character tokenizer, warm-started
by a short supervised pass on a split of the synthetic task disjoint from validation (no hub); and a
tiny reward model of the same architecture (a Qwen2ForSequenceClassification) for tests."""

from __future__ import annotations

import math
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from configs.schema import TinyModelConfig
from stages.models.policy import encode_chat

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]

CHARS = string.digits + string.ascii_letters + " +-*/=#?.,:$()!'\n"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TOOL_CHARS = '"%&;<>@[\\]^_`{|}~'
"""The characters of Hermes tool-call JSON (and the rest of ASCII punctuation) that CHARS lacks."""
TOOL_SPECIAL_TOKENS = ["<|tool|>"]
"""The role header of a tool observation (CHAT_TEMPLATE renders role tool as `<|tool|>{content}`)."""
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
"""Hermes tool-call delimiters, one token each and not special, so they survive skip_special_tokens."""


def build_char_tokenizer(tool_tokens: bool = False):  # -> transformers.PreTrainedTokenizerFast
    """A character-level tokenizer with chat template, built in-process (under a second).

    tool_tokens (TinyModelConfig.tool_tokens) appends TOOL_CHARS, `<|tool|>` (special) and the Hermes
    `<tool_call>` / `</tool_call>` (added, not special) at the end of the vocab: every other token keeps its id,
    so a config without them builds exactly the vocab (and the model) it always did."""
    extra = list(TOOL_CHARS) + TOOL_SPECIAL_TOKENS + TOOL_CALL_TOKENS if tool_tokens else []
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS) + extra)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    special = SPECIAL_TOKENS[2:] + (TOOL_SPECIAL_TOKENS if tool_tokens else [])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", additional_special_tokens=special
    )
    if tool_tokens:
        fast.add_tokens(TOOL_CALL_TOKENS)  # matched whole before the per-character split; ids from the vocab
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def _tiny_config(cfg: TinyModelConfig, vocab_size: int, **extra) -> Qwen2Config:
    """The tiny Qwen2's config (pad <pad> = 0, eos <eos> = 1 of the char tokenizer, no bos)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=256,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        **extra,
    )


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, seed: int = 0):
    """A randomly initialised tiny Qwen2ForCausalLM."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(_tiny_config(cfg, vocab_size))


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0, cfg: TinyModelConfig | None = None) -> Path:
    """Write a randomly initialised tiny reward model to out_dir: a Qwen2ForSequenceClassification with one
    label (the tiny policy's architecture, cfg: a TinyModelConfig, default its defaults) and the char
    tokenizer, pad_token_id set (HF reads the score at the last non-pad token). No hub; the same seed
    writes the same weights. Its scores are random but fixed: tests check the reward-model stage's
    mechanics with it, not what it prefers."""
    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(_tiny_config(cfg or TinyModelConfig(), len(tok), num_labels=1))
    model.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


Segment = tuple[list[int] | str, bool]
"""A piece of a multi-turn warm-start response: (token ids, or text to encode without EOS; trained or not)."""


def warmstart_sft(
    model, tokenizer, examples: list[tuple[list[dict], str | list[Segment]]], cfg: TinyModelConfig, seed: int = 0
) -> list[float]:
    """Supervised warm start: next-token loss on the response only. Returns per-step losses.

    Args:
        examples: (chat messages, response) pairs. A response is a text (encoded, EOS appended, all trained) or,
            for a multi-turn demonstration, a list of segments (token ids or text, trainable): the segments are
            concatenated as given (no EOS added) and the loss skips the non-trainable ones (tool observations).
        cfg: configs.schema.TinyModelConfig (warmstart_steps, warmstart_target_loss, warmstart_lr,
            warmstart_batch_size). The target applies to the loss above the batch's floor (response_floor_nats):
            the raw loss with one response per prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = [
        (encode_chat(tokenizer, messages)[0], *_response_ids(tokenizer, response)) for messages, response in examples
    ]
    floors = torch.tensor(response_floor_nats(rows), dtype=torch.float64)  # (len(rows),)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0)
    schedule = _WarmstartSchedule(cfg.warmstart_steps, cfg.warmstart_target_loss)
    model.train()
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread (measured: 0.09 s vs 0.45 s/step)
    while (factor := schedule.lr_factor()) is not None:
        for group in opt.param_groups:
            group["lr"] = cfg.warmstart_lr * factor
        idx = torch.randint(len(rows), (cfg.warmstart_batch_size,), generator=gen).tolist()
        ids, labels, attn = _sft_batch([rows[i] for i in idx])
        out = model(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        # the schedule sees the loss above what the best model of this batch still pays (0 with one format):
        # the batch's floor in nats over its trained tokens, as HF's loss averages them (labels shifted by one)
        floor = float(floors[idx].sum()) / max(int((labels[:, 1:] != -100).sum()), 1)
        schedule.observe(losses[-1] - floor)
    torch.set_num_threads(threads)
    model.eval()
    return losses


def response_floor_nats(rows: list[tuple[list[int] | str, list[int], list[bool] | None]]) -> list[float]:
    """Per warm-start row (prompt ids, response ids, trained flags), the loss in nats that even the best model
    pays on it: -log(share of that prompt's text responses that are this response). A prompt shown with one
    response costs 0; one shown with "{answer}" three times and "#### {answer}" once (warmstart_answer_formats)
    costs -log(3/4) and -log(1/4), since no model can tell from the prompt which format a row uses. Multi-turn
    rows (trained flags) cost 0 and are not counted: their untrained tokens are no choice the loss sees."""
    counts: dict[tuple, int] = {}
    for p, r, trained in rows:
        if trained is None:
            for key in ((tuple(p),), (tuple(p), tuple(r))):
                counts[key] = counts.get(key, 0) + 1
    return [
        0.0 if trained is not None else -math.log(counts[(tuple(p), tuple(r))] / counts[(tuple(p),)])
        for p, r, trained in rows
    ]


def warmstart_loss_floor(tokenizer, examples: list[tuple[list[dict], str | list[Segment]]]) -> float:
    """The warm-start loss (nats per trained token) of the best model of `examples` (warmstart_sft's): the floor
    under warmstart_last_loss, 0.0 with one response per prompt."""
    rows = [(repr(messages), *_response_ids(tokenizer, response)) for messages, response in examples]
    floors = response_floor_nats(rows)
    tokens = sum(len(r) if trained is None else sum(trained) for _, r, trained in rows)
    return sum(floors) / max(tokens, 1)


def _response_ids(tokenizer, response: str | list[Segment]) -> tuple[list[int], list[bool] | None]:
    """(response ids, trained flag per id or None = all): a text gets EOS appended, segments are as given."""
    if isinstance(response, str):
        return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], None
    ids: list[int] = []
    trained: list[bool] = []
    for piece, trainable in response:
        piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if isinstance(piece, str) else list(piece)
        ids += piece_ids
        trained += [bool(trainable)] * len(piece_ids)
    return ids, trained


def _sft_batch(
    batch: list[tuple[list[int], list[int], list[bool] | None]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask), each (B, T): right-padded prompt+response, loss on the response's
    trained tokens (labels -100 on the prompt, padding and non-trained response tokens)."""
    width = max(len(p) + len(r) for p, r, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.long)
    for b, (p, r, trained) in enumerate(batch):
        seq = p + r
        ids[b, : len(seq)] = torch.tensor(seq)
        attn[b, : len(seq)] = 1
        target = r if trained is None else [t if keep else -100 for t, keep in zip(r, trained, strict=True)]
        labels[b, len(p) : len(seq)] = torch.tensor(target)  # (len(r),)
    return ids, labels, attn


class _WarmstartSchedule:
    """lr factor per SFT step. Without a target loss: cosine from 1 to 0 over max_steps. With one: 1
    until the moving average (EMA) of the observed loss (warmstart_sft's: the loss above its floor) is below
    it, then linear to 0 over a fifth of the steps taken (at least 50); max_steps bounds the whole, cool-down
    included."""

    EMA = 0.95

    def __init__(self, max_steps: int, target_loss: float | None) -> None:
        self.max_steps, self.target = max_steps, target_loss
        self.step, self.ema, self.cooldown_from, self.cooldown_len = 0, None, None, 0

    def lr_factor(self) -> float | None:
        """The factor of the next step, None when done."""
        if self.step >= self.max_steps:
            return None
        if self.target is None:
            return 0.5 * (1 + math.cos(math.pi * self.step / max(self.max_steps, 1)))
        if self.cooldown_from is None:
            return 1.0
        done = self.step - self.cooldown_from
        return None if done >= self.cooldown_len else 1.0 - done / self.cooldown_len

    def observe(self, loss: float) -> None:
        self.step += 1
        self.ema = loss if self.ema is None else self.EMA * self.ema + (1 - self.EMA) * loss
        if self.target is not None and self.cooldown_from is None and self.ema < self.target:
            self.cooldown_from = self.step
            self.cooldown_len = min(max(self.step // 5, 50), self.max_steps - self.step)
