"""ActorWorker: one rank of the policy trainer (verl: `update_actor`), torch or Megatron-Core backend.

stages.policy_checkpoint runs `ActorWorker.update(request)` on every rank of the run's "actor" group (one gloo
process group over actor.num_workers Ray actors). Each rank reads its share of the iteration's rows
from the advantages Delta table at the recorded version (`read_rows`), runs one PPO update, and rank 0
commits the new HF checkpoint with optimizer state, update metrics and a checkpoint id to the run's
checkpoint store (request.out_dir a checkpoint_target: uploaded, manifest last; stages.io.checkpoints), or
writes it into the local directory request.out_dir atomically. The metrics return to the driver as the
call's value (through Ray).

- torch (actor.strategy='torch'): `stages.train.actor.ppo_update`, DDP over the group. The rank keeps
  the policy, optimizer, scheduler and tokenizer it just wrote (`self.resident`); the next update skips
  the load when its input checkpoint is that one (same checkpoint id) and loads it (fetched into
  the node's cache when it is a checkpoint reference) otherwise (a re-materialized or replayed
  iteration, a resumed run). Either way the update is the
  same function of the checkpoint on disk. With actor.mixed_precision.master_weights='fp32_master' the resident
  parameters are bf16 beside a MasterAdamW's float32 masters (stages.train.master), which average their own
  gradients (no DDP wrapper), and rank 0 writes the checkpoint from the masters (float32_params).
- fsdp (actor.strategy='fsdp'): the same `ppo_update` on a model sharded with torch's FSDP2 `fully_shard`
  (stages.train.fsdp) instead of DDP, kept resident as torch's; rank 0 writes the torch backend's checkpoint
  from the gathered shards. `compute_log_prob` loads the HF checkpoint whole, as megatron's does (a sharded
  forward is a collective, and the ranks' shards of rollouts differ in size).
- `compute_log_prob` (verl's name; the old_logprobs stage, stages/old_logprobs.py): before the update,
  the ranks recompute the log-probs of the iteration's responses under policy version `iteration`. The
  torch backend computes them with the resident policy, or loads it and keeps it resident, so the update
  that follows skips its load (version 0, written without a checkpoint id, is identified by its weight
  files' mtimes, as the rollout engines do). The update then reads them from the advantages table
  (`read_rows`) as the PPO ratio's denominator instead of recomputing them.
- megatron (actor.strategy='megatron'): the ranks form a TP x PP x DP grid (TP fastest, then DP, then
  PP); every rank loads the HF checkpoint, keeps its shard, runs `megatron_ppo_update`, and rank 0
  gathers DP replica 0's shards back into an HF checkpoint with the optimizer state in the torch
  backend's format, so the next iteration may use either backend. Nothing stays resident:
  `compute_log_prob` loads the HF checkpoint and computes with torch, and the Megatron update still
  recomputes its own old log-probs (stages.train.megatron.ppo), so its ratio denominator may differ from
  the table's by float rounding.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from configs.schema import ActorConfig, LoraConfig, OptimConfig
from stages import seeds
from stages.io.advantage_rows import read_advantage_rows
from stages.io.checkpoints import (
    CHECKPOINT_ID,
    checkpoint_identity,
    ref_checkpoint_id,
    resolve_model_dir,
    save_optimizer_state,
    writing,
)
from stages.io.store import read_partition
from stages.models.lora import load_lora_policy, merged_state_dict, refuse_lora_checkpoint, save_adapter, save_merged
from stages.models.policy import load_policy, save_policy
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import pad_rollouts, row_masks, stored_old_logprobs
from stages.train.fsdp import gather_checkpoint, no_grad_sync, shard_policy
from stages.train.master import MasterAdamW, float32_params
from stages.train.megatron.convert import hf_to_megatron, megatron_to_hf
from stages.train.megatron.cpu_patches import apply_cpu_patches
from stages.train.megatron.model import build_gpt_model, hf_arch
from stages.train.megatron.ppo import megatron_ppo_update
from stages.train.megatron.state import (
    export_optimizer_state,
    gather_to_rank0,
    import_optimizer_state,
    model_parallel_ranks,
)
from stages.train.optim import make_optimizer, restore_optimizer
from stages.train.ppo_loop import shard_for_rank
from stages.workers.group import Worker
from stages.workers.placement import collective_backend
from stages.workers.requests import UpdateRequest

NO_LORA = LoraConfig()
"""actor.lora's default: full fine-tuning."""
METRICS_FILE = "update_metrics.json"
"""The update's metrics, kept beside the checkpoint as a record; the driver takes them from the update call's
return value (through Ray), never from this file."""


