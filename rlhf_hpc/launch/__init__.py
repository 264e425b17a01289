"""Starting jobs: ``local`` (torchrun on this machine), ``slurm`` (submitit: sbatch, requeue, sweeps),
``node`` (what each node of a job runs), ``stop`` (signals and the time limit)."""
