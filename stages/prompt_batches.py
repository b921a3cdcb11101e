"""The prompt_batches stage: the iteration's prompts, tokenized for the rollout stage.

`build_prompt_batch` picks train_batch_size training prompts with a seeded epoch cursor
(stages.data.datasets.sample_prompt_batch), chat-templates and tokenizes them. With DAPO's
algorithm.filter_groups it picks the candidate rounds of gen_batch_size prompts instead: round 0 from the
cursor, rounds 1.. from a stream seeded by (seed, iteration) over the other training prompts (negative
`position`: not from the cursor), so re-runs draw the same prompts.
"""

from __future__ import annotations

import random

import pandas as pd

from configs.schema import RunConfig
from stages import seeds
from stages.data.datasets import sample_prompt_batch
from stages.models.policy import encode_chat


def build_prompt_batch(cfg: RunConfig, prompts: pd.DataFrame, iteration: int, tokenizer) -> pd.DataFrame:
    """Rows of the `prompt_batches` table of iteration `iteration` from the run's `prompts` table: one per
    picked prompt (prompt_id, data_source, ground_truth, extra_info, prompt_text, prompt_token_ids, epoch,
    position, gen_round), in pick order."""
    train = prompts[prompts["split"] == "train"].set_index("prompt_id")
    picks = iteration_prompts(list(train.index), iteration, cfg)  # (prompt_id, epoch, position, gen_round)
    chosen = train.loc[[p[0] for p in picks]].reset_index()
    batch = prompt_batch_frame(chosen, tokenizer, cfg.data.max_prompt_length)
    return batch.assign(epoch=[p[1] for p in picks], position=[p[2] for p in picks], gen_round=[p[3] for p in picks])


def prompt_rounds(
    train_ids: list[int],
    first: list[tuple[int, int, int]],
    iteration: int,
    *,
    gen_batch_size: int,
    max_rounds: int,
    seed: int,
) -> list[tuple[int, int, int, int]]:
    """(prompt_id, epoch, position, gen_round) of every candidate prompt of the iteration.

    Args:
        first: round 0, the epoch cursor's (prompt_id, epoch, position) triples.
        max_rounds: cap on rounds (algorithm.filter_groups.max_num_gen_batches); 0 = as many full rounds
            as the other training prompts fill.
    """
    out = [(p, e, pos, 0) for p, e, pos in first]
    taken = {p for p, _, _ in first}
    rest = [p for p in train_ids if p not in taken]
    random.Random(seeds.extra_prompt_rounds(seed, iteration)).shuffle(rest)
    extra = len(rest) // gen_batch_size
    if max_rounds > 0:
        extra = min(extra, max_rounds - 1)
    epoch = first[0][1] if first else 0
    for k, p in enumerate(rest[: extra * gen_batch_size]):
        out.append((p, epoch, -1 - k, 1 + k // gen_batch_size))
    return out


def iteration_prompts(train_ids: list[int], iteration: int, cfg: RunConfig) -> list[tuple[int, int, int, int]]:
    """(prompt_id, epoch, position, gen_round) of the iteration's prompt batch: train_batch_size prompts
    of the epoch cursor, or, with filter_groups, every candidate round of gen_batch_size prompts."""
    fg = cfg.algorithm.filter_groups
    size = (cfg.data.gen_batch_size or cfg.data.train_batch_size) if fg.enable else cfg.data.train_batch_size
    first = sample_prompt_batch(train_ids, iteration, size, seed=cfg.seed, shuffle=cfg.data.shuffle)
    if not fg.enable:
        return [(p, e, pos, 0) for p, e, pos in first]
    return prompt_rounds(
        train_ids, first, iteration, gen_batch_size=size, max_rounds=fg.max_num_gen_batches, seed=cfg.seed
    )


def prompt_batch_frame(prompts: pd.DataFrame, tokenizer, max_prompt_length: int) -> pd.DataFrame:
    """prompts rows -> the columns the rollout stage needs (prompt_token_ids, prompt_text, ...)."""
    ids, texts = tokenize_prompts(
        list(prompts["prompt"]), tokenizer, max_prompt_length, prompt_ids=list(prompts["prompt_id"])
    )
    return pd.DataFrame(
        {
            "prompt_id": prompts["prompt_id"].to_numpy(),
            "data_source": prompts["data_source"].to_numpy(),
            "ground_truth": [rm["ground_truth"] for rm in prompts["reward_model"]],
            # the row's extra_info (JSON text), for a custom reward function's extra_info argument
            "extra_info": prompts["extra_info"].to_numpy() if "extra_info" in prompts else None,
            "prompt_text": texts,
            "prompt_token_ids": ids,
        }
    )


def tokenize_prompts(
    messages: list[list[dict]], tokenizer, max_prompt_length: int, prompt_ids: list[int] | None = None
) -> tuple[list[list[int]], list[str]]:
    """Chat-template and tokenize prompts; a prompt over the limit is a clear error."""
    ids, texts = [], []
    for i, msgs in enumerate(messages):
        toks, text = encode_chat(tokenizer, msgs)
        if len(toks) > max_prompt_length:
            which = prompt_ids[i] if prompt_ids is not None else i
            raise ValueError(
                f"prompt {which} has {len(toks)} tokens, over data.max_prompt_length "
                f"({max_prompt_length}); raise the limit or filter long prompts: {text[:80]!r}..."
            )
        ids.append(list(toks))
        texts.append(text)
    return ids, texts
