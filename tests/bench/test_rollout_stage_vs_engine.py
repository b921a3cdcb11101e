"""The CPU-checkable parts of bench/rollout_stage_vs_engine.py: the bare HF baseline samples exactly what the
stage's engine samples (same tokens from the same seed, so the two tokens/s compare like with like), and the
summary's ratio and table."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from configs.schema import load_config
from stages.models.engines import SamplingSpec
from stages.models.engines.hf_engine import HFEngine
from stages.models.policy import encode_chat, load_policy, save_policy

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rollout_stage_vs_engine", ROOT / "bench" / "rollout_stage_vs_engine.py")
bench = sys.modules.setdefault("rollout_stage_vs_engine", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def pad_is_eos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """tiny_checkpoint with pad == eos, as SmolLM2's (the engine then suppresses no token)."""
    model, tok = load_policy(tiny_checkpoint)
    tok.pad_token = tok.eos_token
    return save_policy(model, tok, tmp_path_factory.mktemp("bench_pad_eos") / "policy")


def test_bare_hf_generates_the_tokens_the_stage_engine_does(pad_is_eos_checkpoint) -> None:
    # rollout.n=8, 3 prompts: micro-batches of 16 and 8 sequences
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", ["rollout.micro_batch_size=16"])
    eng = HFEngine(pad_is_eos_checkpoint, micro_batch_size=cfg.rollout.micro_batch_size)
    prompts = [list(encode_chat(eng.tokenizer, [{"role": "user", "content": q}])[0]) for q in ["1+2=", "13+4=", "7+"]]
    spec = SamplingSpec(temperature=cfg.rollout.temperature, max_tokens=10, n=cfg.rollout.n, seed=5)
    want = sum(len(g.token_ids) for gens in eng.generate(prompts, spec) for g in gens)
    bare = bench.BareHF(pad_is_eos_checkpoint, cfg)
    assert bare.generate(prompts, 5, 10) == want
    assert bare.generate(prompts, 6, 10) != want or bare.generate(prompts, 7, 10) != want  # the seed matters


def test_summary_ratio_and_table() -> None:
    args = argparse.Namespace(worker="hf", prompts=4, n=8, max_tokens=48, temperature=0.7, threads=2, repeats=2)
    rows = [
        {"what": "bare", "repeat": 0, "tokens": 100, "s": 10.0},
        {"what": "stage", "repeat": 0, "tokens": 100, "s": 12.5, "worker_generate_s": 12.0, "sync_s": 0.1},
        {"what": "stage", "repeat": 1, "tokens": 120, "s": 12.0, "worker_generate_s": 11.5, "sync_s": 0.0},
        {"what": "bare", "repeat": 1, "tokens": 120, "s": 10.0},
    ]
    res = bench.summarize(args, rows, 1.0, 2.0)
    assert res["bare_tokens_per_s"] == pytest.approx(11.0) and res["stage_tokens_per_s"] == pytest.approx(9.0)
    assert res["ratio"] == pytest.approx(9.0 / 11.0)
    text = bench.table([res], args)
    assert "| hf | 11.0 | 9.0 | 0.82 |" in text and "4 prompts x 8 samples" in text
