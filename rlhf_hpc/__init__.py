"""rlhf-hpc: Slurm-native KL-regularised PPO for LLMs."""

__all__: list[str] = []  # its modules are imported by their own names

__version__ = "0.1.0"
