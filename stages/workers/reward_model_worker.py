"""RewardModelWorker: a discriminative reward model, loaded once per run, scoring rollouts.

The model is an HF *ForSequenceClassification checkpoint with one label (what TRL's RewardTrainer
writes, and what verl's RewardModelWorker loads): its score of a sequence is the head's logit at the
last non-pad token, which HF's forward picks from config.pad_token_id (set here when the checkpoint
has none: the tokenizer's pad, else its eos; with pad == eos a trailing eos counts as padding, as when
HF or TRL trained such a model).

What the model reads, per rollout:
- reuse_policy_ids (the RM's tokenizer is the policy's, same vocabulary): prompt_token_ids +
  response_token_ids, exactly the ids the policy saw and wrote (its eos included); verl does the same
  when reward_model.model.input_tokenizer is null.
- else (the general case, an RM with its own tokenizer): the text, prompt_text + response_text,
  re-tokenized with the RM's tokenizer (the prompt with the tokenizer's special tokens, e.g. a bos),
  plus the RM's eos when the policy ended its turn (finish_reason 'stop'). verl decodes too, but
  re-renders the raw chat with the RM's chat template; the rollouts table keeps the prompt only as
  the policy's rendered prompt_text, so the prompt keeps the policy's chat markup.
- at most max_length tokens: left truncation, so the prompt's start goes first and the response's
  end, where the score is read, stays (verl's fsdp RewardModelWorker truncates on the right by default).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from transformers import AutoModelForSequenceClassification

from stages.models.policy import read_tokenizer
from stages.workers.group import Worker


def load_reward_model(model_dir: str | Path) -> tuple:
    """(model in eval mode, tokenizer) of a local reward-model checkpoint, pad_token_id set on both."""
    path = Path(model_dir)
    tok = read_tokenizer(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, local_files_only=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


POLICY_ID_READS = ("rollout_id", "prompt_token_ids", "response_token_ids")
"""The rollouts columns compute_rm_score reads with reuse_policy_ids: the policy's ids (rm_input_ids)."""
TEXT_READS = ("rollout_id", "prompt_text", "response_text", "finish_reason")
"""The rollouts columns compute_rm_score reads without: the texts, re-tokenized, and the eos after a 'stop'."""


def rm_input_ids(batch: pd.DataFrame, tok, *, reuse_policy_ids: bool, max_length: int) -> list[list[int]]:
    """The reward model's token ids of each rollout of the batch, in its order (see the module docstring); the
    batch needs POLICY_ID_READS (reuse_policy_ids) or TEXT_READS, no other column."""
    out = []
    for i in range(len(batch)):
        row = batch.iloc[i]
        if reuse_policy_ids:
            ids = [int(t) for t in row["prompt_token_ids"]] + [int(t) for t in row["response_token_ids"]]
        else:
            ids = (
                tok(row["prompt_text"])["input_ids"] + tok(row["response_text"], add_special_tokens=False)["input_ids"]
            )
            if row["finish_reason"] == "stop" and tok.eos_token_id is not None:
                ids.append(tok.eos_token_id)
        out.append(ids[-max_length:])  # left truncation: the response's end stays
    return out


class RewardModelWorker(Worker):
    """model_dir: the reward model's checkpoint; micro_batch_size rollouts per forward; max_length
    tokens per rollout at most; reuse_policy_ids: score the policy's token ids as they are (the RM's
    tokenizer is the policy's). The model is loaded once, in __init__ (`model_loads` counts loads)."""

    def __init__(
        self,
        rank: int,
        world: int,
        threads: int,
        shape: str = "",
        *,
        model_dir: str,
        micro_batch_size: int = 8,
        max_length: int = 512,
        reuse_policy_ids: bool = False,
    ) -> None:
        super().__init__(rank, world, threads, shape)
        self.micro_batch_size, self.max_length, self.reuse_policy_ids = micro_batch_size, max_length, reuse_policy_ids
        self.model_loads = 0
        self._load(model_dir)

    def _load(self, model_dir: str) -> None:
        self.model, self.tokenizer = load_reward_model(model_dir)
        self.model.to(self.device)
        self.model_loads += 1

    def loads(self) -> int:
        """How many times this worker loaded its model: 1 for its whole life (the run's stages reuse it)."""
        return self.model_loads

    def compute_rm_score(self, batch: pd.DataFrame) -> pd.DataFrame:
        """Rows (rollout_id, rm_score) of the batch's rollouts, in its order; it reads POLICY_ID_READS
        (reuse_policy_ids) or TEXT_READS of the batch."""
        seqs = rm_input_ids(batch, self.tokenizer, reuse_policy_ids=self.reuse_policy_ids, max_length=self.max_length)
        pad = self.model.config.pad_token_id
        scores: list[float] = []
        with torch.no_grad():
            for s in range(0, len(seqs), self.micro_batch_size):
                part = seqs[s : s + self.micro_batch_size]
                width = max(len(x) for x in part)
                ids = torch.full((len(part), width), pad, dtype=torch.long)  # (n, T) right-padded
                attn = torch.zeros((len(part), width), dtype=torch.long)
                for b, x in enumerate(part):
                    ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
                    attn[b, : len(x)] = 1
                ids, attn = ids.to(self.device), attn.to(self.device)
                logits = self.model(input_ids=ids, attention_mask=attn).logits  # (n, 1): the last non-pad token's
                scores.extend(logits[:, 0].float().tolist())
        return pd.DataFrame({"rollout_id": batch["rollout_id"].to_numpy(), "rm_score": scores})
