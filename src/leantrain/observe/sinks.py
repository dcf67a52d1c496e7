"""Metric sinks: where each metrics record goes. A sink is anything with `write(record)` and `close()`.

The trainer never knows which sinks exist: `MetricsLogger` (observe.metrics) fans each record out, so a
Prometheus endpoint or an alert evaluator is added by passing one more sink, not by editing the loop.
- JsonlSink: one JSON object per line, flushed per record (a crash loses nothing already logged).
  Non-finite floats are written as null (JSON has no NaN) and the key is listed under `nonfinite`.
- TensorBoardSink: every numeric leaf as a scalar at the record's `step`; nested dicts and lists become
  `parent/child` tags (`loss_by_source/en`, `moe_expert_load/layer1/3`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    """A destination for metrics records."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _json_safe(value: Any, path: str, nonfinite: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(path)
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v, f"{path}.{k}" if path else str(k), nonfinite) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v, f"{path}.{i}", nonfinite) for i, v in enumerate(value)]
    return value


class JsonlSink:
    """Appends records to a JSONL file (the run dir's metrics.jsonl)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        nonfinite: list[str] = []
        safe = _json_safe(record, "", nonfinite)
        if nonfinite:
            safe["nonfinite"] = nonfinite
        self._handle.write(json.dumps(safe, default=str) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def numeric_leaves(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every int/float leaf of a nested record; booleans and strings are skipped."""
    for key, value in record.items():
        tag = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            yield tag, float(value)
        elif isinstance(value, dict):
            yield from numeric_leaves(value, tag)
        elif isinstance(value, list | tuple):
            yield from numeric_leaves({str(i): v for i, v in enumerate(value)}, tag)


class TensorBoardSink:
    """Writes TensorBoard event files under `log_dir` (the run dir's tb/)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in numeric_leaves(record):
            if tag != "step":
                self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
