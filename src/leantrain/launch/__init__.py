"""Launching a job: local torchrun, Slurm and Kubernetes job files, data staging, preflight, node health."""
