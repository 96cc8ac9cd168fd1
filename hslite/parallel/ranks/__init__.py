"""The ranks' lives: launched under torchrun or SLURM, set up, and watched for stalls and failures."""
