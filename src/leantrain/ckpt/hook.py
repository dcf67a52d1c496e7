"""Adapter from `CheckpointManager` to the trainer's `Checkpointer` protocol (train/trainer.py).

    trainer = Trainer(spec, run_dir=run_dir, checkpointer_factory=TrainerCheckpointer)

The trainer calls `load_latest(trainer)` once after setup, `maybe_save(trainer, force=last)` after every step on
every rank, and `close()`. This module reads the trainer's attributes by name (duck typing, no import of
leantrain.train): model, optimizer, scheduler, sampler (Stateful with the global sample index), the counters
step / tokens_seen / skipped_steps, runtime.rank / runtime.world_size, spec and run_dir.

Restarts: a worker that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0) records a `restart` event after its
resume (rank 0): the attempt, the step it resumed from, and `recovery_s`, the wall time from the failure to
the end of the load. The failure time is the kill time a drill's fault marker recorded (then `planned`), or
else the last sign of life in the run dir (the newest write to metrics.jsonl / events.jsonl), which bounds
it from below. Every successful resume also records a `resume` event (`from_step`).
The drill hook (ckpt/fault.py) is armed from the environment; without its variables it costs nothing.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

from leantrain.ckpt.fault import FaultInjector, FaultPlan, read_marker, restart_attempt
from leantrain.ckpt.manager import CheckpointManager, CheckpointSaveError
from leantrain.ckpt.rng import RankRNGState

log = logging.getLogger("leantrain.ckpt")
COUNTERS = ("step", "tokens_seen", "skipped_steps")
LIFE_SIGN_FILES = ("metrics.jsonl", "events.jsonl")


def last_sign_of_life_s(run_dir: Path) -> float | None:
    """Wall time of the run dir's newest metrics/events write: a failed attempt was alive until then."""
    times = [p.stat().st_mtime for p in (Path(run_dir) / n for n in LIFE_SIGN_FILES) if p.is_file()]
    return max(times) if times else None


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
        self.started_s = time.time()
        self.attempt = restart_attempt()
        # Read before the manager writes anything: after a restart this is the dead attempt's last write.
        self.last_alive_s = last_sign_of_life_s(trainer.run_dir) if self.attempt > 0 else None
        self.manager = CheckpointManager(
            trainer.spec, run_dir=trainer.run_dir, rank=trainer.runtime.rank, world_size=trainer.runtime.world_size,
            **manager_options,
        )
        self.last_error: CheckpointSaveError | None = None
        plan = FaultPlan.from_env()
        self.fault = None if plan is None else FaultInjector(plan, run_dir=trainer.run_dir, rank=trainer.runtime.rank)

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
        step = self.manager.load_latest(self.app_state(trainer))
        if step is not None:
            self.manager.events.emit("resume", from_step=step, world_size=trainer.runtime.world_size,
                                     attempt=self.attempt)
        if self.attempt > 0:
            self._record_restart(resumed_from=step)
        return step is not None

    def _record_restart(self, *, resumed_from: int | None) -> None:
        """The `restart` event of a worker group torchrun restarted (rank 0 writes it)."""
        marker = read_marker(self.manager.run_dir)
        planned = marker is not None and int(marker.get("attempt", -1)) == self.attempt - 1
        failed_at = float(marker["time"]) if planned and marker else self.last_alive_s
        recovery_s = None if failed_at is None else max(0.0, time.time() - failed_at)
        self.manager.events.emit(
            "restart", attempt=self.attempt, resumed_from=resumed_from, recovery_s=recovery_s, planned=planned,
            cause="drill" if planned else "worker failure", host=socket.gethostname(),
            killed_step=marker.get("step") if planned and marker else None,
            startup_s=time.time() - self.started_s,
        )
        if self.manager.rank == 0:
            log.warning("restart %d: resumed from step %s, %s s after the failure", self.attempt, resumed_from,
                        "?" if recovery_s is None else f"{recovery_s:.1f}")

    def maybe_save(self, trainer: Any, *, force: bool = False) -> None:
        """`force` (the last step) saves blocking unless this step is saved already; `force` must agree on ranks."""
        step = int(trainer.step)
        due = self.manager.should_save(step)
        drill_save = self.fault is not None and self.fault.forced_save_step == step
        if due or drill_save or (force and step != self.manager.last_saved_step):
            if self.fault is not None:
                self.fault.before_save(step, self.manager)
            try:
                self.manager.save(step, self.app_state(trainer), blocking=True if force else None)
            except CheckpointSaveError as err:  # already in events.jsonl and passed to on_alert; keep training
                self.last_error = err
                log.error("%s", err)
        if self.fault is not None:
            self.fault.after_step(step, self.manager)

    @property
    def preempt_requested(self) -> bool:
        """True once a preemption signal was agreed; the loop should stop after this step's save."""
        return self.manager.preempt_requested

    def close(self) -> None:
        self.manager.close()
