"""Cost and idle accounting: the share of GPU time lost to data wait, pipeline bubble, restarts and checkpoint
stalls, priced with the spec's GPU-hour price.

Formulas (docs/observe.md): each logged record stands for the steps since the previous record, so a metric
`x_s` contributes Δsteps × x_s seconds. Bubble: metrics `bubble_s` when the trainer measures it, else the
1F1B/GPipe share (pp − 1) / (m + pp − 1) of compute (m micro-batches per step; interleaving divides the
bubble by the virtual stages). Restarts: each `restart` event's `recovery_s` plus the steps redone after a
resume × the median step time. Checkpoint stalls: each `checkpoint_saved` event's `stall_s` (the time the
loop was blocked; for a synchronous save that is its `duration_s`). GPU-hours = seconds × GPUs / 3600.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from leantrain.observe.report_data import RunData, as_float, median_finite


@dataclass(frozen=True)
class IdleItem:
    """One way GPU time was lost."""

    name: str
    seconds: float
    share: float
    gpu_hours: float
    cost: float | None
    evidence: str
    counted: bool = True  # False for rows shown for context but not summed as idle (communication)


@dataclass
class CostSummary:
    """Wall time, GPU-hours, price and the idle breakdown of one run."""

    num_gpus: int
    wall_s: float
    gpu_hours: float
    price_per_gpu_hour: float | None
    price_source: str
    total_cost: float | None
    items: list[IdleItem] = field(default_factory=list)

    @property
    def idle_share(self) -> float:
        return sum(i.share for i in self.items if i.counted)

    @property
    def idle_cost(self) -> float | None:
        costs = [i.cost for i in self.items if i.counted]
        return None if any(c is None for c in costs) else float(sum(c for c in costs if c is not None))


def step_weights(steps: np.ndarray) -> np.ndarray:
    """Steps each record stands for: the gap to the previous record (the median gap after a resume)."""
    if steps.size == 0:
        return steps
    gaps = np.diff(steps)
    typical = float(np.median(gaps[gaps > 0])) if np.any(gaps > 0) else 1.0
    weights = np.empty_like(steps)
    weights[0] = min(steps[0], typical) if steps[0] > 0 else typical
    weights[1:] = np.where(gaps > 0, gaps, typical)
    return weights


def _weighted_sum(run: RunData, key: str, weights: np.ndarray) -> float:
    _, values = run.series(key)
    mask = np.isfinite(values)
    return float(np.sum(values[mask] * weights[mask])) if values.size else 0.0


def _plan_layout(run: RunData) -> dict[str, Any]:
    layout = run.plan_get("layout")
    return layout if isinstance(layout, dict) else {}  # absent, or not an object in a hand-edited plan.json


def num_microbatches(run: RunData) -> int | None:
    """Micro-batches per step per pipeline: plan layout, else spec batch / (seq_len × micro_batch × dp)."""
    layout = _plan_layout(run)
    if isinstance(layout.get("num_microbatches"), int):
        return int(layout["num_microbatches"])
    batch, seq_len = run.spec_get("training.global_batch_tokens"), run.spec_get("data.seq_len")
    micro = layout.get("micro_batch") or run.spec_get("training.micro_batch")
    dp = layout.get("dp") or run.spec_get("parallelism.data_parallel") or 1
    if all(isinstance(v, int) and v > 0 for v in (batch, seq_len, micro, dp)):
        return max(1, batch // (seq_len * micro * dp))
    return None


def bubble_seconds(run: RunData, compute_s: float, weights: np.ndarray) -> tuple[float, str]:
    if run.has("bubble_s"):
        return _weighted_sum(run, "bubble_s", weights), "measured (metrics bubble_s)"
    layout = _plan_layout(run)
    pp = layout.get("pp") or run.spec_get("parallelism.pipeline_parallel") or 1
    if not isinstance(pp, int) or pp <= 1:
        return 0.0, "no pipeline parallelism (pp = 1)"
    m = num_microbatches(run)
    if m is None:
        return 0.0, f"pp = {pp} but the micro-batch count is unknown (no plan layout or spec in the run dir)"
    virtual = run.spec_get("parallelism.virtual_stages")
    virtual = virtual if isinstance(virtual, int) and virtual > 0 else 1
    fraction = (pp - 1) / virtual / (m + (pp - 1) / virtual)
    return fraction * compute_s, f"(pp−1)/(m+pp−1) with pp={pp}, m={m}, v={virtual}: {fraction:.1%} of compute"


def restart_seconds(run: RunData, median_step_s: float) -> tuple[float, str]:
    restarts = run.events_of("restart")
    recovery = sum(
        v for e in restarts if math.isfinite(v := as_float(e.get("recovery_s", e.get("duration_s"))))
    )
    steps, _ = run.series("loss")
    redone = 0.0
    for i in range(1, len(steps)):
        if steps[i] <= steps[i - 1]:
            redone += steps[i - 1] - steps[i] + 1
    redo_s = redone * median_step_s if math.isfinite(median_step_s) else 0.0
    evidence = f"{len(restarts)} restart event(s), {recovery:.1f} s recovering; {redone:.0f} step(s) redone"
    return recovery + redo_s, evidence


def checkpoint_stall_seconds(run: RunData) -> tuple[float, str]:
    saves = run.events_of("checkpoint_saved")
    total = 0.0
    for event in saves:
        stall = as_float(event.get("stall_s"))
        if not math.isfinite(stall) and not event.get("async", False):
            stall = as_float(event.get("duration_s"))
        if math.isfinite(stall):
            total += stall
    return total, f"{len(saves)} save(s) recorded in events.jsonl"


def cost_and_idle(run: RunData) -> CostSummary:
    """Where the run's GPU time went, priced when the run dir holds a spec or plan with a price."""
    steps, step_times = run.series("step_time_s")
    weights = step_weights(steps)
    compute_s = _weighted_sum(run, "step_time_s", weights)
    median_step_s = median_finite(step_times)
    bubble_s, bubble_why = bubble_seconds(run, compute_s, weights)
    restart_s, restart_why = restart_seconds(run, median_step_s)
    stall_s, stall_why = checkpoint_stall_seconds(run)
    wall_s = compute_s + restart_s + stall_s
    times = np.array([as_float(r.get("time")) for r in run.metrics], dtype=float)
    if times.size >= 2 and np.all(np.isfinite(times)):
        wall_s = max(wall_s, float(times.max() - times.min()) + (median_step_s if math.isfinite(median_step_s) else 0))
    num_gpus = max(1, run.world_size())
    price, source = run.price_per_gpu_hour()

    def item(name: str, seconds: float, evidence: str, counted: bool = True) -> IdleItem:
        gpu_hours = seconds * num_gpus / 3600
        return IdleItem(name=name, seconds=seconds, share=seconds / wall_s if wall_s > 0 else 0.0,
                        gpu_hours=gpu_hours, cost=None if price is None else gpu_hours * price,
                        evidence=evidence, counted=counted)

    items = [
        item("data wait", _weighted_sum(run, "data_wait_s", weights), "Σ Δsteps × data_wait_s"),
        item("pipeline bubble", bubble_s, bubble_why),
        item("restarts", restart_s, restart_why),
        item("checkpoint stalls", stall_s, stall_why),
        item("communication (in step)", _weighted_sum(run, "comm_s", weights),
             "Σ Δsteps × comm_s; lost only where not overlapped, so not summed", counted=False),
    ]
    gpu_hours = wall_s * num_gpus / 3600
    return CostSummary(
        num_gpus=num_gpus, wall_s=wall_s, gpu_hours=gpu_hours, price_per_gpu_hour=price, price_source=source,
        total_cost=None if price is None else gpu_hours * price, items=items,
    )
