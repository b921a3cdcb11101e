"""Every random seed of a run, derived in one place from the config's seeds.

A seed is a pure function of (configured seed, iteration, ...), never of wall time or of how many
times something ran, so re-running or replaying an iteration reproduces it, and a resumed run draws
what an uninterrupted one would. `recorded` is what trainer_state.json stores for resume's check.

Config seeds: `seed` (run: model init, warm start, prompt order, updates), `rollout.seed` (sampling),
`data.synthetic.seed` (the generated task).
"""

from __future__ import annotations

from typing import Any


def epoch_shuffle(seed: int, epoch: int) -> int:
    """Order of the training prompts in `epoch` (data.shuffle): one permutation per epoch."""
    return seed * 100_003 + epoch


def extra_prompt_rounds(seed: int, iteration: int) -> int:
    """DAPO dynamic sampling: the stream of extra prompt rounds (1..) of `iteration`."""
    return seed * 1_000_003 + iteration


def rollout(rollout_seed: int, iteration: int, gen_round: int = 0) -> int:
    """Sampling of `iteration`'s rollouts, generation round `gen_round` (ReMax's greedy pass: round 0)."""
    return rollout_seed + iteration + 100_003 * gen_round


def validation(rollout_seed: int) -> int:
    """Sampled validation rollouts (the same for every policy version, so versions compare)."""
    return rollout_seed + 7919


def engine_shard(sampling_seed: int, first_prompt_id: int) -> int:
    """One rollout worker's shard of a batch: the same prompts get the same seed whatever the sharding."""
    return sampling_seed * 1_000_003 + first_prompt_id


def judge(rollout_seed: int, iteration: int) -> int:
    """Sampling of `iteration`'s judge verdicts (reward.judge with temperature > 0)."""
    return rollout_seed + iteration + 31_337


def update(seed: int, iteration: int) -> int:
    """`iteration`'s policy and critic updates: mini-batch order (and Megatron's model-parallel RNG)."""
    return seed * 7 + iteration


def update_rank(update_seed: int, rank: int) -> int:
    """torch's global RNG on trainer rank `rank` during an update (dropout, if any)."""
    return update_seed * 1000 + rank


def fewshot(synthetic_seed: int) -> int:
    """The worked examples in front of every word-problem prompt (disjoint from the problems' stream)."""
    return synthetic_seed + 10_007


def recorded(cfg: Any, iteration: int) -> dict[str, int]:
    """The seeds iteration `iteration` uses (trainer_state.json; resume compares them)."""
    return {
        "seed": cfg.seed,
        "rollout_seed": rollout(cfg.rollout.seed, iteration),
        "update_seed": update(cfg.seed, iteration),
        "shuffle_seed": cfg.seed,
    }
