"""Deterministic fault injection for drills and tests: SIGKILL one rank after step k (or mid-save), once.

Set in the environment of every rank (torchrun passes it on to the workers it restarts, too):

    LEANTRAIN_FAULT_KILL_AT_STEP=k     kill after step k's checkpoint decision (required to arm anything)
    LEANTRAIN_FAULT_KILL_RANK=r        the rank that dies (default 0)
    LEANTRAIN_FAULT_DURING_SAVE=1      every rank saves at step k; rank r dies after writing its files of that
                                       save and before the commit (a half-written checkpoint)
    LEANTRAIN_FAULT_CORRUPT_LATEST=1   first flip one byte of the newest committed checkpoint, so the resume
                                       has to detect it and fall back to the one before
    LEANTRAIN_FAULT_FREEZE=1           SIGSTOP instead of SIGKILL: the rank hangs (a stuck GPU or NIC); the
                                       others' hang watchdog (ckpt/watchdog.py) must abort so the group restarts
    LEANTRAIN_FAULT_LOSE_NODE=1        the rank's node is lost with it: its fast-tier files (its own shard and
                                       the peer copy it held, ckpt/memory_tier.py) are deleted before the kill
    LEANTRAIN_FAULT_COMMIT_POINT=P     every rank saves at step k and rank 0 (it commits) dies inside the
                                       commit: `before_marker` (shards and manifest written, no COMMIT marker
                                       yet) or `before_retention` (committed and published, retention not run)

Before dying, rank r writes `run_dir/fault-injected.json` (step, rank, wall time, the job's attempt) and fsyncs
it. The marker makes the fault fire once: workers restarted by torchrun find it and train on, and the restart
event reads the kill time from it to measure recovery. SIGKILL (not an exception) because that is what a
crashed GPU, an OOM killer or a lost node looks like to the rest of the job: no handler, no flush, no goodbye.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from leantrain.ckpt import integrity as integ
from leantrain.ckpt.storage import Store

ENV_KILL_AT_STEP = "LEANTRAIN_FAULT_KILL_AT_STEP"
ENV_KILL_RANK = "LEANTRAIN_FAULT_KILL_RANK"
ENV_DURING_SAVE = "LEANTRAIN_FAULT_DURING_SAVE"
ENV_CORRUPT_LATEST = "LEANTRAIN_FAULT_CORRUPT_LATEST"
ENV_FREEZE = "LEANTRAIN_FAULT_FREEZE"
ENV_LOSE_NODE = "LEANTRAIN_FAULT_LOSE_NODE"
ENV_COMMIT_POINT = "LEANTRAIN_FAULT_COMMIT_POINT"
COMMIT_POINTS = ("before_marker", "before_retention")
MARKER_FILE = "fault-injected.json"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class FaultPlan:
    """Which rank dies when, and how."""

    kill_at_step: int
    kill_rank: int = 0
    during_save: bool = False
    corrupt_latest: bool = False
    freeze: bool = False
    lose_node: bool = False
    commit_point: str | None = None  # one of COMMIT_POINTS: rank 0 dies there, inside step k's commit

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str] | None = None) -> FaultPlan | None:
        env = os.environ if environ is None else environ
        step = env.get(ENV_KILL_AT_STEP, "").strip()
        if not step:
            return None
        if not step.isdigit() or int(step) <= 0:
            raise ValueError(f"{ENV_KILL_AT_STEP} must be a positive step number, got {step!r}")
        point = env.get(ENV_COMMIT_POINT, "").strip() or None
        if point is not None and point not in COMMIT_POINTS:
            raise ValueError(f"{ENV_COMMIT_POINT} must be one of {', '.join(COMMIT_POINTS)}, got {point!r}")
        return cls(
            commit_point=point,
            kill_at_step=int(step), kill_rank=int(env.get(ENV_KILL_RANK, "0") or 0),
            during_save=env.get(ENV_DURING_SAVE, "") in ("1", "true", "yes"),
            corrupt_latest=env.get(ENV_CORRUPT_LATEST, "") in ("1", "true", "yes"),
            freeze=env.get(ENV_FREEZE, "") in ("1", "true", "yes"),
            lose_node=env.get(ENV_LOSE_NODE, "") in ("1", "true", "yes"),
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that arm this plan (for a launcher)."""
        return {ENV_KILL_AT_STEP: str(self.kill_at_step), ENV_KILL_RANK: str(self.kill_rank),
                ENV_DURING_SAVE: "1" if self.during_save else "0",
                ENV_CORRUPT_LATEST: "1" if self.corrupt_latest else "0", ENV_FREEZE: "1" if self.freeze else "0",
                ENV_LOSE_NODE: "1" if self.lose_node else "0", ENV_COMMIT_POINT: self.commit_point or ""}


