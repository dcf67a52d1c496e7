"""Distributed checkpoints: DCP save/load, atomic verified commits, local and S3 storage, encryption, resume.

The trainer uses `CheckpointManager` (see manager.py for the calling pattern) and `RankRNGState`.
"""

from leantrain.ckpt.manager import CheckpointLoadError, CheckpointManager, CheckpointSaveError
from leantrain.ckpt.policy import job_mtbf_s, young_daly_interval_s
from leantrain.ckpt.rng import RankRNGState

__all__ = [
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointSaveError",
    "RankRNGState",
    "job_mtbf_s",
    "young_daly_interval_s",
]
