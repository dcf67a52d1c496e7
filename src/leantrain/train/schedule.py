"""Learning-rate schedules: linear warm-up, then cosine, WSD (warmup-stable-decay) or constant.

`lr_factor` is a pure function of the step (a multiplier of the peak LR), wrapped in a LambdaLR so the
scheduler's state is just its step count — which is what a checkpoint needs.
- cosine: factor = min + (1 − min) · ½(1 + cos(π · progress)) after warm-up (Loshchilov & Hutter 2017).
- wsd: flat at 1 until the last `decay_fraction` of steps, then linear to `min_lr_ratio`
  (Hu et al. 2024, MiniCPM), so a run can be extended from any checkpoint before the decay.
"""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from leantrain.spec.schema import TrainingSpec


def lr_factor(
    step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float, decay_fraction: float
) -> float:
    """LR multiplier for the optimizer step `step` (0-based: the first step uses step 0)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps  # the first step is not wasted at LR 0
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * max_steps))
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return 1.0 - (1 - min_lr_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}")


def build_scheduler(optimizer: Optimizer, training: TrainingSpec, *, max_steps: int) -> LambdaLR:
    """A LambdaLR over the spec's schedule; state_dict() holds only counters."""
    factor = functools.partial(
        lr_factor,
        warmup_steps=training.warmup_steps,
        max_steps=max_steps,
        schedule=training.schedule,
        min_lr_ratio=training.min_lr_ratio,
        decay_fraction=training.decay_fraction,
    )
    return LambdaLR(optimizer, lr_lambda=factor)
