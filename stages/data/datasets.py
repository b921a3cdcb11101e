"""Datasets in verl's parquet format: validation, ingest, and the synthetic arithmetic task.

verl row: data_source (str), prompt (list of {role, content}), ability (str),
reward_model {style, ground_truth}, extra_info (dict). The synthetic task writes the same format,
so a user can swap in GSM8K parquet files without touching code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from configs.schema import SyntheticTaskConfig
from stages import seeds
from stages.data.rewards import canonical_ground_truth
from stages.data.tool_arith import generate_tool_arith_task
from stages.data.word_problems import generate_word_problem_task

REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
ARITH_SOURCE = "rlake/arith"


def make_arith_rows(pairs: list[tuple[int, str, int]], split: str) -> list[dict]:
    rows = []
    for i, (a, op, b) in enumerate(pairs):
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "data_source": ARITH_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "answer": f"#### {answer}"},
            }
        )
    return rows


def generate_arith_task(out_dir: str | Path, cfg: SyntheticTaskConfig) -> tuple[str, str]:
    """Write train.parquet and val.parquet (disjoint operand pairs); returns their paths.

    cfg: configs.schema.SyntheticTaskConfig.
    """
    rng = random.Random(cfg.seed)
    space = [(a, op, b) for op in cfg.operators for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
    if cfg.num_val + 1 > len(space):
        raise ValueError(
            f"synthetic.num_val ({cfg.num_val}) leaves no training problems in a space of "
            f"{len(space)}; raise synthetic.max_operand or lower num_val"
        )
    rng.shuffle(space)
    val, rest = space[: cfg.num_val], space[cfg.num_val :]
    train = [rest[i % len(rest)] for i in range(cfg.num_train)] if cfg.num_train > len(rest) else rest[: cfg.num_train]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, pairs in (("train", train), ("val", val)):
        path = out / f"{name}.parquet"
        pd.DataFrame(make_arith_rows(pairs, name)).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]


def generate_synthetic_task(out_dir: str | Path, cfg: SyntheticTaskConfig) -> tuple[str, str]:
    """The configured synthetic task (cfg.task: addition | word_problems | tool_arithmetic) as train/val parquet
    paths."""
    if cfg.task == "word_problems":
        return generate_word_problem_task(out_dir, cfg)
    if cfg.task == "tool_arithmetic":
        return generate_tool_arith_task(out_dir, cfg)
    return generate_arith_task(out_dir, cfg)


def _check_row_types(df: pd.DataFrame, path: str) -> None:
    for i, (prompt, rm) in enumerate(zip(df["prompt"], df["reward_model"])):
        msgs = list(prompt) if prompt is not None else None
        if not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise ValueError(
                f"{path}: row {i} column 'prompt' must be a non-empty list of "
                f"{{role, content}} messages (verl format), got {prompt!r}"
            )
        if not isinstance(rm, dict) or rm.get("ground_truth") is None:
            raise ValueError(
                f"{path}: row {i} column 'reward_model' must be a struct with a 'ground_truth' field, got {rm!r}"
            )


def _reward_model(rm: dict, where: str) -> dict[str, str]:
    """A row's reward_model with its ground truth as the text the scorers compare (canonical_ground_truth)."""
    try:
        return {"style": str(rm.get("style", "rule")), "ground_truth": canonical_ground_truth(rm["ground_truth"])}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: reward_model.ground_truth: {exc}") from None


def read_verl_parquet(path: str | Path, split: str) -> pd.DataFrame:
    """Read and validate one verl-format parquet file into prompts-table rows (no prompt_id yet)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file '{p}' does not exist (data.train_files / data.val_files)")
    cols = pq.read_schema(p).names
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise ValueError(
            f"{p}: missing verl columns {missing}; found {cols}. Each row needs "
            f"{list(REQUIRED_COLUMNS)} (see verl's data preprocessing docs)."
        )
    df = pd.read_parquet(p)
    if not len(df):
        raise ValueError(f"{p}: no rows")
    _check_row_types(df, str(p))  # before normalising: a malformed message is a clear error, not a KeyError
    df["prompt"] = [
        [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs] if msgs is not None else None
        for msgs in df["prompt"]
    ]
    _check_row_types(df, str(p))
    return pd.DataFrame(
        {
            "split": split,
            "data_source": df["data_source"].astype(str),
            "prompt": df["prompt"],
            "ability": df["ability"].astype(str),
            "reward_model": [_reward_model(r, f"{p}: row {i}") for i, r in enumerate(df["reward_model"])],
            "extra_info": [
                json.dumps(x if isinstance(x, dict) else {}, default=str, sort_keys=True) for x in df["extra_info"]
            ],
            "source_file": str(p),
        }
    )


def load_prompt_rows(train_files: list[str], val_files: list[str]) -> pd.DataFrame:
    """All rows of the run's dataset with a dense prompt_id (train first, then val)."""
    parts = [read_verl_parquet(f, "train") for f in train_files] + [read_verl_parquet(f, "val") for f in val_files]
    df = pd.concat(parts, ignore_index=True)
    df.insert(0, "prompt_id", range(len(df)))
    return df


def sample_prompt_batch(
    train_ids: list[int], iteration: int, batch_size: int, *, seed: int, shuffle: bool
) -> list[tuple[int, int, int]]:
    """The (prompt_id, epoch, position) triples of iteration `iteration`: a cursor over epochs.

    Iteration i takes positions [i*bs, (i+1)*bs) of the concatenation of per-epoch orders, each
    epoch a permutation seeded by (seed, epoch): resumable and identical across restarts.
    """
    n = len(train_ids)
    if n < batch_size:
        raise ValueError(
            f"data.train_batch_size ({batch_size}) exceeds the {n} training prompts; lower train_batch_size or add data"
        )
    orders: dict[int, list[int]] = {}
    out = []
    for pos in range(iteration * batch_size, (iteration + 1) * batch_size):
        epoch, k = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = list(train_ids)
            if shuffle:
                random.Random(seeds.epoch_shuffle(seed, epoch)).shuffle(orders[epoch])
        out.append((orders[epoch][k], epoch, pos))
    return out
