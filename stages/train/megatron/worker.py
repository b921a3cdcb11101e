"""Megatron-Core policy-update worker: the `actor.strategy='megatron'` twin of
`stages.update.train_loop_per_worker`, taking the same `job` dict and writing the same outputs.

Each worker of the persistent gloo group (or a torch.multiprocessing process) is one rank of a TP x PP x DP grid
(megatron's rank order: TP fastest, then DP, then PP). Every rank loads the HF checkpoint,
keeps its shard (`convert.hf_to_megatron`), reads its DP rank's rows, runs
`ppo.megatron_ppo_update`, and rank 0 gathers the model-parallel shards of DP replica 0 back into
an HF checkpoint written atomically at job["out_dir"], with the optimizer state in the torch
backend's format (HF parameter order), so the next iteration may use either backend.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from stages.train.megatron.convert import hf_to_megatron, megatron_to_hf
from stages.train.megatron.cpu_patches import apply_cpu_patches
from stages.train.megatron.model import HFArch, build_gpt_model, hf_arch
from stages import seeds

MOMENTS = ("exp_avg", "exp_avg_sq")


def _ensure_process_group() -> bool:
    """A one-process gloo group when none exists (megatron's parallel_state needs one)."""
    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def _ranks() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def gather_to_rank0(local: dict[str, Tensor]) -> dict[tuple[int, int], dict[str, Tensor]] | None:
    """Every (tp_rank, pp_rank) shard of DP replica 0 on global rank 0; None elsewhere."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return None
    group = ps.get_model_parallel_group()
    out: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object((_ranks(), local), out, dst=0, group=group)
    return dict(out) if out is not None else None


def export_optimizer_state(opt: torch.optim.Optimizer, model, arch: HFArch, hf_names: list[str], *,
                           tp: int, pp: int) -> dict | None:
    """The optimizer state_dict in HF parameter order on rank 0 (torch backend format)."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    state = {n: opt.state[p] for n, p in zip(names, params) if p in opt.state}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(hf_names)))}
              for g in opt.state_dict()["param_groups"]]
    gathered = {m: gather_to_rank0({n: s[m] for n, s in state.items()}) for m in MOMENTS} if state else {}
    if dist.get_rank() != 0:
        return None
    if not state:
        return {"state": {}, "param_groups": groups}
    hf_moments = {m: megatron_to_hf(gathered[m], arch, tp=tp, pp=pp) for m in MOMENTS}
    step = next(iter(state.values()))["step"]
    return {"state": {i: {"step": step.clone(), **{m: hf_moments[m][n] for m in MOMENTS}}
                      for i, n in enumerate(hf_names)}, "param_groups": groups}


def import_optimizer_state(opt: torch.optim.Optimizer, model, hf_state: dict, arch: HFArch,
                           hf_names: list[str], *, tp: int, pp: int) -> None:
    """Load a torch-backend optimizer state_dict (HF parameter order) into this rank's optimizer."""
    tp_rank, pp_rank = _ranks()
    names = [n for n, _ in model.named_parameters()]
    groups = [{**g, "params": list(range(len(names)))} for g in hf_state["param_groups"]]
    if not hf_state["state"]:
        opt.load_state_dict({"state": {}, "param_groups": groups})
        return
    by_name = {hf_names[i]: s for i, s in hf_state["state"].items()}
    local = {m: hf_to_megatron({n: s[m] for n, s in by_name.items()}, arch, tp=tp, pp=pp,
                               tp_rank=tp_rank, pp_rank=pp_rank) for m in MOMENTS}
    step = next(iter(by_name.values()))["step"]
    opt.load_state_dict({"state": {i: {"step": step.clone(), **{m: local[m][n] for m in MOMENTS}}
                                   for i, n in enumerate(names)}, "param_groups": groups})


def _load(job: dict, actor_cfg, tp: int, pp: int):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from stages.models.policy import load_policy
    from stages.train.actor import make_optimizer
    from stages.update import OPTIMIZER_FILE

    model_parallel_cuda_manual_seed(job["seed"])
    torch.manual_seed(seeds.update_rank(job["seed"], dist.get_rank()))
    hf_model, tok = load_policy(job["policy_dir"])
    arch = hf_arch(hf_model.config)
    model = build_gpt_model(arch, tp, pp)
    tp_rank, pp_rank = _ranks()
    model.load_state_dict(hf_to_megatron(hf_model.state_dict(), arch, tp=tp, pp=pp, tp_rank=tp_rank,
                                         pp_rank=pp_rank), strict=True)
    hf_names = [n for n, _ in hf_model.named_parameters()]
    opt, sched = make_optimizer(model, actor_cfg.optim)
    opt_path = Path(job["policy_dir"]) / OPTIMIZER_FILE
    if opt_path.is_file():
        state = torch.load(opt_path, weights_only=False)
        import_optimizer_state(opt, model, state["optimizer"], arch, hf_names, tp=tp, pp=pp)
        sched.load_state_dict(state["scheduler"])
    return hf_model, tok, arch, model, opt, sched, hf_names


def train_loop_per_worker(job: dict) -> None:
    """Worker-group entry point (also callable with world size 1 and no process group)."""
    apply_cpu_patches()
    from megatron.core import parallel_state as ps

    from configs.schema import ActorConfig
    from stages.train.megatron.ppo import megatron_ppo_update
    from stages.update import _worker_rows, write_checkpoint

    torch.set_num_threads(job.get("threads_per_worker", 1))
    own_group = _ensure_process_group()
    actor_cfg = ActorConfig.model_validate(job["actor"])
    tp, pp = actor_cfg.megatron.tensor_model_parallel_size, actor_cfg.megatron.pipeline_model_parallel_size
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"{world} workers cannot form a TP x PP grid of {tp} x {pp}; "
                         "set actor.num_workers to a multiple of their product.")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        t0 = time.perf_counter()
        hf_model, tok, arch, model, opt, sched, hf_names = _load(job, actor_cfg, tp, pp)
        rows = _worker_rows(job, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        t_load = time.perf_counter() - t0
        metrics = megatron_ppo_update(
            model, opt, sched, rows, actor_cfg, vocab_size=arch.vocab_size, tied=arch.tied,
            n_per_prompt=job["n_per_prompt"], pad_id=tok.pad_token_id, seed=job["seed"],
            micro_batch_size=actor_cfg.megatron.micro_batch_size or actor_cfg.ppo_micro_batch_size,
            temperature=job.get("temperature", 1.0))
        metrics["timing_s/update_load"] = t_load
        metrics["timing_s/update_compute"] = time.perf_counter() - t0 - t_load
        metrics["actor/weights_loaded_from_disk"] = 1.0  # megatron shards are rebuilt from the HF checkpoint
        shards = gather_to_rank0({n: p.detach() for n, p in model.named_parameters()})
        opt_state = export_optimizer_state(opt, model, arch, hf_names, tp=tp, pp=pp)
        if dist.get_rank() == 0:
            hf_model.load_state_dict(megatron_to_hf(shards, arch, tp=tp, pp=pp), strict=True)
            write_checkpoint(job["out_dir"], hf_model, tok, opt_state, sched.state_dict(), metrics,
                             job.get("checkpoint_id"))
    finally:
        ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()
