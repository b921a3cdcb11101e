"""`rlake rescore`: score one past iteration again with another reward, as a Dagster re-materialization.

Re-materializes the `scored_rollouts` partition of (run, iteration) (after its `judgements` when the config
has a judge), and with `advantages=True` its `advantages` partition too, in the run's own Dagster instance
(<output_dir>/dagster_home), with the run's config plus the caller's reward overrides (`reward.score=2`,
`reward.custom_reward_function.path=...`, `reward.judge.*`).
The rollouts are the version the iteration recorded (assets.common.read_recorded), nothing is generated
again, and only that partition gets new table versions; the older versions stay readable by time travel,
so the report ends with the SQL that compares the two. The same as re-materializing the partition from
the Dagster UI.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import dagster as dg
import numpy as np
import pandas as pd

from assets.common import add_partitions, partition_key
from configs.schema import RunConfig
from pipelines.definitions import ASSETS
from pipelines.resources import build_resources
from pipelines.runner import dagster_home, driver_tags, launch_config
from pipelines.sensors import DRIVER_TAG
from stages.dag import uses_judge
from stages.io import uris
from stages.io.store import commit_lineage, read_partition, table_exists


@dataclass(frozen=True)
class RescoreReport:
    """What a re-score changed: table versions before/after, rows whose reward changed, reward functions."""

    run_id: str
    iteration: int
    before_version: int
    after_version: int
    rows: int
    changed: int
    reward_mean_before: float
    reward_mean_after: float
    rewards_before: list[str]
    rewards_after: list[str]
    advantages_version: int | None
    versioned: bool = True
    """Both versions have reward_version (tables written before it have reward_fn only)."""
    tables: str = ""
    """The tables root the rescore wrote to: the printed `rlake sql` names it (--tables), so it runs as pasted."""

    def table(self) -> str:
        """The report as lines for the terminal, ending with the SQL that lists the changed rows."""
        lines = [
            f"run {self.run_id} iteration {self.iteration}: scored_rollouts v{self.before_version} -> "
            f"v{self.after_version} ({self.changed} of {self.rows} rewards changed)",
            f"  reward mean {self.reward_mean_before:.4f} -> {self.reward_mean_after:.4f}",
            f"  scored by   {', '.join(self.rewards_before)} -> {', '.join(self.rewards_after)}",
        ]
        if self.advantages_version is not None:
            lines.append(f"  advantages  -> v{self.advantages_version}")
        lines.append(f"the changed rows: {self.sql()}")
        return "\n".join(lines)

    def sql(self) -> str:
        """`rlake sql` command comparing the partition's rewards at the two versions."""
        which = (
            "b.reward_version AS version_before, s.reward_version AS version_after" if self.versioned else "s.reward_fn"
        )
        where = f"--tables {shlex.quote(self.tables)} " if self.tables else ""
        return (
            f"rlake sql {where}--version old:scored_rollouts={self.before_version} "
            f'"SELECT s.rollout_id, b.reward AS reward_before, s.reward AS reward_after, {which} '
            "FROM scored_rollouts s JOIN old b USING (run_id, iteration, rollout_id) "
            f"WHERE s.run_id = '{self.run_id}' AND s.iteration = {self.iteration} "
            "AND s.reward IS DISTINCT FROM b.reward "
            'ORDER BY s.rollout_id"'
        )


def _reward_names(df: pd.DataFrame) -> list[str]:
    column = "reward_version" if "reward_version" in df.columns else "reward_fn"
    return sorted(str(x) for x in df[column].dropna().unique())


def scored_partition_version(tables: str, run_id: str, iteration: int) -> int:
    """The newest scored_rollouts version written for (run_id, iteration), or a what/why/fix LookupError.
    `tables`: the tables root (a storage URI; a StorageURI carries its options)."""
    uri = uris.join(tables, "scored_rollouts")
    commits = commit_lineage(uri, run_id=run_id, iteration=iteration) if table_exists(uri) else []
    if not commits:
        runs = sorted({c.get("run_id") for c in commit_lineage(uri)}) if table_exists(uri) else []
        raise LookupError(
            f"no scored_rollouts for run '{run_id}' iteration {iteration} under {tables}: rescore re-scores an "
            f"iteration a run already scored (runs there: {runs or 'none'}). Check --run-id and --iteration, and "
            "--config / storage.root=... / trainer.output_dir=... to point at the run's tables."
        )
    return int(commits[0]["version"])


def rescore(cfg: RunConfig, iteration: int, *, advantages: bool = False) -> RescoreReport:
    """Re-materialize scored_rollouts (and advantages) of run cfg.run_id's `iteration` with cfg's reward."""
    tables = uris.with_options(uris.tables_root(cfg), uris.storage_options(cfg))
    before = scored_partition_version(tables, cfg.run_id, iteration)
    old = read_partition(uris.join(tables, "scored_rollouts"), cfg.run_id, iteration, version=before)
    dagster_home(cfg.trainer.output_dir)
    instance = dg.DagsterInstance.get()
    add_partitions(instance, cfg.run_id, iteration)
    selection = [
        *(["judgements"] if uses_judge(cfg) else []),  # a (new) judge judges the recorded rollouts again
        "scored_rollouts",
        *(["advantages"] if advantages else []),
    ]
    dg.materialize(
        ASSETS,
        selection=selection,
        partition_key=partition_key(cfg.run_id, iteration),
        instance=instance,
        resources=build_resources(cfg),
        run_config=launch_config(cfg),
        tags={"rlake/run_id": cfg.run_id, "rlake/rescore": "true", DRIVER_TAG: "cli", **driver_tags()},
    )
    after = scored_partition_version(tables, cfg.run_id, iteration)
    new = read_partition(uris.join(tables, "scored_rollouts"), cfg.run_id, iteration, version=after)
    merged = old[["rollout_id", "reward"]].merge(new[["rollout_id", "reward"]], on="rollout_id", suffixes=("_b", "_a"))
    same = np.isclose(merged["reward_b"], merged["reward_a"], rtol=0, atol=0, equal_nan=True)
    adv = commit_lineage(uris.join(tables, "advantages"), run_id=cfg.run_id, iteration=iteration) if advantages else []
    return RescoreReport(
        run_id=cfg.run_id,
        iteration=iteration,
        before_version=before,
        after_version=after,
        rows=len(new),
        changed=int((~same).sum()),
        reward_mean_before=float(np.nanmean(old["reward"])),
        reward_mean_after=float(np.nanmean(new["reward"])),
        rewards_before=_reward_names(old),
        rewards_after=_reward_names(new),
        advantages_version=int(adv[0]["version"]) if adv else None,
        versioned="reward_version" in old.columns and "reward_version" in new.columns,
        tables=str(uris.normalize(uris.tables_root(cfg))),
    )
