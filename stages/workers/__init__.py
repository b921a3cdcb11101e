"""What the stages run on: one Ray actor class per role, state in attributes, called by bound method
through one WorkerGroup (group.py), with typed frozen requests (requests.py).

- rollout_worker.RolloutWorker.generate: the rollout engine (HF or vLLM), synced to each policy version
- ref_worker.RefWorker.compute_ref_log_prob: the reference policy's log-probs
- actor_worker.ActorWorker.update: the policy update, torch (DDP) or Megatron-Core backend
- critic_worker.CriticWorker.compute_values / update_critic: the value model of PPO with GAE
- tasks.map_with_tasks: stateless work (rule rewards) as Ray tasks

A worker class is plain Python (tests and use_ray=False paths instantiate it in-process); the group
makes it a Ray actor. A new role (e.g. a reward model) is a Worker subclass here, a group in its stage.
"""
