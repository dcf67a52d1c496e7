"""The checkpoint-request file: how a scheduler asks a running job for a checkpoint now.

Slurm's batch shell (launch/slurm.py) creates `RUN_DIR/checkpoint.request` shortly before the time limit;
the trainer's hook (ckpt/hook.py) polls it each step, saves, and rank 0 clears it before the job stops.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_REQUEST_NAME = "checkpoint.request"


def checkpoint_requested(run_dir: Path) -> bool:
    """True when the job asked for a checkpoint (time limit near); the trainer checks this each step."""
    return (Path(run_dir) / CHECKPOINT_REQUEST_NAME).exists()


def clear_checkpoint_request(run_dir: Path) -> None:
    """The trainer (rank 0) calls this after the requested checkpoint is committed, then stops; the batch
    shell's trap then requeues the job."""
    (Path(run_dir) / CHECKPOINT_REQUEST_NAME).unlink(missing_ok=True)
