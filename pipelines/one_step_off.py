"""trainer.async_mode=one_step_off in `rlake train`: iteration i+1's rollouts are generated while iteration i's
update runs (verl's one_step_off_policy recipe).

Iteration i's rollouts are sampled by policy v_{i-1} (v_0 for iterations 0 and 1: TrainerConfig.rollout_version),
so nothing in iteration i+1's generation waits for iteration i's update. Each iteration is two Dagster runs of
its own (run x iteration) partition, both of the iteration job:
- a generation run: the stages up to the rollouts (GENERATION), tagged rlake/phase=generate and
  rlake/policy_version=<the version that sampled>;
- a training run: every other stage of the iteration, tagged rlake/phase=train and rlake/policy_version=<i>,
  the version it updates.
The generation run of iteration i+1 executes in a second thread of this process beside the training run of
iteration i, so the two runs' Ray work (engines vs trainer ranks) overlaps; the first generation runs alone.
Each table row, commit and materialization records the policy version it used, the same as when the
iteration runs as one job (the UI, the chaining sensor), which gives the same rows, only without overlap.

A killed process resumes like a sync run (stages/run/resume.py resume_point, lag 1): from the first iteration
without metrics whose policy and sampling policy are both kept, regenerating its rollouts first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import dagster as dg

from assets.common import add_partitions, partition_key
from configs.schema import RunConfig
from pipelines.jobs import ITERATION_JOB, iteration_asset_keys
from pipelines.progress import RunProgress, asset_metadata, fmt_items

GENERATION = ("prompt_batches", "rollouts", "turns")
"""The stages of an iteration's generation run; every other stage of the iteration is its training run."""
PHASE_TAG = "rlake/phase"
POLICY_TAG = "rlake/policy_version"


def phase_selections(cfg: RunConfig) -> tuple[list[dg.AssetKey], list[dg.AssetKey]]:
    """(generation, training) asset keys of an iteration of a run with `cfg`."""
    keys = iteration_asset_keys(cfg)
    gen = [k for k in keys if k.path[-1] in GENERATION]
    return gen, [k for k in keys if k.path[-1] not in GENERATION]


def run_one_step_off(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    cfg: RunConfig,
    first: int,
    total: int,
    progress: RunProgress,
    *,
    tags: dict[str, str],
    run_config: dict,
    execute: Callable[..., dg.ExecuteInProcessResult],
    retry: Callable[[Callable[[int], Iterator[tuple[int, dict]]]], list[dict]] | None = None,
) -> list[dict]:
    """Iterations first..total-1 with generation one iteration ahead of training; returns iteration_metrics'
    metadata per iteration. tags, run_config: what every run of this `rlake train` carries (pipelines.runner);
    execute(job, instance, progress | None, tags=, run_config=, partition=, asset_selection=) is the runner's
    in-process launch; retry(iterations) runs iterations(start) from `first`, re-running from the last
    committed checkpoint an iteration that lost a worker (pipelines.runner.with_iteration_retries; None: no
    retries). A re-run starts with that iteration's generation again."""
    runs = _PhaseRuns(defs.resolve_job_def(ITERATION_JOB), instance, cfg, tags, run_config, execute)
    if first >= total:
        return []
    with concurrent_runs(instance), ThreadPoolExecutor(1, thread_name_prefix="rlake-generate") as pool:

        def iterations(start: int) -> Iterator[tuple[int, dict]]:
            return _overlapped(runs, pool, start, total, progress)

        if retry is not None:
            return retry(iterations)
        return [meta for _, meta in iterations(first)]


def _overlapped(
    runs: _PhaseRuns, pool: ThreadPoolExecutor, first: int, total: int, progress: RunProgress
) -> Iterator[tuple[int, dict]]:
    """The generation run of `first`, then per iteration its training run beside the next one's generation run;
    yields (iteration, iteration_metrics' metadata) as each training run ends."""
    cfg = runs.cfg
    seconds = runs.generate(first)
    progress.line(f"  rollouts of iteration {first} (policy v{cfg.trainer.rollout_version(first)}): {seconds:.1f}s")
    for it in range(first, total):
        t1 = time.perf_counter()
        ahead = pool.submit(runs.generate, it + 1) if it + 1 < total else None
        try:
            res = runs.train(it, progress)
        finally:
            _wait(ahead)  # a thread cannot be stopped: let the generation end before anything is raised
        meta = asset_metadata(res, "iteration_metrics")
        progress.iteration_done(it, time.perf_counter() - t1, fmt_items(meta, ""))
        yield it, meta
        if ahead is not None:  # its error (a lost rollout worker) raises here, once iteration `it` is recorded
            progress.line(
                f"  rollouts of iteration {it + 1} (policy v{cfg.trainer.rollout_version(it + 1)}) beside "
                f"the update: {ahead.result():.1f}s"
            )


