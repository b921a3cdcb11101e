"""CriticWorker: the value model of PPO with GAE (verl: `compute_values`, `update_critic`).

The values stage (stages/values.py) and the critic_checkpoint stage (stages/critic_checkpoint.py) call it
through the run's one-worker "critic" group on one torch thread (measured fastest for the critic on the
2-core box, see stages.train.critic). Each call loads the critic version it is given from disk, so the
result is a function of the checkpoint alone. A reward-model worker (a scoring model rather than a rule)
would follow the same pattern: a Worker subclass loading its model once, one method per batch, its own
group and stage module.
"""

from __future__ import annotations

import pandas as pd

from stages.io.advantage_rows import read_advantage_rows
from stages.io.store import read_partition
from stages.train.critic import run_critic_update, update_rows, values_frame
from stages.workers.group import Worker
from stages.workers.requests import CriticUpdateRequest


class CriticWorker(Worker):
    def compute_values(
        self, rollouts: pd.DataFrame, critic_dir: str, critic_version: int, micro_batch_size: int
    ) -> pd.DataFrame:
        """Rows of the `values` table for these rollouts: rollout_id, critic_version, values (one float per
        response token) under the critic at critic_dir."""
        return values_frame(
            rollouts,
            critic_dir,
            critic_version=critic_version,
            micro_batch_size=micro_batch_size,
            threads=self.threads,
            device=self.device,
        )

    def update_critic(self, req: CriticUpdateRequest) -> dict[str, float]:
        """Train critic version req.iteration towards the advantages table's GAE returns (clipped against the
        rollout-time values) and write version iteration + 1 to req.out_dir; returns the update metrics. The
        rank reads both partitions at the request's versions itself (critic_rows): no row passes the driver."""
        return run_critic_update(
            req.critic_dir,
            req.out_dir,
            critic_rows(req),
            req.critic,
            n_per_prompt=req.n_per_prompt,
            seed=req.seed,
            threads=self.threads,
            device=self.device,
        )


ADVANTAGE_COLUMNS = ["rollout_id", "prompt_token_ids", "response_token_ids", "returns", "response_mask"]
"""What the critic update reads of the advantages rows (response_mask: when the rollouts have it)."""


def critic_rows(req: CriticUpdateRequest) -> dict:
    """The critic-update rows (stages.train.critic.update_rows) of req's advantages and values partitions, read at
    their recorded versions, only the columns the update uses."""
    uri, version, part = req.advantages_uri, req.advantages_version, (req.run_id, req.iteration)
    advantages = read_advantage_rows(uri, *part, version, ADVANTAGE_COLUMNS)  # tokens and mask joined from rollouts
    values = read_partition(req.values_uri, *part, version=req.values_version, columns=["rollout_id", "values"])
    return update_rows(advantages, values)
