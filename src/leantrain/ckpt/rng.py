"""Per-rank random number generator state, saved under a per-rank key.

DCP stores a plain (non-DTensor) tensor or object that several ranks save under the same key only once, so
each rank's generators live under `rank{N}`. When a checkpoint is loaded at a larger world size, new ranks find
no entry; the manager then leaves their generators as seeded (resume at another world size is not bitwise).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RankRNGState:
    """Stateful wrapper for this rank's torch (CPU and accelerator), Python and NumPy generators."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @property
    def per_rank_key(self) -> str:
        """The key under which this rank's state is stored; the manager checks for it before loading."""
        return f"rank{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch_cpu": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available():
            state["torch_cuda"] = torch.cuda.get_rng_state()
        return {self.per_rank_key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.per_rank_key]
        torch.set_rng_state(state["torch_cpu"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["torch_cuda"])
