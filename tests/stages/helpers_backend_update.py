"""One PPO update through a backend's real `ActorWorker.update(request)`, shared by the backend-vs-torch tests
(tests/stages/test_megatron_backend.py, test_fsdp_backend.py): the tiny policy and advantages table they
update from, the UpdateRequest, the gloo ranks spawned on 127.0.0.1, and the outputs read back."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stages.io.ports import free_port

N_PROMPTS, N_PER_PROMPT = 2, 4


def _entry(rank: int, world: int, port: int, req) -> None:
    """One rank of an update in a spawned process: the ActorWorker of req.actor.strategy, in-process."""
    import torch.distributed as dist

    from stages.workers.actor_worker import ActorWorker

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ActorWorker(rank, world, 1, strategy=req.actor.strategy).update(req)
    finally:
        dist.destroy_process_group()


def spawn_update(req, world: int) -> str:
    """The update `req` on `world` spawned gloo ranks; returns its out_dir."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), req), nprocs=world, join=True)
    return req.out_dir


def policy_and_advantages(root: Path, *, tie_word_embeddings: bool = False) -> dict:
    """A tiny Qwen2 (4 layers, 4 heads, 2 KV heads) saved as policy v0 under `root`, and an advantages Delta
    table of N_PROMPTS x N_PER_PROMPT random rollouts (outcome advantage on every token), seeded."""
    import pandas as pd

    from configs.schema import TinyModelConfig
    from stages.io.store import write_partition
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    tiny = TinyModelConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=tie_word_embeddings,
    )
    save_policy(build_tiny_model(tiny, len(tok), seed=3), tok, root / "policy")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(N_PROMPTS * N_PER_PROMPT):
        p_len = int(torch.randint(3, 8, (1,), generator=gen))
        r_len = int(torch.randint(1, 7, (1,), generator=gen))
        rows.append(
            row := {
                "rollout_id": i,
                "group_id": i // N_PER_PROMPT,
                "policy_version": 0,
                "prompt_token_ids": torch.randint(5, len(tok), (p_len,), generator=gen).tolist(),
                "response_token_ids": torch.randint(1, len(tok), (r_len,), generator=gen).tolist(),
                "reward": 0.0,
                "advantage": float(torch.randn((), generator=gen)),
                "adv_estimator": "grpo",
            }
        )
        row["token_advantages"] = [row["advantage"]] * r_len  # outcome advantage on every token
    uri = str(root / "advantages")
    version = write_partition(uri, "advantages", pd.DataFrame(rows), run_id="r", iteration=0, lineage={})
    return {"root": root, "advantages_uri": uri, "advantages_version": version}


def update_request(ctx: dict, out: str, actor: dict, policy_dir: Path | None = None):
    """The UpdateRequest of iteration 0 of run "r" from ctx's table and policy (or `policy_dir`) into
    ctx["root"] / out, with `actor` as the actor config."""
    from configs.schema import ActorConfig
    from stages.workers.requests import UpdateRequest

    return UpdateRequest(
        advantages_uri=ctx["advantages_uri"],
        advantages_version=ctx["advantages_version"],
        run_id="r",
        iteration=0,
        n_per_prompt=N_PER_PROMPT,
        seed=0,
        policy_dir=str(policy_dir or ctx["root"] / "policy"),
        out_dir=str(ctx["root"] / out),
        threads_per_worker=1,
        actor=ActorConfig.model_validate(actor),
    )


def load_out(out_dir: str) -> tuple[dict, dict, dict]:
    """(HF weights, optimizer.pt, update_metrics.json) of an update's checkpoint."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(out_dir) / "model.safetensors"))
    opt = torch.load(Path(out_dir) / "optimizer.pt", weights_only=False)
    metrics = json.loads((Path(out_dir) / "update_metrics.json").read_text())
    return weights, opt, metrics
