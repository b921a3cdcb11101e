"""Each CPU patch in stages.train.megatron.cpu_patches is needed: with all patches but one, a short
PP=2 run (seed the RNG tracker, build a tied GPTModel stage, one forward-backward through the
1F1B schedule over gloo) fails on CPU with megatron's CUDA assumption; with all of them it runs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from stages.io.ports import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("megatron.core")

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply on CPU only"),
]


def _probe(rank: int, world: int, port: int, exclude: tuple[str, ...], out: str) -> None:
    import torch.distributed as dist

    from stages.train.megatron.cpu_patches import apply_cpu_patches

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    apply_cpu_patches(exclude=exclude)
    step, error = "start", None
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from configs.schema import TinyModelConfig
        from stages.models.tiny import build_tiny_model
        from stages.train.megatron.model import build_gpt_model, hf_arch
        from stages.train.megatron.ppo import megatron_attention_mask, run_schedule

        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
        step = "seed"
        model_parallel_cuda_manual_seed(0)
        step = "build"
        arch = hf_arch(build_tiny_model(TinyModelConfig(tie_word_embeddings=True), 84).config)
        model = build_gpt_model(arch, 1, world)
        step = "schedule"
        attn = torch.ones(2, 6, dtype=torch.long)
        batch = {
            "input_ids": torch.randint(0, 84, (2, 6)),
            "position_ids": torch.arange(6).expand(2, 6),
            "mask4d": megatron_attention_mask(attn),
            "responses": torch.randint(0, 84, (2, 3)),
            "response_mask": torch.ones(2, 3),
            "prompt_len": 3,
        }
        run_schedule(
            model,
            batch,
            [torch.tensor([0]), torch.tensor([1])],
            lambda mb, logits: (logits.float().mean(), {}),
            vocab_size=84,
            forward_only=False,
        )
        step = "done"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"step": step, "error": error}, f)
        dist.destroy_process_group()


def run_probe(tmp_path, exclude: tuple[str, ...]) -> list[dict]:
    import torch.multiprocessing as mp

    port = free_port()
    out = str(tmp_path / "probe")
    mp.spawn(_probe, args=(2, port, exclude, out), nprocs=2, join=True)
    return [json.loads(open(f"{out}.{r}").read()) for r in range(2)]


def test_all_patches_run(tmp_path) -> None:
    assert [r["step"] for r in run_probe(tmp_path, ())] == ["done", "done"], run_probe


# patch -> the step that fails without it (on at least one rank) and why
NEEDED = {
    "patch_rng_tracker": "seed",  # CudaRNGStatesTracker.add: torch.cuda.get_rng_state()
    "patch_tensor_cuda": "build",  # tied embeddings, PP > 1: last stage's weight.data.cuda()
    "patch_current_device": "schedule",  # p2p receive buffers on torch.cuda.current_device()
    "patch_schedule_tensors": "schedule",  # schedules.py: torch.zeros(..., device="cuda")
}


@pytest.mark.parametrize("patch", sorted(NEEDED))
def test_patch_is_needed(tmp_path, patch: str) -> None:
    results = run_probe(tmp_path, (patch,))
    failed = [r for r in results if r["error"]]
    assert failed, f"{patch} left out, yet the run succeeded: the patch is no longer needed"
    assert {r["step"] for r in failed} == {NEEDED[patch]}, results
    assert all("CUDA" in r["error"] for r in failed), results
