"""The one Delta IO manager of the stage assets: an asset's inputs are the tables of its upstream stages, each
loaded as a partition handle (stages.io.stage_exec.Partition), never as rows.

A handle is the upstream partition of this asset's partition (an iteration asset reads a set-up table, such as
`prompts`, through the run dimension) at the Delta version its asset's latest materialization recorded
(assets/common.py upstream_partition: a table written outside Dagster is read at its newest version, with a
warning; a missing table or partition is an error that names the asset to materialize). A stage the run's config
does not have (stages/dag.py `when`: values without GAE, judgements without a judge) loads as None.

Outputs: a stage writes its own partition (from its workers, one Delta commit with its lineage) and its asset
returns a MaterializeResult, so there is no output to store; any other value is a bug and raises.
"""

from __future__ import annotations

import dagster as dg

from assets.common import upstream_partition
from stages.dag import STAGES
from stages.io.stage_exec import Partition
from stages.io.tables import PROMPTS_ITERATION

KEY = "delta_io"
"""The resource key of the IO manager (the stage assets' input_manager_key)."""


def partition_of(key: str | dg.MultiPartitionKey) -> tuple[str, int]:
    """(run id, iteration) of an upstream partition key: a run x iteration key, or a run id (a set-up table's
    partition, iteration PROMPTS_ITERATION)."""
    if isinstance(key, dg.MultiPartitionKey):
        dims = key.keys_by_dimension
        return dims["run"], int(dims["iteration"])
    return str(key), PROMPTS_ITERATION


class DeltaIOManager(dg.IOManager):
    def handle_output(self, context: dg.OutputContext, obj: object) -> None:
        if obj is not None:
            raise TypeError(
                f"asset {context.asset_key.to_user_string()} returned a {type(obj).__name__}: a stage asset writes "
                "its Delta partition itself and returns a MaterializeResult (assets/stage_assets.py)"
            )

    def load_input(self, context: dg.InputContext) -> Partition | None:
        table = context.asset_key.to_user_string()
        if not STAGES[table].when(context.resources.run_config.load()):
            return None
        run_id, iteration = partition_of(context.asset_partition_key)
        return upstream_partition(context, context.resources.rollout_store, table, run_id, iteration)


@dg.io_manager(required_resource_keys={"run_config", "rollout_store"})
def delta_io_manager(_init_context) -> DeltaIOManager:
    """Loads a stage's inputs: its upstream tables' partitions at their recorded versions, as handles."""
    return DeltaIOManager()
