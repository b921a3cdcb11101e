"""One 2-iteration ci_tiny training run shared by the modules that only need *a* trained run.

tests/e2e/test_grpo_iteration.py, test_replay.py, test_rescore.py and tests/pipelines/test_recorded_versions.py
each trained the identical run (configs/ci_tiny.yaml, save_freq 1) in a module fixture: four runs of about a
minute each (three on the slowest CI box). Now the session trains it once (`ci_tiny_pristine` in
tests/conftest.py) and each module works on its own copy (`copy_run`), so what one module writes (a re-score,
a tampered metric, a moved checkpoint) is never seen by another. The copy is relocated as a user's moved output
directory is: the Dagster home through pipelines.runner.dagster_home; Delta tables hold relative paths.

Under pytest-xdist (scripts/test.sh: `-n 2 --dist loadfile`) the modules may land on both workers; the first that
needs the run trains it under a file lock, the other waits and copies it (`shared_pristine`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

RUN = "ci-run"
"""The rlake run id of the shared run."""
CONFIG = "configs/ci_tiny.yaml"


def train_pristine(out: Path) -> dict:
    """Train the shared run into `out` (its own DAGSTER_HOME); returns run_training's summary."""
    from pipelines.runner import run_training

    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    try:
        return run_training(CONFIG, [f"trainer.output_dir={out}"], run_id=RUN, log=lambda s: None)
    finally:
        os.environ.pop("DAGSTER_HOME", None)


def shared_pristine(root: Path) -> tuple[Path, dict]:
    """(root/pristine, its summary): trained by the first caller across processes (a lock file in root), reused
    by every later one."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    out, done = root / "pristine", root / "summary.json"
    with FileLock(str(root / "train.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a half-trained run of a worker that crashed
            done.write_text(json.dumps(train_pristine(out), default=str))
    return out, json.loads(done.read_text())


def copy_run(pristine: Path, dest: Path) -> Path:
    """A private copy of the pristine run at `dest`, with DAGSTER_HOME pointing at the copy's home (the caller
    pops it when done)."""
    from pipelines.runner import dagster_home

    shutil.copytree(pristine, dest, symlinks=True)
    os.environ["DAGSTER_HOME"] = str(dest / "dagster_home")
    dagster_home(str(dest))  # rewrites the copied dagster.yaml's storage paths to the copy's
    return dest
