"""What `rlake train` shows while it runs: set-up phases, the current iteration and stage, rollout
tokens/s, reward mean and ETA.

On a terminal it is a rich live display with one summary line per finished iteration kept above it;
when stdout is not a TTY (a log file, CI) it prints plain lines only: set-up phases and one line per
iteration. The current stage comes from the Dagster run's own event log (STEP_START and asset
materializations), polled by a background thread, so the assets know nothing about the display.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dagster as dg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

POLL_S = 0.5


class RunProgress:
    """Progress of one `rlake train` call. `live=None` picks rich when stdout is a terminal."""

    def __init__(
        self, *, live: bool | None = None, log: Callable[[str], None] | None = None, console: Console | None = None
    ) -> None:
        # a duplicate of the terminal's stdout, taken before any Dagster run: execute_in_process captures
        # fd 1 into its compute logs while a step runs, which froze the live display for whole stages
        self.console = console or Console(
            file=_own_stdout(), highlight=False, emoji=False
        )  # run ids like ":O:" stay text
        self.live = self.console.is_terminal if live is None else live
        self._log = log
        self._bar: Progress | None = None
        self._task = None
        self._fields = {"stage": "starting", "detail": "", "stats": ""}
        self._stats: dict[str, str] = {}  # rendered into _fields["stats"]
        self._durations: list[float] = []
        self._remaining = 0

    # -- lines kept in the log ---------------------------------------------------------------
    def line(self, text: str) -> None:
        """A line kept above the live display (or printed plainly)."""
        if self._log is not None:
            self._log(text)
        elif self._bar is not None:
            self._bar.console.print(text, markup=False, emoji=False)
        else:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True, emoji=False)

    # -- the live display --------------------------------------------------------------------
    def __enter__(self) -> RunProgress:
        if self.live and self._log is None:
            self._bar = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                TextColumn("[cyan]{task.fields[stage]}[/] {task.fields[detail]}"),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
                transient=True,
                refresh_per_second=4,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("set-up", total=None, eta="", **self._fields)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None
        self.console.file.flush()  # its own file on stdout's descriptor: nothing left in it at exit (exit_now)

    def phase(self, name: str, detail: str = "") -> None:
        """A set-up phase (before the iterations): shown live, and as a plain line without a terminal."""
        self._update(stage=name, detail=detail)
        if self._bar is None:
            self.line(f"  {name}{': ' + detail if detail else ''}")

    def start_iterations(self, first: int, total: int) -> None:
        self._remaining = max(total - first, 0)
        if self._bar is not None:
            self._bar.update(self._task, description="iteration", total=total, completed=first)

    def iteration_done(self, it: int, seconds: float, summary: str) -> None:
        self._durations.append(seconds)
        self._remaining = max(self._remaining - 1, 0)
        self.line(f"iteration {it}: {seconds:.1f}s  {summary}")
        if self._bar is not None:
            self._bar.update(self._task, advance=1, eta=self.eta())

    def eta(self) -> str:
        """Remaining iterations x the mean of the last five iteration times (the first is the slowest)."""
        if not self._durations or not self._remaining:
            return ""
        recent = self._durations[-5:]
        secs = int(self._remaining * sum(recent) / len(recent))
        return f"ETA {secs // 60}:{secs % 60:02d}"

    def _update(self, **fields: str) -> None:
        self._fields |= fields
        if self._bar is not None:
            self._bar.update(self._task, **fields)

    # -- following a Dagster run -------------------------------------------------------------
    @contextmanager
    def follow(self, instance, dagster_run_id: str) -> Iterator[None]:
        """While the block runs, show the run's current step and its latest stats."""
        stop = threading.Event()
        thread = threading.Thread(target=self._poll, args=(instance, dagster_run_id, stop), daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)

    def _poll(self, instance, dagster_run_id: str, stop: threading.Event) -> None:
        kinds = {dg.DagsterEventType.STEP_START, dg.DagsterEventType.ASSET_MATERIALIZATION}
        cursor = None
        while not stop.wait(POLL_S):
            try:
                conn = instance.get_records_for_run(dagster_run_id, cursor=cursor, of_type=kinds)
            except Exception:  # the run is not stored yet, or sqlite is busy: try again next tick
                continue
            cursor = conn.cursor
            for record in conn.records:
                self._on_event(record.event_log_entry)

    def _on_event(self, entry) -> None:
        event = entry.dagster_event
        if event is None:
            return
        if event.event_type_value == "STEP_START":
            self._update(stage=event.step_key or "", detail="")
            if self._bar is None and self._verbose_steps:
                self.line(f"    {event.step_key}")
            return
        mat = event.step_materialization_data.materialization
        meta = {k: v.value for k, v in mat.metadata.items()}
        if "tokens_per_s" in meta:
            self._stats["tok/s"] = f"{float(meta['tokens_per_s']):.0f}"
        if "reward_mean" in meta:
            self._stats["reward"] = f"{float(meta['reward_mean']):.3f}"
        self._update(stats=" ".join(f"{k}={v}" for k, v in self._stats.items()))

    _verbose_steps = False

    def verbose_steps(self, on: bool = True) -> RunProgress:
        """Without a terminal, also print one line per Dagster step (`rlake train --verbose`)."""
        self._verbose_steps = on
        return self


def plain(log: Callable[[str], None] = print) -> RunProgress:
    """Plain lines through `log` (tests pass `lambda s: None`)."""
    return RunProgress(live=False, log=log)


def _own_stdout():
    """A new file on the process's stdout descriptor, or sys.stdout where it has none (a test's capture)."""
    try:
        return os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and ValueError
        return sys.stdout


def asset_metadata(result, asset: str) -> dict:
    """The metadata of `asset`'s materialization in an in-process run's result ({} when it has none)."""
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key.to_user_string() == asset:
            return {k: v.value for k, v in mat.metadata.items()}
    return {}


def fmt_items(meta: dict, prefix: str) -> str:
    """`key=value` pairs of the metadata keys starting with `prefix` (floats to 4 significant digits)."""
    return "  ".join(
        f"{k}={_fmt(v)}"
        for k, v in sorted(meta.items())
        if k.startswith(prefix) and k != "delta_version" and isinstance(v, (int, float))  # not run_curves' image
    )


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
