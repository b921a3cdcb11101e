"""The `storage` section: where a run's tables, checkpoints and datasets live."""

from __future__ import annotations

import re

from pydantic import model_validator

from configs.sections.base import _refuse_credentials, _Strict


class StorageConfig(_Strict):
    """Where every table, checkpoint and dataset of a run lives (DESIGN.md "Cluster mode": no path crosses a node).

    Local runs keep today's layout under trainer.output_dir; a cluster run points every node at one object store."""

    root: str | None = None
    """`file:///abs/dir` or `s3://bucket/prefix`: tables under <root>/tables, checkpoints under <root>/checkpoints.
    None: file://<trainer.output_dir> (today's layout)."""
    options: dict[str, str] = {}
    """delta-rs / object-store options for root (e.g. AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP); credentials
    are refused here and come from the environment only."""
    cache_dir: str | None = None
    """Node-local cache of checkpoints fetched by id (each node fills its own); None: ~/.cache/rlake/checkpoints."""
    cache_keep_versions: int = 3
    """Versions of each run (and kind) a node's cache keeps: older copies go when a new one arrives (version 0,
    the reference policy, stays); 0 keeps every version."""

    @model_validator(mode="after")
    def _check(self) -> StorageConfig:
        if self.root is not None and not re.match(r"^(file|s3)://.+", self.root):
            raise ValueError(
                f"storage.root={self.root!r} is not a storage URI: rlake hands tables and checkpoints between nodes "
                "by URI, and knows file:// and s3://; use e.g. file:///data/rlake or s3://my-bucket/rlake (null: "
                "file://<trainer.output_dir>)."
            )
        _refuse_credentials("storage.options", self.options)
        return self
