"""The turns stage: one row per turn of each multi-turn rollout (rollout.multi_turn), so SQL sees every
assistant turn, tool call and observation of a trajectory: role, its token span in response_token_ids, text,
the tool's name, arguments, observation, latency and error. The rows come from the rollouts' `turns` column
(stages/tools/agent_loop.py), in rollout and turn order. The asset streams the rollouts partition through
turns_table on the stage executor (stages/io/stage_exec.py run_table_stage: a rollout's turns depend on its row
alone): the Dagster step never holds the whole partition."""

from __future__ import annotations

import pandas as pd

from stages.io.tables import SCHEMAS

TURN_COLUMNS = [f.name for f in SCHEMAS["turns"] if f.name not in ("run_id", "iteration")]


def turns_table(rollouts: pd.DataFrame) -> pd.DataFrame:
    """The turns of every rollout that has them (rollouts: rollout_id, policy_version, prompt_id, response_token_ids,
    turns). A rollout whose spans do not concatenate to its response_token_ids is an error: the table would
    misattribute tokens."""
    rows = []
    for r in rollouts.itertuples(index=False):
        turns = r.turns
        if turns is None or len(turns) == 0:
            continue
        end = 0
        for t in turns:
            t = dict(t)
            if t["token_start"] != end:
                raise ValueError(
                    f"rollout {r.rollout_id}: turn {t['turn_index']} starts at token {t['token_start']}, not at "
                    f"{end} where the turn before ended; its turns do not tile response_token_ids. Re-materialize "
                    "the rollouts of this iteration"
                )
            end = t["token_end"]
            rows.append({"rollout_id": r.rollout_id, "policy_version": r.policy_version, "prompt_id": r.prompt_id, **t})
        if end != len(r.response_token_ids):
            raise ValueError(
                f"rollout {r.rollout_id}: its turns cover {end} tokens of its {len(r.response_token_ids)}; "
                "re-materialize the rollouts of this iteration"
            )
    return pd.DataFrame(rows, columns=TURN_COLUMNS)
