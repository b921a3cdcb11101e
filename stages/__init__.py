"""rlake stages: engines, Ray Data stage callables, rewards, trainers and Delta I/O."""