ROW_COLUMNS = (
    "rollout_id",
    "prompt_token_ids",
    "response_token_ids",
    "advantage",
    "token_advantages",
    "ref_logprobs",
    "response_mask",
    "rollout_logprobs",
    "old_logprobs",
)
"""The advantages rows' columns the update reads (those there are): the token and log-prob columns are joined
from their tables (stages.io.advantage_rows)."""


def rank_partition(req: UpdateRequest, rank: int, world: int) -> pd.DataFrame:
    """This (data-parallel) rank's rows of the iteration's advantages partition at the recorded version, in
    rollout_id order: the partition's rollout ids first (one column), then only this rank's rows
    (stages.train.ppo_loop.shard_for_rank of the sorted ids) and only the ROW_COLUMNS there are, those of the
    rollouts and log-prob tables joined by rollout_id from the same ids' rows of their recorded versions
    (stages.io.advantage_rows.read_advantage_rows). Each rank reads its shard, never the whole partition."""
    uri, version = req.advantages_uri, req.advantages_version
    ids = read_partition(uri, req.run_id, req.iteration, version=version, columns=["rollout_id"])["rollout_id"]
    ids = ids.sort_values().to_numpy()
    mine = ids[shard_for_rank(len(ids), req.actor.ppo_mini_batch_size * req.n_per_prompt, rank, world)]
    # more ranks than rows: this rank's `mine` is empty, so are its rows (the columns still there)
    df = read_advantage_rows(uri, req.run_id, req.iteration, version, list(ROW_COLUMNS), mine)
    return df.sort_values("rollout_id").reset_index(drop=True)


def read_rows(req: UpdateRequest, rank: int, world: int) -> dict:
    """This (data-parallel) rank's rows of the iteration, as ppo_update takes them."""
    part = rank_partition(req, rank, world)
    rows = {
        "prompt_token_ids": [list(x) for x in part["prompt_token_ids"]],
        "response_token_ids": [list(x) for x in part["response_token_ids"]],
        "advantages": torch.tensor(part["advantage"].to_numpy(), dtype=torch.float32),
    }
    for column in ("token_advantages", "ref_logprobs"):
        if column in part.columns:
            rows[column] = [list(x) for x in part[column]]
    rows["response_mask"] = row_masks(part.get("response_mask"))  # multi-turn: 0 = observation token (no loss)
    if req.rollout_correction.enabled and "rollout_logprobs" in part.columns:  # checked by actor_batch
        rows["rollout_logprobs"] = [[] if x is None else list(x) for x in part["rollout_logprobs"]]
    old = stored_old_logprobs(part)
    if old is not None:
        rows["old_logprobs"] = old
    return rows


def write_checkpoint(
    req: UpdateRequest,
    model,
    tok,
    optimizer_state: dict,
    scheduler_state: dict,
    metrics: dict,
    lora: tuple[dict, dict] | None = None,
) -> None:
    """HF model + optimizer state + metrics + checkpoint id (+ req.extra_files) to req.out_dir: committed to the
    run's store when it is a checkpoint_target (uploaded, manifest last), else written atomically. A LoRA policy
    (lora: its merged state dict and base record, stages.models.lora) writes the merged weights and its adapter."""
    with writing(req.out_dir, checkpoint_id=req.checkpoint_id) as tmp:
        if lora is None:
            save_policy(model, tok, tmp)
        else:
            save_merged(model, tok, tmp, lora[0])
            save_adapter(model, tmp, lora[1])
        save_optimizer_state(tmp, optimizer_state, scheduler_state)
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True))
        (tmp / CHECKPOINT_ID).write_text(req.checkpoint_id)
        for name, text in req.extra_files:
            (tmp / name).write_text(text)


