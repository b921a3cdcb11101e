"""Policy and critic optimization: the PPO micro-batch loss, optimizers, torch and Megatron backends."""
