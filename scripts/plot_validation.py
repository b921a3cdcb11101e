"""Plot a run's validation curve from the iteration_metrics Delta table (stages.io.plots.validation_figure).

Greedy pass@1 (`val-core/<ds>/reward/mean@1`) and sampled mean@k (`val-aux/<ds>/reward/mean@k`)
against the policy version, with the training reward (`critic/score/mean`, the policy version
that generated the iteration's rollouts) for reference. The same figure is logged to the MLflow run
as `validation_curve.png` when the run finishes; `rlake plot RUN` draws all training curves.

    python scripts/plot_validation.py --tables rlake_output/smollm2/tables --run-id smollm2-gsm8k-long \
        --out docs/validation_curve.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from stages.io.plots import load_run_metrics, save_png, validation_figure, validation_rewards

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="rlake_output/smollm2/tables")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", default="docs/validation_curve.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    try:
        df = load_run_metrics(Path(args.tables), args.run_id)
    except (FileNotFoundError, LookupError) as exc:
        raise SystemExit(f"plot_validation: error: {exc}") from None
    print(f"wrote {save_png(validation_figure(df, args.title or f'validation curve, run {args.run_id}'), args.out)}")
    print(validation_rewards(df).to_string())


if __name__ == "__main__":
    main()
