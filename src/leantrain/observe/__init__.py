"""Observability: metrics records and their sinks (JSONL, TensorBoard; more sinks plug into MetricsLogger).

Names are imported lazily so that readers of a run dir (report, validate, doctor) do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MetricsLogger": "leantrain.observe.metrics",
    "build_metrics_logger": "leantrain.observe.metrics",
    "JsonlSink": "leantrain.observe.sinks",
    "Sink": "leantrain.observe.sinks",
    "TensorBoardSink": "leantrain.observe.sinks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'leantrain.observe' has no attribute {name!r}")
