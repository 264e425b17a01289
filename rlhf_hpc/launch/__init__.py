"""Starting jobs: ``local`` (torchrun on this machine), ``slurm`` (submitit: sbatch, requeue, sweeps),
``node`` (what each node of a job runs), ``stop`` (signals and the time limit); how a run ends:
``run_lock`` (one run per run directory), ``rank_group`` (torchrun and its ranks), ``watchdog`` (a
rank lost or hung), ``failure`` (exit codes and the one line of a failed run)."""