class _PhaseRuns:
    """Launches one phase of one iteration as a Dagster run of the iteration job, tagged with the phase and
    the policy version it uses."""

    def __init__(self, job, instance, cfg: RunConfig, tags: dict, run_config: dict, execute: Callable) -> None:
        self.job, self.instance, self.cfg, self.tags, self.run_config = job, instance, cfg, tags, run_config
        self.execute = execute
        self.gen_keys, self.train_keys = phase_selections(cfg)

    def generate(self, it: int) -> float:
        """The generation run of iteration `it` (not shown live); its wall seconds."""
        t0 = time.perf_counter()
        self._launch(it, "generate", self.cfg.trainer.rollout_version(it), self.gen_keys, None)
        return time.perf_counter() - t0

    def train(self, it: int, progress: RunProgress) -> dg.ExecuteInProcessResult:
        """The training run of iteration `it`, its steps shown by `progress`."""
        return self._launch(it, "train", it, self.train_keys, progress)

    def _launch(self, it: int, phase: str, version: int, keys, shown: RunProgress | None):
        add_partitions(self.instance, self.cfg.run_id, it)
        return self.execute(
            self.job,
            self.instance,
            shown,
            tags={**self.tags, PHASE_TAG: phase, POLICY_TAG: str(version)},
            run_config=self.run_config,
            partition=partition_key(self.cfg.run_id, it),
            asset_selection=keys,
        )


def _wait(fut: Future | None) -> None:
    if fut is not None:
        fut.exception()


@contextmanager
def concurrent_runs(instance: dg.DagsterInstance) -> Iterator[None]:
    """While the block runs, two in-process runs of `instance` may execute at once in this process.

    Two things an in-process run does act on the whole process, and are made safe for the block's length:
    - Its start builds the instance's dagster.yaml logging handlers with `logging.config.dictConfig`, which
      takes the logging module's lock and then each existing handler's: the other run's log handler, which
      takes those locks in the opposite order while it records an event, so the two deadlock. The handlers are
      built once, here, and reused by every run of the block.
    - Its compute log manager points file descriptors 1 and 2 at the run's log file and restores them when the
      run ends; overlapping runs would restore them out of order and leave the process writing into a
      finished run's log. serialized_capture lets one run at a time hold them.
    """
    handlers = instance.get_yaml_python_handlers()
    manager = instance.compute_log_manager
    instance.get_yaml_python_handlers = lambda: handlers
    manager.capture_logs = serialized_capture(manager)
    try:
        yield
    finally:
        del instance.get_yaml_python_handlers, manager.capture_logs


def serialized_capture(manager):
    """manager.capture_logs, except that a run starting while another holds the descriptors is not captured:
    its log says where its output went (the other run's log, or the terminal)."""
    original = manager.capture_logs
    lock = threading.Lock()
    holder: list[str] = []

    @contextmanager
    def capture_logs(log_key):
        with lock:
            mine = not holder
            if mine:
                holder.append("/".join(log_key))
            other = holder[0]
        if mine:
            try:
                with original(log_key) as ctx:
                    yield ctx
            finally:
                with lock:
                    holder.clear()
            return
        from dagster._core.storage.compute_log_manager import CapturedLogContext, ComputeIOType  # noqa: PLC0415

        note = (
            f"[rlake] this run overlapped run log {other} (trainer.async_mode=one_step_off); only one run at a "
            "time can capture the process's stdout/stderr, so this run's output is in that log or the terminal\n"
        )
        for io_type in (ComputeIOType.STDOUT, ComputeIOType.STDERR):
            with manager.open_log_stream(log_key, io_type) as stream:
                if stream is not None:
                    stream.write(note)
        yield CapturedLogContext(log_key)
        if hasattr(manager, "complete_artifact_path"):
            open(manager.complete_artifact_path(log_key), "a").close()

    return capture_logs
