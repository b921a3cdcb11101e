"""How a generation pass is cut over the rollout ranks, and what each rank does with its rows before it writes them.

A pass generates n samples for each prompt row of a frame. Its rollout_ids are known before any sample exists:
the prompts in (prompt_id, row) order, n ids each from the pass's first id, a sample's id = its prompt's first id
+ sample_index. So the driver sends each rank its prompts with their first ids (`rollout_order`), and the rank
numbers and writes its own rows (`NumberRollouts`); the driver never gathers the rows.

The ranks get contiguous runs of that order, so each rank's ids are one contiguous range and the files, in rank
order, hold the partition in rollout_id order, as one sorted file did. On the rank the prompts go back to the
frame's row order (`in_batch_order`) before the engine sees them: with one rank the engine gets the very prompts,
in the very order, of a whole-frame call, so its seeded samples are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from stages.io.tables import ROLLOUT_TOKEN_COLUMNS

FIRST_ID = "_first_rollout_id"
"""A prompt row's first rollout_id in its pass (sent to the rank with the prompt, dropped before the write)."""
ROW = "_batch_row"
"""A prompt row's position in the frame the pass was asked for (the engine sees a rank's prompts in this order)."""
SAMPLES = 4
"""Rows a pass's summary keeps for the asset's sample table (the first ones by rollout_id)."""
SAMPLE_COLUMNS = ("rollout_id", "prompt_text", "response_text", "finish_reason")
"""A summary's sample rows' columns (a frame without one, e.g. a test's prompts without text, gets "")."""
TOKEN_COLUMNS = ROLLOUT_TOKEN_COLUMNS
"""The per-token columns of a rollout: what a reader that needs the text and the scores leaves on disk."""


def rollout_order(prompts: pd.DataFrame, n: int, first_id: int = 0) -> pd.DataFrame:
    """`prompts` in rollout_id order, (prompt_id, row) ascending, each with its first id (FIRST_ID: first_id + n
    times its place) and its row in `prompts` (ROW)."""
    row = np.arange(len(prompts))
    order = np.lexsort((row, prompts["prompt_id"].to_numpy()))
    out = prompts.iloc[order].reset_index(drop=True)
    return out.assign(**{ROW: row[order], FIRST_ID: first_id + n * np.arange(len(out), dtype=np.int64)})


def in_batch_order(rows: pd.DataFrame) -> pd.DataFrame:
    """A rank's prompts back in the order of the frame the pass was asked for (its `prepare`, on the rank)."""
    return rows.sort_values(ROW, kind="stable").reset_index(drop=True)


@dataclass(frozen=True)
class NumberRollouts:
    """A rank's `finish` of a generation pass: number its samples (rollout_id = the prompt's first id +
    sample_index), set `stamp`'s columns (gen_round; ReMax: is_baseline, and sample_index -1 for the greedy
    baselines), drop the helper columns, sort by rollout_id; and summarize the rows for the asset."""

    n: int
    stamp: dict[str, Any] = field(default_factory=dict)

    def __call__(self, prompts: pd.DataFrame, out: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
        if len(prompts):
            self._check(prompts, out)
        ids = out[FIRST_ID].to_numpy(dtype=np.int64) + out["sample_index"].to_numpy(dtype=np.int64)
        out = out.assign(rollout_id=ids, **self.stamp).drop(columns=[FIRST_ID, ROW])
        out = out.sort_values("rollout_id", kind="stable").reset_index(drop=True)
        return out, rollout_summary(out)

    def _check(self, prompts: pd.DataFrame, out: pd.DataFrame) -> None:
        """Every prompt got exactly samples 0..n-1: else ids would collide or leave holes."""
        bad = len(out) == 0
        if not bad:
            counts = out.groupby(FIRST_ID)["sample_index"].agg(["count", "min", "max", "nunique"])
            bad = bool(((counts["count"] != self.n) | (counts["nunique"] != self.n)).any())
            bad |= bool(((counts["min"] != 0) | (counts["max"] != self.n - 1)).any()) or len(counts) != len(prompts)
        if bad:
            raise ValueError(
                f"the engine returned {len(out)} samples for {len(prompts)} prompts, not rollout.n = {self.n} "
                "each numbered 0..n-1: a rollout's id is its prompt's place times n plus its sample index, so "
                "another count would give two rollouts one id. This is an engine bug; look at the rollout "
                "worker's log"
            )


def rollout_summary(out: pd.DataFrame) -> dict[str, Any]:
    """What the rollouts asset's metadata and checks need of a rank's rows: counts, engine, syncs, rounds,
    fingerprints, and the first SAMPLES rows' text."""
    fingerprints = out["engine_weights_fingerprint"].fillna("<none>").value_counts() if len(out) else pd.Series()
    head = out.head(SAMPLES)
    return {
        "rows": len(out),
        "response_tokens": int(out["response_length"].sum()) if len(out) else 0,
        "empty_responses": int((out["response_length"] == 0).sum()) if len(out) else 0,
        "engines": sorted(set(out["engine"])) if len(out) else [],
        "engine_sync": sorted(set(out["engine_sync"])) if len(out) else [],
        "gen_rounds": sorted({int(r) for r in out["gen_round"]}) if "gen_round" in out else [0],
        "baselines": int(out["is_baseline"].sum()) if "is_baseline" in out else 0,
        "fingerprints": {str(k): int(v) for k, v in fingerprints.items()},
        "samples": head.reindex(columns=list(SAMPLE_COLUMNS)).fillna("").to_dict("records"),
    }


def merge_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The summaries of every rank of every pass as one (the whole partition's)."""
    fingerprints: dict[str, int] = {}
    for s in summaries:
        for k, v in s["fingerprints"].items():
            fingerprints[k] = fingerprints.get(k, 0) + v
    samples = sorted((r for s in summaries for r in s["samples"]), key=lambda r: r["rollout_id"])[:SAMPLES]
    return {
        "rows": sum(s["rows"] for s in summaries),
        "response_tokens": sum(s["response_tokens"] for s in summaries),
        "empty_responses": sum(s["empty_responses"] for s in summaries),
        "engines": sorted({e for s in summaries for e in s["engines"]}),
        "engine_sync": sorted({e for s in summaries for e in s["engine_sync"]}),
        "gen_rounds": sorted({r for s in summaries for r in s["gen_rounds"] if s["rows"]}),
        "baselines": sum(s["baselines"] for s in summaries),
        "fingerprints": fingerprints,
        "samples": samples,
    }