def restart_attempt() -> int:
    """torchrun's restart counter for this worker group (0 on the first start, or without torchrun)."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / MARKER_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def corrupt_newest_checkpoint(store: Store) -> str | None:
    """Flip one byte in the middle of the largest file of the newest committed checkpoint; its name, or None."""
    good = [e for e in integ.list_steps(store) if e.good_candidate]
    if not good:
        return None
    folder = good[-1].name
    manifest = integ.read_manifest(store, folder)
    name = max(manifest["files"], key=lambda n: int(manifest["files"][n]["bytes"]))
    data = bytearray(store.read_bytes(f"{folder}/{name}"))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(f"{folder}/{name}", bytes(data))
    return f"{folder}/{name}"


class FaultInjector:
    """One rank's view of a `FaultPlan`; armed until the marker file says the fault has fired."""

    def __init__(self, plan: FaultPlan, *, run_dir: Path, rank: int, attempt: int | None = None) -> None:
        """`attempt`: the job's agreed attempt (ckpt/attempt.py) the marker records; None: this process's count."""
        self.plan, self.run_dir, self.rank = plan, Path(run_dir), rank
        self.attempt = restart_attempt() if attempt is None else attempt
        self.node_files: list[Path] = []  # what a lost node takes with it (the fast tier's folders)
        # Read once at start-up by every rank, so all ranks agree whether the forced save at step k happens.
        self.fired = read_marker(self.run_dir) is not None

    @property
    def forced_save_step(self) -> int | None:
        """The step at which every rank must save so that the kill lands in the middle of a save."""
        mid_save = self.plan.during_save or self.plan.commit_point is not None
        return self.plan.kill_at_step if mid_save and not self.fired else None

    def _is_victim(self, step: int) -> bool:
        return not self.fired and self.rank == self.plan.kill_rank and step == self.plan.kill_at_step

    def before_save(self, step: int, manager: Any) -> None:
        """Mid-save kill: corrupt first if asked, then die once this rank's files of step k are written and
        before the commit, so the checkpoint is left half-written (from the saving thread when async)."""
        if self.plan.commit_point is not None:
            self._arm_commit_point(step, manager)
            return
        if not (self.plan.during_save and self._is_victim(step)):
            return
        corrupted = self._maybe_corrupt(manager)

        def die_before_commit(saving_step: int) -> None:
            if saving_step == step:
                self._die(step, corrupted=corrupted, during_save=True)

        manager.before_commit = die_before_commit

    def _arm_commit_point(self, step: int, manager: Any) -> None:
        """Rank 0 (the committer) dies at the plan's point inside step k's commit (manager.commit_point)."""
        if self.fired or self.rank != 0 or step != self.plan.kill_at_step:
            return

        def die_inside_commit(saving_step: int, point: str) -> None:
            if saving_step == step and point == self.plan.commit_point:
                self._die(step, corrupted=None, during_save=True)

        manager.commit_point = die_inside_commit

    def after_step(self, step: int, manager: Any) -> None:
        """Plain kill: right after step k and its checkpoint decision (a save at k has been issued)."""
        if self.plan.during_save or self.plan.commit_point is not None or not self._is_victim(step):
            return
        corrupted = self._maybe_corrupt(manager)
        self._die(step, corrupted=corrupted, during_save=False)

    def _maybe_corrupt(self, manager: Any) -> str | None:
        if not self.plan.corrupt_latest:
            return None
        manager.wait()  # the newest save must be committed before it can be the newest to damage
        return corrupt_newest_checkpoint(manager.store)

    def _die(self, step: int, *, corrupted: str | None, during_save: bool) -> None:
        self.fired = True
        record = {**asdict(self.plan), "step": step, "rank": self.rank, "time": time.time(),
                  "attempt": self.attempt, "during_save": during_save, "corrupted": corrupted,
                  "pid": os.getpid()}
        path = self.run_dir / MARKER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())
        if self.plan.lose_node:
            for folder in self.node_files:
                shutil.rmtree(folder, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGSTOP if self.plan.freeze else signal.SIGKILL)
