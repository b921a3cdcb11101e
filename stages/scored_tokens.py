"""A scored_rollouts partition read with its token columns, which live in the rollouts table only (#36: token data
stored once, not copied into every table that scores or selects rollouts).

`scored_rollouts` keeps each rollout's ids, text, scalars and rewards; `rollouts` keeps its token columns
(tables.ROLLOUT_TOKEN_COLUMNS). The stages that need both (advantages, iteration_metrics) read a `ScoredRollouts`:
the scored partition's record batches, each with the token columns of its rows taken from the rollouts partition
the scores were computed from (by rollout_id, at its recorded version). The two are written in the same rollout
order, so the join is a merge over two streams, one record batch of each held at a time; a rollouts partition in
another order is read whole (its token columns, as Arrow) and taken into the scored order. A scored_rollouts
partition written before this change still holds copies of the token columns; they are left unread.

It offers the reads of a stage_exec.Partition (record_batches, batches, read, arrow, columns) and its keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
import pyarrow as pa

from stages.io.stage_exec import MergeTake, Partition, stream_ids, stream_places
from stages.io.tables import ROLLOUT_TOKEN_COLUMNS


@dataclass(frozen=True)
class ScoredRollouts:
    """Partition `scored` of scored_rollouts with the token columns of partition `rollouts` (see the module)."""

    scored: Partition
    rollouts: Partition

    @property
    def uri(self) -> str:
        return self.scored.uri

    @property
    def run_id(self) -> str:
        return self.scored.run_id

    @property
    def iteration(self) -> int:
        return self.scored.iteration

    @property
    def version(self) -> int | None:
        return self.scored.version

    @cached_property
    def positions(self) -> np.ndarray:
        """Each scored row's place in the rollouts stream; a scored rollout the rollouts lack is an error."""
        mine = stream_ids(self.scored)
        positions, found = stream_places(stream_ids(self.rollouts), mine)
        if not found.all():
            raise ValueError(
                f"scored rollouts {mine[~found][:10].tolist()} are not in the rollouts partition (run "
                f"{self.run_id}, iteration {self.iteration}, version {self.rollouts.version}) whose token columns "
                "they read: scored_rollouts was scored from other rollouts; re-materialize scored_rollouts of this "
                "iteration"
            )
        return positions

    def columns(self) -> list[str]:
        own = [c for c in self.scored.columns() if c not in ROLLOUT_TOKEN_COLUMNS]
        return own + [c for c in self.rollouts.columns() if c in ROLLOUT_TOKEN_COLUMNS]

    def record_batches(
        self, columns: list[str] | None = None, batch_rows: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """The scored partition's record batches with `columns` (None: all), the token ones from the rollouts."""
        columns = self.columns() if columns is None else list(columns)
        tokens = [c for c in columns if c in ROLLOUT_TOKEN_COLUMNS and c in set(self.rollouts.columns())]
        own = [c for c in columns if c not in ROLLOUT_TOKEN_COLUMNS]
        if not tokens:
            yield from self.scored.record_batches(own, batch_rows)
            return
        taker, first = MergeTake(self.rollouts, tokens, self.positions, batch_rows), 0
        for batch in self.scored.record_batches(own or ["rollout_id"], batch_rows):
            k = batch.num_rows
            taken = taker.take(first, k).combine_chunks()
            first += k
            have = {**{n: batch.column(n) for n in batch.schema.names}, **{c: taken.column(c).chunk(0) for c in tokens}}
            names = [c for c in columns if c in have]
            yield pa.RecordBatch.from_arrays([have[c] for c in names], names=names)

    def batches(self, columns: list[str] | None = None, batch_rows: int | None = None) -> Iterator[pd.DataFrame]:
        return (batch.to_pandas() for batch in self.record_batches(columns, batch_rows))

    def arrow(self, columns: list[str]) -> pa.Table:
        return pa.Table.from_batches(list(self.record_batches(columns)))

    def read(self, columns: list[str] | None = None) -> pd.DataFrame:
        frames = list(self.batches(columns))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns or self.columns())
