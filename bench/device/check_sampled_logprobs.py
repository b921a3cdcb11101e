"""Does the HF engine's `sampled_logprobs` equal transformers' `compute_transition_scores` on CUDA too?

    python bench/device/check_sampled_logprobs.py            # on a machine with a GPU (falls back to CPU)

On CPU, tests/stages/test_hf_engine.py checks the two bit for bit. This script runs a randomly initialised tiny
Llama (built in-process, nothing downloaded) through `generate(output_scores=True)` with sampling on the
device, in float32 and bfloat16, and prints, per dtype, the largest absolute difference between the two and
whether they are equal bit for bit; exit status 0 when every difference is within TOLERANCE. It needs torch and transformers only: the function is read from
stages/models/engines/hf_engine.py's source, so a bare CUDA image without rlake's other dependencies runs it.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
"""Exit status 0 when every dtype is within this absolute difference (bit equality is reported, not required:
on an H200 the two differ by at most 9.5e-7, one float32 ulp at these magnitudes)."""


def load_sampled_logprobs():
    """`sampled_logprobs` and LOGPROB_BLOCK from the engine module's source, without importing the module."""
    source = (ROOT / "stages" / "models" / "engines" / "hf_engine.py").read_text()
    tree = ast.parse(source)
    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name == "sampled_logprobs")
        or (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LOGPROB_BLOCK" for t in node.targets))
    ]
    space: dict = {"torch": torch}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "hf_engine_subset", "exec"), space)
    return space["sampled_logprobs"]


def main() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    sampled_logprobs = load_sampled_logprobs()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            eos_token_id=1,
        )
        model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        prompts = torch.randint(2, 4096, (16, 12), device=device)
        with torch.no_grad():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=0.7,
                top_k=0,
                max_new_tokens=40,
                output_scores=True,
                return_dict_in_generate=True,
                min_new_tokens=40,
            )
        tokens = out.sequences[:, prompts.shape[1] :]
        ref = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        ours = sampled_logprobs(out.scores, tokens)
        finite = torch.isfinite(ref)
        results[str(dtype)] = {
            "shape": list(ours.shape),
            "bit_equal": bool(torch.equal(ref, ours)),
            "max_abs_diff": float((ref[finite] - ours[finite]).abs().max()) if finite.any() else 0.0,
            "same_non_finite": bool(torch.equal(~finite, ~torch.isfinite(ours))),
        }
    print(json.dumps(results, indent=1))
    checked = [v for v in results.values() if isinstance(v, dict)]
    return 0 if all(v["max_abs_diff"] <= TOLERANCE and v["same_non_finite"] for v in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
