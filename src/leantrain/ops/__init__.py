"""Operating runs: launch (torchrun, Slurm, Kubernetes), preflight, health, lineage, registry, staging."""