@dataclass
class ResidentPolicy:
    """A policy, its optimizer and scheduler and tokenizer, and the checkpoint they equal."""

    ckpt_dir: str
    ckpt_id: str | None
    """resident_id of the checkpoint."""
    optim: OptimConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: Any
    lora: LoraConfig = NO_LORA
    lora_base: dict | None = None
    """A LoRA policy's base checkpoint (stages.models.lora.base_record); None: full fine-tuning."""
    master_weights: str = "autocast"
    """actor.mixed_precision.master_weights: 'fp32_master' holds bf16 parameters and a MasterAdamW."""

    def holds(
        self, policy_dir: str, optim: OptimConfig, lora: LoraConfig = NO_LORA, master_weights: str = "autocast"
    ) -> bool:
        """Whether this is the checkpoint policy_dir names (loaded or written by this rank): same checkpoint id,
        and the same optimizer, LoRA and master-weight settings."""
        want = resident_id(policy_dir)
        same = self.optim == optim and self.lora == lora and self.master_weights == master_weights
        return want is not None and self.ckpt_id == want and same


def resident_id(policy_dir: str | Path) -> str | None:
    """What identifies a checkpoint a rank holds: its checkpoint id (read from a checkpoint reference without a
    download), or for a directory written without one its path and weight files' mtimes
    (stages.io.checkpoints.checkpoint_identity); None: no way to tell."""
    return ref_checkpoint_id(policy_dir) or checkpoint_identity(resolve_model_dir(policy_dir))[0] or None


def load_resident(
    policy_dir: str,
    optim: OptimConfig,
    device: torch.device | str = "cpu",
    strategy: str = "torch",
    lora: LoraConfig = NO_LORA,
    master_weights: str = "autocast",
) -> ResidentPolicy:
    """The policy at policy_dir on `device` (the rank's) with a fresh optimizer holding the optimizer state
    stored beside it; strategy 'fsdp': sharded over the ranks (a collective, stages.train.fsdp); lora.rank > 0:
    its base checkpoint with its adapter, or fresh adapters on policy_dir (stages.models.lora); master_weights
    'fp32_master': float32 masters from the checkpoint, bf16 parameters (stages.train.master; fsdp: FSDP2's
    bf16 compute over the float32 shards)."""
    ident = resident_id(policy_dir)  # before the load: a checkpoint rewritten meanwhile is not taken for this one
    base = None
    if lora.rank > 0:
        model, tok, base = load_lora_policy(policy_dir, lora)
    else:
        refuse_lora_checkpoint(policy_dir)
    policy_dir = str(resolve_model_dir(policy_dir))  # a checkpoint reference: this node's cached copy
    if base is None:
        model, tok = load_policy(policy_dir)
    model.to(device)
    if strategy == "fsdp":
        model, opt, sched = shard_policy(model, optim, policy_dir, bf16_compute=master_weights == "fp32_master")
    else:
        opt, sched = make_optimizer(model, optim, master_weights)
        restore_optimizer(opt, sched, policy_dir)
    resolved = str(Path(policy_dir).resolve())
    return ResidentPolicy(resolved, ident, optim, model, opt, sched, tok, lora, base, master_weights)


