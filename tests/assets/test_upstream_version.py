"""assets/common.py upstream_version: the version read_recorded would read, without reading a row; a table
written outside Dagster is read at its newest version (with a warning), and a missing table or partition raises
read_recorded's errors. Real Delta tables under tmp_path, an ephemeral Dagster instance."""

from __future__ import annotations

import dagster as dg
import pandas as pd
import pytest

from assets.common import read_recorded, upstream_partition, upstream_version
from assets.resources import RolloutStoreResource
from stages.io import store

RUN = "uv"


def test_upstream_version_falls_back_to_the_newest_version_without_reading_rows(tmp_path) -> None:
    rollout_store = RolloutStoreResource(root=str(tmp_path))
    context = dg.build_asset_context(instance=dg.DagsterInstance.ephemeral())
    with pytest.raises(FileNotFoundError, match="materialize its asset first"):
        upstream_version(context, rollout_store, "iteration_metrics", RUN, 0)
    rows = pd.DataFrame({"policy_version": 1, "metric": ["a"], "value": [1.0]})
    for it in (0, 1):
        store.write_partition(
            rollout_store.uri("iteration_metrics"), "iteration_metrics", rows, run_id=RUN, iteration=it, lineage={}
        )
    version = upstream_version(context, rollout_store, "iteration_metrics", RUN, 0)
    assert (version, version.source) == (1, "newest")
    assert read_recorded(context, rollout_store, "iteration_metrics", RUN, 0)[1] == version  # what it would read
    partition = upstream_partition(context, rollout_store, "iteration_metrics", RUN, 1)
    assert (partition.version, partition.iteration, next(partition.batches())["metric"].tolist()) == (1, 1, ["a"])
    with pytest.raises(LookupError) as missing:
        upstream_version(context, rollout_store, "iteration_metrics", RUN, 2)
    with pytest.raises(LookupError) as read:
        read_recorded(context, rollout_store, "iteration_metrics", RUN, 2)
    assert str(missing.value) == str(read.value)  # the same error as the read it stands for
