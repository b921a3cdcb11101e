"""Megatron-Core state conversion for the policy update's Megatron backend (actor.strategy='megatron',
run by stages.workers.actor_worker.ActorWorker): gathering the model-parallel shards on rank 0 and moving
the AdamW state between this rank's shards and the torch backend's format (HF parameter order), so a
checkpoint written by either backend resumes in the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from stages.train.megatron.convert import hf_to_megatron, megatron_to_hf
from stages.train.megatron.model import HFArch

MOMENTS = ("exp_avg", "exp_avg_sq")


def model_parallel_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel rank) of this process."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def gather_to_rank0(local: dict[str, Tensor]) -> dict[tuple[int, int], dict[str, Tensor]] | None:
    """Every (tp_rank, pp_rank) shard of DP replica 0 on global rank 0; None elsewhere."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    if ps.get_data_parallel_rank() != 0:
        return None
    group = ps.get_model_parallel_group()
    out: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object((model_parallel_ranks(), local), out, dst=0, group=group)
    return dict(out) if out is not None else None


def export_optimizer_state(
    opt: torch.optim.Optimizer, model, arch: HFArch, hf_names: list[str], *, tp: int, pp: int
) -> dict | None:
    """The optimizer state_dict in HF parameter order on rank 0 (torch backend format)."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    state = {n: opt.state[p] for n, p in zip(names, params, strict=True) if p in opt.state}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(hf_names)))}
        for g in opt.state_dict()["param_groups"]
    ]
    gathered = {m: gather_to_rank0({n: s[m] for n, s in state.items()}) for m in MOMENTS} if state else {}
    if dist.get_rank() != 0:
        return None
    if not state:
        return {"state": {}, "param_groups": groups}
    hf_moments = {m: megatron_to_hf(gathered[m], arch, tp=tp, pp=pp) for m in MOMENTS}
    step = next(iter(state.values()))["step"]
    return {
        "state": {i: {"step": step.clone(), **{m: hf_moments[m][n] for m in MOMENTS}} for i, n in enumerate(hf_names)},
        "param_groups": groups,
    }


def import_optimizer_state(
    opt: torch.optim.Optimizer, model, hf_state: dict, arch: HFArch, hf_names: list[str], *, tp: int, pp: int
) -> None:
    """Load a torch-backend optimizer state_dict (HF parameter order) into this rank's optimizer."""
    tp_rank, pp_rank = model_parallel_ranks()
    names = [n for n, _ in model.named_parameters()]
    groups = [{**g, "params": list(range(len(names)))} for g in hf_state["param_groups"]]
    if not hf_state["state"]:
        opt.load_state_dict({"state": {}, "param_groups": groups})
        return
    by_name = {hf_names[i]: s for i, s in hf_state["state"].items()}
    local = {
        m: hf_to_megatron({n: s[m] for n, s in by_name.items()}, arch, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank)
        for m in MOMENTS
    }
    step = next(iter(by_name.values()))["step"]
    opt.load_state_dict(
        {
            "state": {i: {"step": step.clone(), **{m: local[m][n] for m in MOMENTS}} for i, n in enumerate(names)},
            "param_groups": groups,
        }
    )
