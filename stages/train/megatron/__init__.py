"""Megatron-Core policy-update backend (actor.strategy='megatron'): TP x PP x DP over
torch.distributed (NCCL on GPU, gloo on CPU with the patches in cpu_patches). The update itself runs
in stages.workers.actor_worker.ActorWorker; here: the model (model), HF <-> Megatron weight layout
(convert), the PPO loop (ppo) and optimizer-state conversion (state)."""