def old_logprob_rows(
    model,
    pad_id: int,
    rows: pd.DataFrame,
    micro_batch_size: int,
    temperature: float,
    param_dtype: str = "float32",
    max_token_len: int | None = None,
) -> pd.DataFrame:
    """Rows (rollout_id, policy_version, old_logprobs) of `rows`' rollouts in their order: the log-probs of each
    response token under `model` at `temperature`, padded as the update pads (pad_rollouts) and micro-batched
    by the update's compute_logprobs (packed by a token budget with max_token_len: actor.use_dynamic_bsz), at the
    update's compute dtype param_dtype. Every response token gets one,
    observation tokens of a multi-turn response too: the consumers leave those out through the response mask."""
    out: list[list[float]] = []
    if len(rows):
        responses = [list(map(int, r)) for r in rows["response_token_ids"]]
        batch = pad_rollouts([list(map(int, p)) for p in rows["prompt_token_ids"]], responses, pad_id)
        model.eval()
        logprobs = compute_logprobs(
            model, batch, micro_batch_size, temperature, param_dtype=param_dtype, max_token_len=max_token_len
        )  # (n, L)
        out = [logprobs[i, : len(r)].tolist() for i, r in enumerate(responses)]
    return pd.DataFrame(
        {
            "rollout_id": rows["rollout_id"].to_numpy(),
            "policy_version": rows["policy_version"].to_numpy(),
            "old_logprobs": pd.Series(out, dtype=object),
        }
    )


