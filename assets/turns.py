"""The turns asset: multi-turn rollouts, one row per turn (stages/turns.py)."""

import dagster as dg

from assets.stage_assets import StageRun
from stages.io.stage_exec import read_columns, run_table_stage


def materialize(run: StageRun) -> dg.MaterializeResult:
    """Multi-turn rollouts: one row per assistant turn and tool observation of every trajectory, with its token
    span, tool name, arguments, observation, latency and error (stages/turns.py)."""
    cfg, it, source = run.cfg, run.iteration, run.inputs["rollouts"]
    policy = cfg.trainer.rollout_version(it)
    out_uri = run.rollout_store.uri("turns")
    done = run_table_stage(  # batch by batch: a rollout's turns depend on its row alone
        run.compute,
        source.uri,
        out_uri,
        "turns",
        run_id=cfg.run_id,
        iteration=it,
        version=source.version,
        lineage=lambda s: run.lineage({"rollouts": source.version}, policy_version=policy, duration_s=s),
        data_min_rows=cfg.ray.data_min_rows,
    )
    out = read_columns(out_uri, cfg.run_id, it, ["role", "error", "rollout_id"], version=done.version)
    tool = out[out["role"] == "tool"]
    return run.result(
        done.version,
        {
            "turns": len(out),
            "tool_calls": len(tool),
            "tool_errors": int(tool["error"].notna().sum()),
            "rollouts_with_tool_calls": int(tool["rollout_id"].nunique()),
        },
    )
