"""Measured communication time: the seconds of one step spent inside collectives (`comm_s` in metrics.jsonl).

FSDP's all-gathers and reduce-scatters, TP's DTensor redistributions, the pipeline's send/recv and the
expert all-to-alls are issued from inside hooks and autograd, so no wrapper around one call can time
them. The PyTorch profiler sees every one: on the host side the c10d/gloo operators and the waits on
asynchronous work, on a GPU the NCCL kernels. `comm_s` is the length of the union of those intervals
(nested and overlapping events counted once). On a GPU the kernel time is used: it is the time the
network was busy, whether or not compute overlapped it.

Profiling has overhead, so the trainer measures one step per log interval (`CommTimer.measure`) and
reports that step's value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

HOST_PREFIXES = ("c10d::", "gloo:", "nccl:", "_c10d_functional::", "c10d_functional::")
HOST_NAMES = ("record_param_comms",)


@dataclass
class CommMeasurement:
    """Filled when the `measure` block exits."""

    comm_s: float = 0.0
    num_events: int = 0


def is_comm_event(name: str) -> bool:
    """True for collective, point-to-point and wait operators (host side)."""
    return name.startswith(HOST_PREFIXES) or name in HOST_NAMES


def union_seconds(intervals_us: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals given in microseconds, in seconds."""
    total_us, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals_us):
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total_us += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total_us += current_end - current_start
    return total_us / 1e6


def comm_seconds(events: Iterable[FunctionEvent], *, device_type: str) -> tuple[float, int]:
    """(seconds in communication, number of events) from a profiler's event list."""
    host, device = [], []
    for event in events:
        if device_type == "cuda" and "nccl" in event.name.lower() and event.device_type.name == "CUDA":
            device.append((event.time_range.start, event.time_range.end))
        elif is_comm_event(event.name):
            host.append((event.time_range.start, event.time_range.end))
    chosen = device if device else host
    return union_seconds(chosen), len(chosen)


class CommTimer:
    """Measures `comm_s` of the code inside `measure()` with the PyTorch profiler."""

    def __init__(self, *, device_type: str) -> None:
        self.device_type = device_type
        self.activities = [ProfilerActivity.CPU]
        if device_type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)

    @contextlib.contextmanager
    def measure(self) -> Iterator[CommMeasurement]:
        result = CommMeasurement()
        with profile(activities=self.activities, record_shapes=False) as prof:
            yield result
        result.comm_s, result.num_events = comm_seconds(prof.events(), device_type=self.device_type)


def control_backend() -> str:
    """The backend of the control-plane groups (checkpoint agreement, saves, the memory tier): gloo, which works
    beside NCCL and on the CPU; under `leantrain rehearse`'s fake process group the fake backend, since a real
    gloo group cannot be built on a fake store."""
    import torch.distributed as dist

    return "fake" if dist.is_initialized() and dist.get_backend() == "fake" else "gloo"