class ActorWorker(Worker):
    """One trainer rank; `strategy` (actor.strategy) picks the backend for the group's lifetime."""

    def __init__(self, rank: int, world: int, threads: int, shape: str = "", *, strategy: str = "torch") -> None:
        super().__init__(rank, world, threads, shape)
        self.strategy = strategy
        self.resident: ResidentPolicy | None = None
        self.published: tuple[str, ray.ObjectRef] | None = None
        """(checkpoint id, ref of its state dict in Ray's object store): rank 0's newest policy, for the engines."""

    def publish(self, req: UpdateRequest, model, state: dict | None = None) -> None:
        """rollout.weight_sync=object_store: put the new policy's weights (CPU tensors, HF names; `state` when
        given: a LoRA policy's merged weights) in Ray's object store once, replacing the previous version's; every
        rollout engine then gets them from there, on any node, without a file (ActorWorker.published_weights). The
        committed checkpoint stays the durable copy."""
        self.published = None
        if req.weight_sync == "object_store":
            state = state if state is not None else model.state_dict()
            state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
            self.published = (req.checkpoint_id, ray.put(state))

    def published_weights(self, checkpoint_id: str) -> list:
        """[ref] of checkpoint `checkpoint_id`'s weights when this rank published them, else [] (the engines then
        load the committed checkpoint). A list, so Ray hands the ref over instead of resolving it."""
        if self.published is not None and self.published[0] == checkpoint_id:
            return [self.published[1]]
        return []

    def compute_log_prob(
        self, policy_dir: str, rows: pd.DataFrame, actor: ActorConfig, temperature: float
    ) -> pd.DataFrame:
        """verl's `compute_log_prob`: old_logprob_rows of this rank's rollouts under the checkpoint policy_dir,
        in micro-batches of actor.ppo_micro_batch_size. torch: the resident policy when it is that checkpoint,
        else loaded and kept resident for the update (whose optimizer config is actor.optim); megatron: the
        HF checkpoint loaded for this call only."""
        if actor.strategy != self.strategy:
            raise ValueError(
                f"an actor.strategy='{actor.strategy}' compute_log_prob reached a '{self.strategy}' "
                "ActorWorker; build the actor group with strategy=actor.strategy"
            )
        if self.strategy in ("megatron", "fsdp"):  # fsdp: sharded forwards are collectives, the shards' sizes differ
            model, tok = load_policy(resolve_model_dir(policy_dir))
            model.to(self.device)
        else:
            master = actor.mixed_precision.master_weights
            if self.resident is None or not self.resident.holds(policy_dir, actor.optim, actor.lora, master):
                self.resident = None  # frees a stale policy before the load
                self.resident = load_resident(
                    policy_dir, actor.optim, self.device, lora=actor.lora, master_weights=master
                )
            model, tok = self.resident.model, self.resident.tokenizer
        budget = actor.log_prob_max_token_len_per_gpu if actor.use_dynamic_bsz else None
        return old_logprob_rows(
            model,
            tok.pad_token_id,
            rows,
            actor.ppo_micro_batch_size,
            temperature,
            actor.mixed_precision.param_dtype,
            budget,
        )

    def update(self, req: UpdateRequest) -> dict[str, float]:
        """One PPO update of req.policy_dir on this rank's rows; rank 0 writes req.out_dir. Returns this
        rank's metrics (equal on every rank: they are averaged over the group)."""
        if req.actor.strategy != self.strategy:
            raise ValueError(
                f"an actor.strategy='{req.actor.strategy}' update reached a '{self.strategy}' "
                "ActorWorker; build the actor group with strategy=req.actor.strategy"
            )
        if self.strategy == "megatron":
            return megatron_update(req, self.device)
        return self._torch_update(req)

    def _torch_update(self, req: UpdateRequest) -> dict[str, float]:
        torch.manual_seed(seeds.update_rank(req.seed, self.rank))
        t0 = time.perf_counter()
        master = req.actor.mixed_precision.master_weights
        held = self.resident is not None and self.resident.holds(
            req.policy_dir, req.actor.optim, req.actor.lora, master
        )
        res = self.resident if held else None
        self.resident = None  # frees a stale policy before the load; a failed update leaves nothing resident
        from_disk = res is None
        if res is None:
            res = load_resident(req.policy_dir, req.actor.optim, self.device, self.strategy, req.actor.lora, master)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        fsdp = self.strategy == "fsdp"
        # a MasterAdamW (torch fp32_master) averages its float32 gradients itself: no DDP
        own_reduce = isinstance(res.optimizer, MasterAdamW)
        ddp = (
            None if self.world == 1 or fsdp or own_reduce else DistributedDataParallel(res.model, device_ids=device_ids)
        )
        rows = read_rows(req, self.rank, self.world)
        t_load = time.perf_counter() - t0
        metrics = ppo_update(
            res.model,
            res.optimizer,
            res.scheduler,
            rows,
            req.actor,
            n_per_prompt=req.n_per_prompt,
            pad_id=res.tokenizer.pad_token_id,
            seed=req.seed,
            ddp_model=ddp,
            no_sync=(lambda: no_grad_sync(res.model)) if fsdp else None,
            temperature=req.temperature,
            rollout_correction=req.rollout_correction,
        )
        metrics["timing_s/update_load"] = t_load
        metrics["timing_s/update_compute"] = time.perf_counter() - t0 - t_load
        metrics["actor/weights_loaded_from_disk"] = float(from_disk)
        # fsdp: whole weights and optimizer state gathered to rank 0 (a collective), in the torch backend's format
        model, opt_state = gather_checkpoint(res.model, res.optimizer) if fsdp else (res.model, None)
        if self.rank == 0:
            with float32_params(res.optimizer):  # fp32_master: the checkpoint and published weights are the masters
                self._commit(req, res, model, opt_state or res.optimizer.state_dict(), metrics)
        if self.world > 1:
            dist.barrier()  # every rank sees the checkpoint before keeping its state resident
        res.ckpt_dir, res.ckpt_id = req.out_dir, req.checkpoint_id
        self.resident = res
        return metrics

    def _commit(self, req: UpdateRequest, res: ResidentPolicy, model, opt_state: dict, metrics: dict) -> None:
        """Rank 0: write the checkpoint and publish its weights (a LoRA policy's merged once, for both)."""
        lora = None if res.lora_base is None else (merged_state_dict(model), res.lora_base)
        write_checkpoint(req, model, res.tokenizer, opt_state, res.scheduler.state_dict(), metrics, lora)
        self.publish(req, model, None if lora is None else lora[0])


