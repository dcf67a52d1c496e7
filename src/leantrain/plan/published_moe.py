"""The mixture-of-experts throughput runs (`moe_runs` in plan/published_runs.yaml): the one constant fitted on them,
the MoE layers' fixed time per micro-batch (plan/inputs.py MOE_LAYER_OVERHEAD_S), and the residuals of an MoE plan's
step range, each release left out of the fit (and of the range, in the held-out check) at a time."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from leantrain.plan.published import Fit, PublishedRun, grid_min, measured_tokens_per_gpu_s, predicted_with

MOE_OVERHEAD_GRID = [round(0.00025 * i, 5) for i in range(41)]  # seconds per MoE layer and micro-batch, 0 ... 10 ms
MoETerms = list[tuple[str, float, float, float]]  # per MoE run: release, measured, bare and per-second step times


def release(run: PublishedRun) -> str:
    """The release an MoE run comes from: its name's first field (dgxc2504, mb2509, nemo2502, ...)."""
    return run.name.split("-", 1)[0]


def _moe_step_terms(runs: tuple[PublishedRun, ...] | list[PublishedRun], fit: Fit) -> MoETerms:
    """Per MoE run: release, measured step time, step time predicted with `fit` and no MoE-layer overhead, and the
    seconds a second of overhead adds (it enters linearly, timing.py), so fitting it is arithmetic."""
    out = []
    for run in runs:
        tokens = run.global_batch_seqs * run.seq_len / run.gpus
        bare = tokens / predicted_with(run, replace(fit, moe_layer_overhead_s=0.0))
        per_second = tokens / predicted_with(run, replace(fit, moe_layer_overhead_s=1.0)) - bare
        out.append((release(run), tokens / measured_tokens_per_gpu_s(run), bare, per_second))
    return out


def _moe_residuals(terms: MoETerms, overhead_s: float) -> list[float]:
    """log(measured / predicted step time) at a given MoE-layer overhead: the ranges' residual (log_errors)."""
    return [math.log(measured / (bare + overhead_s * per_second)) for _, measured, bare, per_second in terms]


def _fit_overhead(terms: MoETerms) -> float:
    return grid_min(MOE_OVERHEAD_GRID, lambda x: statistics.median(abs(e) for e in _moe_residuals(terms, x)))


def _leave_one_release_out(terms: MoETerms) -> list[float]:
    """Each run's residual at the overhead fitted on the other releases' runs, in the order of `terms`."""
    fitted = {group: _fit_overhead([t for t in terms if t[0] != group]) for group in {t[0] for t in terms}}
    return [_moe_residuals([t], fitted[t[0]])[0] for t in terms]


def fit_moe_layer_overhead(runs: tuple[PublishedRun, ...], fit: Fit) -> float:
    """The MoE-layer overhead (s per MoE layer and micro-batch, plan/inputs.py MOE_LAYER_OVERHEAD_S) with the
    smallest median |log error| over the MoE runs, the dense constants `fit` held."""
    return _fit_overhead(_moe_step_terms(runs, fit))


def moe_residuals_out_of_sample(runs: tuple[PublishedRun, ...], fit: Fit) -> list[float]:
    """log(measured / predicted step time) of every MoE run (in order), the overhead fitted on the other releases'
    runs (a release shares one stack and mostly one configuration: halves would hold near-copies on both sides)."""
    return _leave_one_release_out(_moe_step_terms(runs, fit))


def moe_range_coverage(runs: tuple[PublishedRun, ...], fit: Fit) -> dict[str, Any]:
    """Held-out check of the MoE step range: one release left out at a time, the overhead and the range (from their
    own leave-one-release-out residuals) from the other releases' runs; the share of its step times inside."""
    from leantrain.plan.uncertainty import conformal_range

    terms = _moe_step_terms(runs, fit)
    inside, groups, covered = 0.0, sorted({t[0] for t in terms}), 0
    for group in groups:
        calib, held = [t for t in terms if t[0] != group], [t for t in terms if t[0] == group]
        lo, _, hi = conformal_range(_leave_one_release_out(calib))
        share = sum(lo <= e <= hi for e in _moe_residuals(held, _fit_overhead(calib))) / len(held)
        inside += share * len(held)
        covered += share == 1.0
    return {"runs": inside / len(runs), "releases": covered / len(groups), "n_releases": len(groups)}
