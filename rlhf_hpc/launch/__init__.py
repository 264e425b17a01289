"""Starting jobs: ``local`` (torchrun on this machine) and, later, ``slurm`` (submitit)."""
