"""Adapter from `CheckpointManager` to the trainer's `Checkpointer` protocol (train/trainer.py).

    trainer = Trainer(spec, run_dir=run_dir, checkpointer_factory=TrainerCheckpointer)

The trainer calls `load_latest(trainer)` once after setup, `maybe_save(trainer, force=last)` after every step on
every rank, and `close()`. This module reads the trainer's attributes by name (duck typing, no import of
leantrain.train): model, optimizer, scheduler, sampler (Stateful with the global sample index), the counters
step / tokens_seen / skipped_steps, runtime.rank / runtime.world_size, spec and run_dir.
"""

from __future__ import annotations

import logging
from typing import Any

from leantrain.ckpt.manager import CheckpointManager, CheckpointSaveError
from leantrain.ckpt.rng import RankRNGState

log = logging.getLogger("leantrain.ckpt")
COUNTERS = ("step", "tokens_seen", "skipped_steps")


class _Counters:
    """The trainer's loop counters as a Stateful, so they load straight back into its attributes."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, int]:
        return {name: int(getattr(self.trainer, name)) for name in COUNTERS if hasattr(self.trainer, name)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name, value in state.items():
            setattr(self.trainer, name, int(value))


class TrainerCheckpointer:
    """Saves on the spec's interval (or when preempted, or at the last step) and resumes at start-up."""

    def __init__(self, trainer: Any, **manager_options: Any) -> None:
        self.manager = CheckpointManager(
            trainer.spec, run_dir=trainer.run_dir, rank=trainer.runtime.rank, world_size=trainer.runtime.world_size,
            **manager_options,
        )
        self.last_error: CheckpointSaveError | None = None

    def app_state(self, trainer: Any) -> dict[str, Any]:
        return {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            "scheduler": trainer.scheduler,
            "train": _Counters(trainer),
            "sampler": trainer.sampler,
            "rng": RankRNGState(trainer.runtime.rank),
        }

    def load_latest(self, trainer: Any) -> bool:
        return self.manager.load_latest(self.app_state(trainer)) is not None

    def maybe_save(self, trainer: Any, *, force: bool = False) -> None:
        """`force` (the last step) saves blocking unless this step is saved already; `force` must agree on ranks."""
        step = int(trainer.step)
        due = self.manager.should_save(step)
        if not due and not (force and step != self.manager.last_saved_step):
            return
        try:
            self.manager.save(step, self.app_state(trainer), blocking=True if force else None)
        except CheckpointSaveError as err:  # already in events.jsonl and passed to on_alert; keep training
            self.last_error = err
            log.error("%s", err)

    @property
    def preempt_requested(self) -> bool:
        """True once a preemption signal was agreed; the loop should stop after this step's save."""
        return self.manager.preempt_requested

    def close(self) -> None:
        self.manager.close()
