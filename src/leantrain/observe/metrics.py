"""Training metrics: the logger that fans records out to sinks, and the derived numbers (MFU, memory, peak).

MFU = model FLOPs per token × tokens/s per device / peak FLOP/s of the device (PaLM's definition, as
torchtitan's metrics). FLOPs per token come from `leantrain.plan.flops` (the planner's function, so the
plan and the run agree by construction). The peak is the catalog's for the accelerator and compute dtype
(`hardware.peak_flops` in the spec overrides it); on a CPU it is measured once with a matmul
(`hardware.measure_cpu_peak_flops`) and recorded, because CPUs differ by orders of magnitude.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from leantrain.hardware import get_accelerator, host_cpu_peak_flops
from leantrain.observe.sinks import JsonlSink, Sink, TensorBoardSink
from leantrain.spec.schema import HardwareSpec

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"


class MetricsLogger:
    """Sends every record to every sink, in order. Holds no metric logic itself."""

    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self.sinks: list[Sink] = list(sinks)

    def add_sink(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def log(self, record: dict[str, Any]) -> None:
        record.setdefault("time", time.time())  # wall clock: hang and timeline checks need it
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_metrics_logger(
    run_dir: Path, *, tensorboard: bool, enabled: bool = True, extra_sinks: Sequence[Sink] = ()
) -> MetricsLogger:
    """metrics.jsonl always, TensorBoard under tb/ when asked; `enabled=False` (ranks ≠ 0) logs nowhere."""
    if not enabled:
        return MetricsLogger()
    sinks: list[Sink] = [JsonlSink(Path(run_dir) / METRICS_FILE)]
    if tensorboard:
        sinks.append(TensorBoardSink(Path(run_dir) / TENSORBOARD_DIR))
    return MetricsLogger([*sinks, *extra_sinks])


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), in bytes; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def host_rss_peak_bytes() -> int:
    """This process's peak resident set size so far (the kernel's high-water mark, VmHWM)."""
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)  # Linux reports KiB, macOS bytes


def host_rss_bytes() -> int:
    """This process's resident set size now (VmRSS; where /proc is missing, the peak, the best available)."""
    current = _proc_status_bytes("VmRSS")
    return host_rss_peak_bytes() if current is None else current


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA caching allocator's peak on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return host_rss_peak_bytes()


def resolve_peak_flops(hardware: HardwareSpec, *, device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from: "spec", "measured" or "catalog:<name>")."""
    if hardware.peak_flops is not None:
        return hardware.peak_flops, "spec"
    if device.type == "cpu":
        return host_cpu_peak_flops(dtype), "measured"
    accelerator = get_accelerator(hardware.accelerator)
    return accelerator.peak_for(dtype), f"catalog:{accelerator.name}"


def mfu(*, flops_per_token: float, tokens_per_s_per_device: float, peak_flops: float) -> float:
    """Model FLOPs utilisation, a fraction in [0, 1] (more than 1 means the peak is wrong)."""
    return flops_per_token * tokens_per_s_per_device / peak_flops if peak_flops > 0 else 0.0


def console_line(record: dict[str, Any]) -> str:
    """One line per logged step, in the style of torchtitan/Megatron logs."""
    parts = [f"step {record['step']:>6}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:8.4f}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:7.3f}")
    parts.append(f"lr {record.get('lr', 0.0):.2e}")
    parts.append(f"mem {record.get('mem_bytes', 0) / 2**30:5.2f}GiB")
    parts.append(f"tok/s {record.get('tokens_per_s', 0.0):>9,.0f}")
    parts.append(f"mfu {100 * record.get('mfu', 0.0):5.2f}%")
    parts.append(f"dt {1000 * record.get('step_time_s', 0.0):6.0f}ms")
    if "moe_load_max_over_min" in record:
        parts.append(f"moe max/min {record['moe_load_max_over_min']:4.2f}")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    return "  ".join(parts)
