"""The algorithm on the training models: actor and critic updates, the optimizer, the stability
guard, checkpoints, the trainer (``PPOTrainer``: one step, phase by phase)."""
