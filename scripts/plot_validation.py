"""Plot a run's validation curve from the iteration_metrics Delta table.

Greedy pass@1 (`val-core/<ds>/reward/mean@1`) and sampled mean@k (`val-aux/<ds>/reward/mean@k`)
against the policy version, with the training reward (`critic/score/mean`, the policy version
that generated the iteration's rollouts) for reference.

    python scripts/plot_validation.py --tables rlake_output/smollm2/tables --run-id smollm2-gsm8k-long \
        --out docs/validation_curve.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_metrics(tables: Path, run_id: str):
    """iteration_metrics rows of one run (policy_version, metric, value)."""
    from deltalake import DeltaTable

    uri = tables / "iteration_metrics"
    if not (uri / "_delta_log").is_dir():
        raise SystemExit(f"no iteration_metrics table under {tables}; pass --tables <output_dir>/tables")
    df = DeltaTable(str(uri)).to_pandas(columns=["run_id", "iteration", "policy_version", "metric", "value"])
    df = df[df["run_id"] == run_id]
    if df.empty:
        known = sorted(DeltaTable(str(uri)).to_pandas(columns=["run_id"])["run_id"].unique())
        raise SystemExit(f"run '{run_id}' has no rows in {uri}; known run ids: {known}")
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="rlake_output/smollm2/tables")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", default="docs/validation_curve.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = load_metrics(Path(args.tables), args.run_id)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    val = df[df["metric"].str.match(r"val-(core|aux)/.*/reward/mean@\d+$")]
    for metric, g in sorted(val.groupby("metric"), key=lambda kv: kv[0]):
        g = g.sort_values("policy_version")
        label = ("greedy pass@1 " if metric.startswith("val-core") else "sampled mean@" + metric.rsplit("@", 1)[1] + " ")
        ax.plot(g["policy_version"], g["value"], marker="o", label=label + f"({metric.split('/')[1]}/{metric.split('/')[2]})")
        for x, y in zip(g["policy_version"], g["value"]):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    train = df[df["metric"] == "critic/score/mean"].sort_values("iteration")
    if not train.empty:  # iteration i's rollouts come from policy version i
        ax.plot(train["iteration"], train["value"], color="gray", alpha=0.6, linestyle="--",
                label="training reward (critic/score/mean)")
    ax.set_xlabel("policy version (RL iterations done)")
    ax.set_ylabel("reward = accuracy (gsm8k rule)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(args.title or f"validation curve, run {args.run_id}", fontsize=10)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    print(val.pivot_table(index="policy_version", columns="metric", values="value").to_string())


if __name__ == "__main__":
    main()
