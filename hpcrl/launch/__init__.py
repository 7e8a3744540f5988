"""Slurm side: sbatch text (through submitit), submission, the in-job bootstrap."""
