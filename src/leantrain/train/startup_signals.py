"""SIGINT/SIGTERM while `leantrain train` starts or closes, outside the training loop's own handling.

The training loop's handler (ckpt/policy.py's PreemptionHandler, set up with the checkpointer) saves the current
step and exits 130/143. Before it exists (the process group, the model build, the load or resume: minutes at
scale) and after it is removed (closing), Python's default would end the process at once on SIGTERM, silently
(exit -15), with the run dir's lease still held and the run marked as nothing. `StartupSignals` turns the signal
into `Interrupted` (exit 130/143, one line naming the signal and the phase), so the lease is released and the
run marked interrupted on the way out; the next start resumes from the newest checkpoint.

A Python signal handler runs only when the main thread is back in Python. A start-up blocked in C++ (a rank
waiting in the rendezvous or a collective for a peer that died: torchrun then stops the survivors with SIGTERM
and kills them 30 s later) would not take it at all, where the default action ended the process at once. So the
signal also wakes a watcher thread (`signal.set_wakeup_fd`): when the main thread has not taken the signal within
`grace_s`, the watcher releases the lease (`on_stuck`), prints the same line and ends the process (`os._exit`,
128 + the signal). A second signal gets the default action (an impatient operator still stops the process at
once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from leantrain.errors import Interrupted

INTERRUPT_SIGNALS = ("SIGINT", "SIGTERM")
GRACE_S = 5.0  # how long the main thread has to take a signal before the watcher ends the process


def _message(name: str, phase: str) -> str:
    return (f"stopped by {name} during {phase} (outside the training loop); run the same command again: it "
            "resumes from the newest checkpoint")


class StartupSignals:
    """See the module docstring. `phase`: what the process is doing (`start-up`, `shutdown`), None while the
    training loop's own handler has the signals; `on_stuck`: called by the watcher before it ends the process."""

    def __init__(self, *, grace_s: float = GRACE_S) -> None:
        self.phase: str | None = "start-up"
        self.on_stuck: Callable[[], None] | None = None
        self.grace_s = grace_s
        self._previous: dict[int, Any] = {}
        self._taken = threading.Event()
        self._wakeup: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None
        self._previous_fd = -1
        if threading.current_thread() is not threading.main_thread():  # signal.signal works only there
            return
        for name in INTERRUPT_SIGNALS:
            signum = int(getattr(signal, name))
            self._previous[signum] = signal.signal(signum, self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter's main thread after all: no watcher
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="leantrain-startup-signals",
                                         daemon=True)
        self._watcher.start()

    def _handle(self, signum: int, frame: object) -> None:
        self._taken.set()
        for other in self._previous:
            signal.signal(other, signal.SIG_DFL)
        if self.phase is None:  # the training loop: only an operator's second signal gets here (PreemptionHandler)
            signal.raise_signal(signum)
            return
        name = signal.Signals(signum).name
        raise Interrupted(_message(name, self.phase), signal_name=name)

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 1)
            except OSError:
                return
            if not data:  # restore() closed the pipe
                return
            signum, phase = data[0], self.phase
            if signum not in self._previous or phase is None or signal.getsignal(signum) != self._handle:
                continue  # not ours to take: the training loop's handler (or the default, after the first) has it
            if self._taken.wait(self.grace_s):
                continue
            # The main thread is blocked in C++ (a collective or the rendezvous waiting for a dead peer).
            with contextlib.suppress(Exception):
                if self.on_stuck is not None:
                    self.on_stuck()
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), f"error: {_message(signal.Signals(signum).name, phase)}\n".encode())
            os._exit(128 + signum)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._wakeup is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_fd)
            read_fd, write_fd = self._wakeup
            os.close(write_fd)  # the watcher reads end-of-file and ends
            if self._watcher is not None:
                self._watcher.join(timeout=1.0)
            with contextlib.suppress(OSError):
                os.close(read_fd)
            self._wakeup = None
