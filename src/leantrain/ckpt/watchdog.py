"""The hang watchdog: a rank that sees no training step for `monitoring.hang_timeout_s` aborts, so the elastic
agent restarts the whole group from the newest checkpoint instead of idling until a collective timeout.

Every rank runs one (a daemon thread). A frozen rank (a stuck GPU, NIC or a SIGSTOP) cannot act; the healthy
ones are blocked in a collective waiting for it, so their own steps stop too: their watchdogs fire, each
writes its own record RUN_DIR/hang/rank-R-attempt-A.json (ckpt/rank_records.py: the last step and its wall
time; rank 0 also appends the `hang_abort` event, as the one writer of events.jsonl), and ends the process
with HANG_EXIT_CODE. torchrun then tears the group down (SIGKILL for the frozen one) and restarts it; the next
attempt's `restart` event has cause `hang`, names the ranks that aborted and the ones that did not (the
frozen suspects), and counts the recovery from the last step, i.e. the time lost.
`fault.collective_timeout_s` (train/runtime.py) is the backstop for a collective that never returns; the spec
requires it to be longer than `monitoring.hang_timeout_s` + POLL_MAX_S, so the watchdog always fires first
and the restart is labelled a hang, not a worker failure.

It only aborts under an elastic agent with `fault.auto_restart` and `fault.hang_action: abort`; otherwise the
hang alert (observe/alerts.py) reports it and nothing is killed. Time inside a checkpoint save is not counted
(`paused`): the save's own group has its own timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from leantrain.ckpt.rank_records import HANG, read_rank_records, write_rank_record

log = logging.getLogger("leantrain.ckpt")

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: try again (the agent restarts the group)
POLL_MAX_S = 2.0  # the watchdog looks at most this long after the timeout passed
ELASTIC_ENV = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def under_elastic_agent(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(name in env for name in ELASTIC_ENV)


def read_hangs(run_dir: Path, *, attempt: int | None = None) -> list[dict[str, Any]]:
    """The ranks' hang records (of one attempt when given)."""
    records = read_rank_records(run_dir, HANG)
    return [r for r in records if attempt is None or int(r.get("attempt", -1)) == attempt]


class HangWatchdog:
    """Fires once when no `tick` came for `timeout_s` (armed by the first tick, not counted while paused)."""

    def __init__(self, *, timeout_s: float, run_dir: Path, rank: int, attempt: int,
                 on_hang: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.run_dir, self.rank, self.attempt = timeout_s, Path(run_dir), rank, attempt
        self.on_hang = on_hang or (lambda: os._exit(HANG_EXIT_CODE))
        self.clock = clock
        self.step: int | None = None
        self.fired = False
        self._last_tick: float | None = None
        self._last_tick_wall: float | None = None
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._poll_s = max(0.05, min(POLL_MAX_S, timeout_s / 40))

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def tick(self, step: int) -> None:
        """A step finished on this rank."""
        self.step, self._last_tick, self._last_tick_wall = step, self.clock(), time.time()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            if self._last_tick is not None:
                self._last_tick = self.clock()  # the save was progress

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def check(self) -> bool:
        """Fire if the timeout passed (the thread calls this; tests may call it directly)."""
        if self.fired or self._paused or self._last_tick is None:
            return False
        idle_s = self.clock() - self._last_tick
        if idle_s < self.timeout_s:
            return False
        self.fired = True
        self._record(idle_s)
        self.on_hang()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.check():
                return

    def _record(self, idle_s: float) -> None:
        from leantrain.observe.report_data import append_event

        record = {"rank": self.rank, "host": socket.gethostname(), "last_step": self.step, "idle_s": idle_s,
                  "last_step_time": self._last_tick_wall, "attempt": self.attempt, "timeout_s": self.timeout_s}
        log.error("rank %d: no training step for %.0f s after step %s (monitoring.hang_timeout_s=%g): aborting so "
                  "the elastic agent restarts the group from the newest checkpoint", self.rank, idle_s, self.step,
                  self.timeout_s)
        if write_rank_record(self.run_dir, HANG, rank=self.rank, attempt=self.attempt, record=record) is None:
            log.error("could not record the hang under %s", self.run_dir / HANG)  # the abort matters more
        if self.rank == 0:
            with contextlib.suppress(OSError):
                append_event(self.run_dir, "hang_abort", **record)
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
