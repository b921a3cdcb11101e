"""The driver's heap during a run's iterations (issue #37 item 4)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The iterations with what is alive before them (Dagster, Ray, torch, MLflow modules, the definitions, the
    instance) gc.freeze'd: a full collection skips it, where walking it took ~0.55 s of CPU in whichever step it
    fell (#37 item 4). Collected first, so no garbage is frozen; unfrozen after (a test runs many runs)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
