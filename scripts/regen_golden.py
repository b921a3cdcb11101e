"""Rewrite tests/golden/grpo_tiny.json (the trainer's first losses on the tiny model), with an env snapshot.

python scripts/regen_golden.py
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "stages")]


def main() -> None:
    import tempfile

    import torch
    import transformers
    from test_trainer import GOLDEN_KEYS, golden_losses

    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_char_tokenizer()  # same construction as the tiny_checkpoint fixture
        save_policy(
            build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0), tok, tmp
        )
        losses = golden_losses(Path(tmp))
    out = {
        "keys": list(GOLDEN_KEYS),
        "metrics": losses,
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    }
    path = ROOT / "tests" / "golden" / "grpo_tiny.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(path, losses)


if __name__ == "__main__":
    main()
