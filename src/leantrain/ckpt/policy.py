"""When to checkpoint: a fixed step interval, or Young/Daly's optimum re-tuned from measured save times.

Young (1974) / Daly (2006): with checkpoint cost δ and mean time between failures M, the interval that
minimises expected lost time is τ ≈ sqrt(2·δ·M). M for a job is 1 / (failure rate per GPU-day × GPUs).
The default rate comes from Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in 54 days
on 16,384 GPUs. The first interval is the planner's (`leantrain.plan.budget.checkpoint_interval`: δ is the time
a save blocks training, the full write or, for async saves, the device-to-host copy); after each save the
manager re-tunes δ from the measured stall with `young_daly_interval_s`, the same formula.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leantrain.spec import JobSpec

SECONDS_PER_DAY = 86400.0
LLAMA3_FAILURES_PER_GPU_DAY = 419 / (54 * 16384)
EMA_WEIGHT = 0.5


def young_daly_interval_s(*, save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of training between saves) that minimises expected lost time: Daly's
    higher-order form (the planner's, so plan and run agree), which is Young's sqrt(2·δ·M) for δ ≪ M."""
    from leantrain.plan.budget import daly_interval_s

    return daly_interval_s(blocking_s=max(save_s, 0.0), mtbf_s=mtbf_s)


def job_mtbf_s(*, failures_per_gpu_day: float | None, num_gpus: int) -> float:
    """Mean time between failures of a job on `num_gpus` GPUs, seconds."""
    rate = failures_per_gpu_day if failures_per_gpu_day is not None else LLAMA3_FAILURES_PER_GPU_DAY
    return SECONDS_PER_DAY / (rate * max(num_gpus, 1))


def planned_auto_interval(spec: JobSpec, *, world_size: int) -> AutoInterval:
    """The planner's Young/Daly start (its blocking save time δ and job MTBF at this world size)."""
    from leantrain.plan.budget import checkpoint_interval
    from leantrain.plan.inputs import plan_inputs
    from leantrain.plan.layout import layout_from_spec

    # step_s only turns seconds into steps in the planner's answer; the manager works in seconds. The spec's layout
    # (when it is the one running) sizes an async save's device-to-host copy, the whole replica at ZeRO-0.
    layout = layout_from_spec(spec.parallelism, spec.training) if spec.parallelism.world_size == world_size else None
    planned = checkpoint_interval(spec, plan_inputs(spec), num_gpus=max(world_size, 1), step_s=1.0, layout=layout)
    return AutoInterval(initial_save_s=float(planned["blocking_s"]), mtbf_s=float(planned["mtbf_s"]))


class AutoInterval:
    """Young/Daly interval in seconds, re-tuned after every save from the measured training stall.

    For async saves δ is the stall (staging), but a save cannot be issued faster than the previous one
    finishes writing, so the interval is at least the last write time.
    """

    def __init__(self, *, initial_save_s: float, mtbf_s: float) -> None:
        self.save_s = initial_save_s
        self.mtbf_s = mtbf_s
        self.min_interval_s = 0.0
        self.num_measured = 0

    @property
    def interval_s(self) -> float:
        return max(young_daly_interval_s(save_s=self.save_s, mtbf_s=self.mtbf_s), self.min_interval_s)

    def observe(self, *, stall_s: float, write_s: float) -> None:
        self.save_s = stall_s if self.num_measured == 0 else EMA_WEIGHT * stall_s + (1 - EMA_WEIGHT) * self.save_s
        self.min_interval_s = write_s
        self.num_measured += 1


class PreemptionHandler:
    """Turns SIGTERM/SIGUSR1 (spot reclaim, Slurm time limit) into a flag the training loop polls.

    A handler may not do I/O or collectives safely, so it only records the signal. A second signal restores
    the previous handler and re-raises, so an impatient operator can still stop the process.
    """

    def __init__(self, signal_names: Iterable[str]) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; the flag can still be set by request()
        for name in signal_names:
            signum = int(getattr(signal, name))
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            previous = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name

    def request(self, reason: str = "requested") -> None:
        """Ask for a save-and-exit without a signal (tests, a scheduler API notice)."""
        self.received = reason

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


Clock = Callable[[], float]
