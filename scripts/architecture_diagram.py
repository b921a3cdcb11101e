"""Draw docs/architecture.png: the layers (left) and one RL iteration's data flow (right): for each stage, the
worker it calls and where its rows are read, computed and written (the ranks, Ray Data, or the Dagster step).

    python scripts/architecture_diagram.py [--out docs/architecture.png]

The boxes are the data below (LAYERS, FLOW); keep them in step with docs/architecture.md and the tree
(tests/test_layers.py holds the import rules the left panel draws).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROOT = Path(__file__).resolve().parents[1]

# (package, what it holds), top = highest layer; every layer imports only the ones below it
LAYERS = [
    ("pipelines/", "Definitions, jobs, sensor, runner (rlake train), CLI"),
    ("assets/", "assets generated from stages/dag.py; inputs: Delta IO manager"),
    ("stages/run/", "resume, preflight, replay, compare, export"),
    ("stages/*.py", "one stage module per asset, same name + dag.py"),
    ("stages/workers/", "WorkerGroup; Rollout/Actor/Ref/CriticWorker; requests"),
    ("stages/train/", "ppo_loop (one micro-batch loop), optim, actor, critic, megatron/"),
    ("stages/{data,models,io}/", "datasets, rewards | engines, policy I/O | Delta, checkpoints"),
    ("stages/algos/", "pure torch/numpy: advantages, GAE, KL, losses"),
    ("configs/", "RunConfig (frozen pydantic) + YAML overlays"),
]

DELTA, CKPT, STAGE, WORKER, LOCAL = "#cfe2f3", "#fce5cd", "#ffffff", "#d9ead3", "#f3f3f3"
# one row per stage module in run order: (module, asset, reads, worker method or None, where its rows are read,
# computed and written, writes, kind)
FLOW = [
    ("prompts.py", "prompts", "verl parquet / generated task", None, "in the step", "prompts", DELTA),
    ("initial_policy.py", "initial_policy", "model.path or the tiny model", None, "in the step", "policy_v0", CKPT),
    ("prompt_batches.py", "prompt_batches", "prompts", None, "in the step (prompt ids)", "prompt_batches", DELTA),
    (
        "rollouts.py",
        "rollouts",
        "prompt_batches, policy_vN",
        "RolloutWorker.generate",
        "prompts sent; each rank numbers, writes its file",
        "rollouts",
        DELTA,
    ),
    (
        "ref_logprobs.py",
        "ref_logprobs (KL)",
        "rollouts, policy_v0",
        "RefWorker.compute_ref_log_prob",
        "each rank reads its slice, writes its file",
        "ref_logprobs",
        DELTA,
    ),
    (
        "old_logprobs.py",
        "old_logprobs",
        "rollouts, policy_vN",
        "ActorWorker.compute_log_prob",
        "each rank reads its slice, writes its file",
        "old_logprobs",
        DELTA,
    ),
    (
        "scored_rollouts.py",
        "scored_rollouts",
        "rollouts",
        None,
        "stage executor: batches, or Ray Data\nread -> map_batches -> write on workers",
        "scored_rollouts",
        DELTA,
    ),
    (
        "values.py",
        "values (gae)",
        "rollouts, critic_vN",
        "CriticWorker.compute_values",
        "the rank reads the rows, writes its file",
        "values",
        DELTA,
    ),
    (
        "advantages.py",
        "advantages",
        "scored + rollouts, old_logprobs (+ ref, values)",
        None,
        "streamed in the step: batches merge-joined\n(stages/algos), computed columns only",
        "advantages",
        DELTA,
    ),
    (
        "policy_checkpoint.py",
        "policy_checkpoint",
        "advantages, policy_vN",
        "ActorWorker.update(UpdateRequest)",
        "each rank reads its shard + joins tokens,\nlog-probs (WorkerGroup or Ray Train)",
        "policy_vN+1",
        CKPT,
    ),
    (
        "critic_checkpoint.py",
        "critic_checkpoint (gae)",
        "advantages, critic_vN",
        "CriticWorker.update_critic",
        "the rank reads advantages and values",
        "critic_vN+1",
        CKPT,
    ),
    (
        "iteration_metrics.py, evaluate.py",
        "iteration_metrics",
        "the tables above, policy_vN+1",
        "RolloutWorker.generate (validation)",
        "metric columns streamed in the step",
        "iteration_metrics + MLflow",
        DELTA,
    ),
]
SETUP_ROWS = 2  # prompts and initial_policy run once (rlake_setup_job); the rest once per iteration


def box(
    ax,
    x: float,
    y: float,
    w: float,
    h: float,
    lines: list[str],
    color: str,
    *,
    size: float = 10,
    style: str = "round,pad=0.006,rounding_size=0.012",
) -> None:
    """A filled box; the first line of text bold, the others smaller below it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, fc=color, ec="#444444", lw=1.0, zorder=1))
    if len(lines) == 1:
        ax.text(x + w / 2, y + h / 2, lines[0], ha="center", va="center", fontsize=size, zorder=3)
        return
    ax.text(x + w / 2, y + h * 0.68, lines[0], ha="center", va="center", fontsize=size, weight="bold", zorder=3)
    ax.text(x + w / 2, y + h * 0.30, "\n".join(lines[1:]), ha="center", va="center", fontsize=size - 1.5, zorder=3)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], *, dashed: bool = False) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            color="#444444",
            lw=1.2,
            linestyle="--" if dashed else "-",
            shrinkA=0,
            shrinkB=0,
            zorder=2,
        )
    )


