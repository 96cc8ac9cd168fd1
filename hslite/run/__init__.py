"""A run's life on disk: fit, predict, resume, the run folder, checkpoints, training state, outputs."""
