"""The `model_ready` event: the model is built, sharded and initialised (or loaded) on every rank.

Each rank reports its peak host RSS, its device's peak memory and the bytes of parameters it holds; rank 0
gathers them and appends one record to the run dir's `events.jsonl`:

    {"kind": "model_ready", "param_bytes_total": ..., "world_size": N, "layout": "...",
     "ranks": [{"rank", "host_rss_peak_bytes", "host_rss_base_bytes", "device_mem_peak_bytes",
                "param_bytes_local"}, ...]}

`host_rss_base_bytes` is the resident memory just before the model was built (imports, data, process group),
so `host_rss_peak_bytes − host_rss_base_bytes` is what building the model cost this rank. On a CPU device
`device_mem_peak_bytes` is the host's peak RSS (the device is the host).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.observe.metrics import host_rss_peak_bytes, peak_memory_bytes
from leantrain.observe.report_data import append_event

MODEL_READY = "model_ready"


def local_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of parameters this rank holds (its shards; a parameter shared by two modules counted once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            seen[id(param)] = local.numel() * local.element_size()
    return sum(seen.values())


def rank_memory(
    *, rank: int, modules: Iterable[nn.Module], device: torch.device, base_rss_bytes: int
) -> dict[str, int]:
    """This rank's entry of the event."""
    return {
        "rank": rank, "host_rss_peak_bytes": host_rss_peak_bytes(), "host_rss_base_bytes": base_rss_bytes,
        "device_mem_peak_bytes": peak_memory_bytes(device), "param_bytes_local": local_param_bytes(modules),
    }


def record_model_ready(
    run_dir: Path, *, entry: dict[str, int], world_size: int, distributed: bool, **fields: Any
) -> dict[str, Any] | None:
    """Gather every rank's entry on rank 0 and append the event there; returns the record on rank 0, else None."""
    entries: list[Any] = [entry]
    if distributed:  # to rank 0 alone: an all-gather handed every rank every rank's entry (world² at 16,384 ranks)
        entries = [None] * world_size if entry["rank"] == 0 else None  # type: ignore[assignment]
        dist.gather_object(entry, entries, dst=0)
    if entry["rank"] != 0:
        return None
    return append_event(run_dir, MODEL_READY, world_size=world_size, ranks=entries, **fields)