def draw_layers(ax) -> None:
    """Left panel: the layer stack, highest on top, arrows pointing at what a layer may import."""
    ax.set_title("Layers: a package imports only those below it (tests/test_layers.py)", fontsize=14, weight="bold")
    n, h, gap = len(LAYERS), 0.075, 0.032
    for i, (pkg, what) in enumerate(LAYERS):
        y = 0.955 - (i + 1) * (h + gap) + gap
        box(ax, 0.02, y, 0.78, h, [pkg, what], "#eeeeee" if i % 2 else "#f8f8f8", size=12)
        if i < n - 1:
            arrow(ax, (0.41, y - 0.003), (0.41, y - gap + 0.004))
    box(
        ax,
        0.84,
        0.02,
        0.14,
        0.93,
        ["stages/\nseeds.py:\n\nevery seed\nformula;\na leaf that\nany layer\nmay import"],
        "#fff2cc",
        size=12,
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")


def draw_row(ax, y: float, h: float, row: tuple) -> None:
    """One stage: its module box, the worker it calls (or "in the step") and where its rows go, what it writes."""
    module, asset, reads, worker, where, out, kind = row
    box(ax, 0.0, y, 0.36, h, [f"stages/{module}", f"asset {asset}; reads {reads}"], STAGE, size=10.5)
    mid = y + h / 2
    lines = [worker, where] if worker else where.split(": ", 1) if ": " in where else [where]
    box(ax, 0.41, y + 0.004, 0.32, h - 0.008, lines, WORKER if worker else LOCAL, size=10.5)
    arrow(ax, (0.36 + 0.006, mid), (0.41 - 0.006, mid))
    arrow(ax, (0.73 + 0.006, mid), (0.78 - 0.006, mid))
    style = "round,pad=0.006,rounding_size=0.03" if kind == DELTA else "square,pad=0.006"
    box(ax, 0.78, y + 0.008, 0.22, h - 0.016, [out], kind, size=11, style=style)


def draw_flow(ax) -> None:
    """Right panel: set-up, then one iteration top to bottom: stage module -> worker -> what it writes."""
    ax.set_title(
        "One iteration: stage -> who reads, computes and writes its rows -> Delta table / checkpoint",
        fontsize=14,
        weight="bold",
    )
    ax.text(
        0.5,
        0.978,
        "the step (Dagster, the driver) holds table versions and file lists, never a whole table's rows, "
        "and makes ONE Delta commit per table",
        ha="center",
        fontsize=10.5,
        color="#333333",
    )
    step = 0.83 / (len(FLOW) - 1)  # the last row ends above the legend
    h = 0.75 * step
    for i, row in enumerate(FLOW):
        y = 0.90 - i * step - (0.02 if i >= SETUP_ROWS else 0)
        draw_row(ax, y, h, row)
        if i == SETUP_ROWS:
            ax.plot([0, 1], [y + h + 0.017] * 2, ls=":", color="#888888", lw=1)
            ax.text(
                1.0,
                y + h + 0.022,
                "set-up above (once), one iteration N below (a partition)",
                ha="right",
                va="bottom",
                fontsize=10,
                color="#555555",
            )
    legend = [
        ("stage module (one per asset)", STAGE),
        ("Ray worker (bound method)", WORKER),
        ("no worker", LOCAL),
        ("Delta table", DELTA),
        ("checkpoint dir", CKPT),
    ]
    for j, (label, color) in enumerate(legend):
        box(ax, j * 0.2 + 0.005, 0.0, 0.185, 0.035, [label], color, size=9.5)
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(-0.01, 1)
    ax.axis("off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "architecture.png"))
    args = parser.parse_args()
    plt.switch_backend("Agg")  # headless: a file, no window
    fig, (left, right) = plt.subplots(1, 2, figsize=(22, 12), gridspec_kw={"width_ratios": [1, 1.45]})
    draw_layers(left)
    draw_flow(right)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90, facecolor="white")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
