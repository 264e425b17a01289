"""rlhf-hpc: Slurm-native KL-regularised PPO for LLMs."""
__version__ = "0.1.0"