def _ensure_process_group(device: torch.device) -> bool:
    """A one-process group (gloo, NCCL on a GPU) when none exists (megatron's parallel_state needs one)."""
    if dist.is_initialized():
        return False
    # an in-process store: a TCPStore would listen on every interface for a group of one
    dist.init_process_group(collective_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    return True


def megatron_update(req: UpdateRequest, device: torch.device | str = "cpu") -> dict[str, float]:
    """The Megatron backend of ActorWorker.update on this rank's device (a one-process group when there is
    none). The CPU patches apply on the CPU only; on a GPU megatron-core runs unpatched over NCCL."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    device = torch.device(device)
    apply_cpu_patches(device=device)
    own_group = _ensure_process_group(device)
    tp = req.actor.megatron.tensor_model_parallel_size
    pp = req.actor.megatron.pipeline_model_parallel_size
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"{world} workers cannot form a TP x PP grid of {tp} x {pp}; "
            "set actor.num_workers to a multiple of their product."
        )
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        return _megatron_update_grid(req, tp, pp, device)
    finally:
        ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def _megatron_load(req: UpdateRequest, tp: int, pp: int, device: torch.device):
    """(hf_model, tokenizer, arch, this rank's GPTModel shard, optimizer, scheduler, HF parameter names)."""
    from megatron.core.tensor_parallel import (  # noqa: PLC0415 - megatron-core is an optional extra
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(req.seed)
    torch.manual_seed(seeds.update_rank(req.seed, dist.get_rank()))
    policy_dir = resolve_model_dir(req.policy_dir)
    hf_model, tok = load_policy(policy_dir)
    arch = hf_arch(hf_model.config)
    model = build_gpt_model(arch, tp, pp).to(device)  # built on the CPU (use_cpu_initialization), then moved
    tp_rank, pp_rank = model_parallel_ranks()
    model.load_state_dict(
        hf_to_megatron(hf_model.state_dict(), arch, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank), strict=True
    )
    hf_names = [n for n, _ in hf_model.named_parameters()]
    opt, sched = make_optimizer(model, req.actor.optim)
    restore_optimizer(
        opt,
        sched,
        policy_dir,
        load=lambda o, state: import_optimizer_state(o, model, state, arch, hf_names, tp=tp, pp=pp),
    )
    return hf_model, tok, arch, model, opt, sched, hf_names


def _megatron_update_grid(req: UpdateRequest, tp: int, pp: int, device: torch.device) -> dict[str, float]:
    """Load, update this rank's shard on its data-parallel rows, and write the gathered checkpoint (rank 0)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    t0 = time.perf_counter()
    hf_model, tok, arch, model, opt, sched, hf_names = _megatron_load(req, tp, pp, device)
    rows = read_rows(req, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    t_load = time.perf_counter() - t0
    metrics = megatron_ppo_update(
        model,
        opt,
        sched,
        rows,
        req.actor,
        vocab_size=arch.vocab_size,
        tied=arch.tied,
        n_per_prompt=req.n_per_prompt,
        pad_id=tok.pad_token_id,
        seed=req.seed,
        micro_batch_size=req.actor.megatron.micro_batch_size or req.actor.ppo_micro_batch_size,
        temperature=req.temperature,
        rollout_correction=req.rollout_correction,
    )
    metrics["timing_s/update_load"] = t_load
    metrics["timing_s/update_compute"] = time.perf_counter() - t0 - t_load
    metrics["actor/weights_loaded_from_disk"] = 1.0  # megatron shards are rebuilt from the HF checkpoint
    shards = gather_to_rank0({n: p.detach() for n, p in model.named_parameters()})
    opt_state = export_optimizer_state(opt, model, arch, hf_names, tp=tp, pp=pp)
    if dist.get_rank() == 0:
        hf_model.load_state_dict(megatron_to_hf(shards, arch, tp=tp, pp=pp), strict=True)
        write_checkpoint(req, hf_model, tok, opt_state, sched.state_dict(), metrics)
    return metrics
