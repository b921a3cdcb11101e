"""The advantages rows as their readers see them: the table's own columns (advantages, returns, KL columns...)
joined by rollout_id to the token columns of `rollouts` and the log-probs of `old_logprobs`, `ref_logprobs` and
`teacher_logprobs` (tables.ADVANTAGE_JOINS; #36: each stored once, not copied into advantages).

An advantages commit records in its lineage `joins` (the tables whose columns its readers join) beside `upstream`
(the versions of every table it read): the readers take each joined table's partition at that version. The tables
are the advantages table's siblings (<tables root>/<table>), so a moved or copied tables root still reads. A table
the commit lists but did not read (ref_logprobs without a KL term, teacher_logprobs without distillation) gives what
the writer used to copy for it: empty lists, NaN. A commit without `joins` (an older rlake; tests writing that
layout) holds the copies: they are read from the partition as they are.

Two readers: `read_advantage_rows` (the update ranks and the critic: only the rows of given rollout ids, each
joined table read with that filter and only the columns asked for), and `JoinedAdvantages` (iteration_metrics: a
partition's record batches, each joined table merged in by stage_exec.MergeTake, one record batch at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from stages.io import store, uris
from stages.io.stage_exec import MergeTake, Partition, stream_ids, stream_places
from stages.io.tables import ADVANTAGE_JOINS

JOINED = {c: table for table, columns in ADVANTAGE_JOINS.items() for c in columns}
"""joined column -> its table."""
UNREAD = {"rollout_logprobs": [], "old_logprobs": [], "ref_logprobs": [], "teacher_logprobs": []}
UNREAD |= {"rollout_probs_diff_max": np.nan, "rollout_probs_diff_mean": np.nan}
"""A joined column of a table the advantages commit did not read (or that lacks it): the value each row had in the
copies (empty lists, NaN); a token column or response_mask is left out instead, as a reader of the copies found it."""


def with_joins(lineage, tables: list[str]):
    """The advantages commit's lineage (a mapping, or a function giving one) with `joins`: `tables`, those of
    ADVANTAGE_JOINS whose columns the rows had copied (rollouts always; old_logprobs, ref_logprobs when read,
    teacher_logprobs with distillation); a joined table not listed gives UNREAD values."""
    joins = {"joins": sorted(tables)}
    if callable(lineage):
        return lambda *args: {**lineage(*args), **joins}
    return {**lineage, **joins}


def sibling(uri: str, table: str) -> str:
    """The table `table` beside the table at `uri` (the same tables root and storage options)."""
    root = str(uris.normalize(uri)).rsplit("/", 1)[0]
    return uris.join(uris.with_options(root, getattr(uri, "storage_options", None)), table)


def join_sources(uri: str, run_id: str, iteration: int, version: int | None) -> dict[str, tuple[str, int]] | None:
    """{joined table: (its uri, the version the commit read)} of the tables the advantages commit at `version`
    joins; None when it records no `joins` (the partition holds the copies)."""
    if version is None:
        version = store.table_version(uri)
    commit = store.commit_at(uri, version)  # a recorded version is the commit that wrote the partition
    if not store.of_partition(commit, run_id, iteration):  # else: the newest rlake commit of it up to `version`
        mine = (c for c in store.History(uri).commits() if c["version"] <= version)
        commit = next((c for c in mine if store.of_partition(c, run_id, iteration)), None)
    if not commit or "joins" not in commit:
        return None
    upstream = commit.get("upstream") or {}
    lacking = [t for t in commit["joins"] if upstream.get(t) is None]
    if lacking:
        raise ValueError(
            f"advantages version {version} at {uri} joins {lacking} but its lineage records no version of them "
            "(upstream): it was not written by the advantages stage; re-materialize advantages of this iteration"
        )
    return {t: (sibling(uri, t), int(upstream[t])) for t in commit["joins"]}


def _missing_error(table: str, ids: np.ndarray, version: int) -> ValueError:
    return ValueError(
        f"rollouts {ids[:10].tolist()} of the advantages partition are not in the {table} partition (version "
        f"{version}) its commit read: {table} was rewritten or vacuumed since; re-materialize advantages of this "
        "iteration"
    )


def fill_unread(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """frame with the UNREAD value in each of `columns` it lacks (UNREAD ones only)."""
    n, lacking = len(frame), [c for c in columns if c in UNREAD and c not in frame]
    return frame.assign(**{c: [[]] * n if isinstance(UNREAD[c], list) else np.full(n, UNREAD[c]) for c in lacking})


def read_advantage_rows(
    uri: str, run_id: str, iteration: int, version: int | None, columns: list[str], ids: np.ndarray | None = None
) -> pd.DataFrame:
    """The partition's rows (only those of rollout ids `ids` when given) with `columns`: the table's own, and the
    joined ones from their tables at the recorded versions, read with the same rollout_id filter; in the table's
    row order (filtered). A column neither has is left out (UNREAD's get their value)."""
    where = None if ids is None else pc.field("rollout_id").isin(np.asarray(ids))
    sources = join_sources(uri, run_id, iteration, version)
    own = [c for c in columns if sources is None or c not in JOINED]
    own = store.present_columns(uri, ["rollout_id", *[c for c in own if c != "rollout_id"]], version=version)
    df = store.read_partition(uri, run_id, iteration, version=version, columns=own, filters=where)
    for table, names in ADVANTAGE_JOINS.items() if sources is not None else ():
        wanted = [c for c in names if c in columns]
        if not wanted or table not in sources:
            continue
        src, v = sources[table]
        present = store.present_columns(src, wanted, version=v)
        where = pc.field("rollout_id").isin(df["rollout_id"].to_numpy())
        other = store.read_partition(src, run_id, iteration, version=v, columns=["rollout_id", *present], filters=where)
        places, found = stream_places(other["rollout_id"].to_numpy(), df["rollout_id"].to_numpy())
        if not found.all():
            raise _missing_error(table, df["rollout_id"].to_numpy()[~found], v)
        df = df.assign(**{c: other[c].to_numpy()[places] for c in present})
    if sources is not None:
        df = fill_unread(df, [c for c in columns if c in JOINED])
    return df[[c for c in columns if c in df.columns]]


def advantage_frame(uri: str, run_id: str, iteration: int, version: int | None = None) -> pd.DataFrame:
    """The whole partition as the old layout held it: the table's own columns and every joined column (for
    inspection and tests; the update ranks read their rows only: read_advantage_rows with `ids`)."""
    own = [c for c in store.present_columns(uri, None, version=version) if c not in ("run_id", "iteration")]
    return read_advantage_rows(uri, run_id, iteration, version, list(dict.fromkeys([*own, *JOINED])))


@dataclass(frozen=True)
class JoinedAdvantages:
    """Partition `advantages` of the advantages table with its joined columns (see the module), streamed. It offers
    the reads of a stage_exec.Partition (record_batches, batches, read, columns) and its keys."""

    advantages: Partition
    sources: dict[str, Partition] | None = field(default=None)

    @classmethod
    def of(cls, part: Partition | JoinedAdvantages) -> JoinedAdvantages:
        """The partition with the tables its commit joins (none for one that holds the copies)."""
        if isinstance(part, JoinedAdvantages):
            return part
        found = join_sources(part.uri, part.run_id, part.iteration, part.version)
        if found is None:
            return cls(part, None)
        keys = (part.run_id, part.iteration)
        return cls(part, {t: Partition(u, *keys, v, part.storage_options) for t, (u, v) in found.items()})

    @property
    def uri(self) -> str:
        return self.advantages.uri

    @property
    def run_id(self) -> str:
        return self.advantages.run_id

    @property
    def iteration(self) -> int:
        return self.advantages.iteration

    @property
    def version(self) -> int | None:
        return self.advantages.version

    @cached_property
    def _positions(self) -> dict[str, np.ndarray]:
        """Each advantages row's place in each joined table's stream (a row the table lacks is an error)."""
        mine, out = stream_ids(self.advantages), {}
        for table, part in (self.sources or {}).items():
            out[table], found = stream_places(stream_ids(part), mine)
            if not found.all():
                raise _missing_error(table, mine[~found], part.version)
        return out

    @cached_property
    def _source_columns(self) -> dict[str, list[str]]:
        return {t: [c for c in p.columns() if c in ADVANTAGE_JOINS[t]] for t, p in (self.sources or {}).items()}

    def columns(self) -> list[str]:
        own = self.advantages.columns()
        if self.sources is None:
            return own
        joined = [c for cs in self._source_columns.values() for c in cs]
        return [c for c in own if c not in JOINED] + joined + [c for c in UNREAD if c not in joined]

    def record_batches(
        self, columns: list[str] | None = None, batch_rows: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """The partition's record batches with `columns` (None: all) that it has, the joined ones merged in."""
        have = self.columns()
        columns = have if columns is None else [c for c in columns if c in have]
        if self.sources is None:
            yield from self.advantages.record_batches(columns, batch_rows)
            return
        own = [c for c in columns if c not in JOINED]
        takers, first = self._takers(columns, batch_rows), 0
        for batch in self.advantages.record_batches(own or ["rollout_id"], batch_rows):
            k = batch.num_rows
            arrays = {n: batch.column(n) for n in batch.schema.names}
            for names, taker in takers if k else ():
                taken = taker.take(first, k).combine_chunks()
                arrays |= {c: taken.column(c).chunk(0) for c in names}
            arrays |= {c: unread_array(c, k) for c in columns if c not in arrays}
            first += k
            yield pa.RecordBatch.from_arrays([arrays[c] for c in columns], names=columns)

    def _takers(self, columns: list[str], batch_rows: int | None) -> list[tuple[list[str], MergeTake]]:
        """(column names, a MergeTake of them) per joined table some of `columns` come from."""
        out = []
        for table, part in (self.sources or {}).items():
            names = [c for c in self._source_columns[table] if c in columns]
            if names:
                out.append((names, MergeTake(part, names, self._positions[table], batch_rows)))
        return out

    def batches(self, columns: list[str] | None = None, batch_rows: int | None = None) -> Iterator[pd.DataFrame]:
        return (batch.to_pandas() for batch in self.record_batches(columns, batch_rows))

    def read(self, columns: list[str] | None = None) -> pd.DataFrame:
        frames = list(self.batches(columns))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns or self.columns())


def unread_array(column: str, k: int) -> pa.Array:
    """k rows of UNREAD[column] as Arrow (empty float32 lists, or float64 NaN)."""
    if isinstance(UNREAD[column], list):
        return pa.ListArray.from_arrays(pa.array(np.zeros(k + 1, np.int32)), pa.array([], pa.float32()))
    return pa.array(np.full(k, np.nan))
