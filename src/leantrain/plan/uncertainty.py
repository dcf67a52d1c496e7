"""P10–P90 ranges for every time, GPU-hour and cost figure, from the spread of the planner's calibration
residuals on published runs (plan/published_runs.yaml; docs/plan.md says what the range covers).

A residual is log(measured / predicted) of a run the constants were not fitted on. The range of a prediction
x is [x·e^{r10}, x·e^{r50}, x·e^{r90}], where r10 and r90 are split-conformal quantiles of the residuals (Lei et
al. 2018, "Distribution-free predictive inference for regression", JASA 113:1094: of n residuals, the
⌊0.1(n + 1)⌋-th and ⌈0.9(n + 1)⌉-th smallest, which keep ≥ 80 % coverage for an exchangeable new run where plain
empirical quantiles of few residuals undercover) and r50 their median. Why this method and not the normal-theory
prediction interval mean ± t_{0.90,n−1}·s·√(1 + 1/n): one method serves both ranges, and the step-time
residuals are skewed and not normal (58 stack-out residuals: skewness 0.49, Shapiro–Wilk p = 0.005), so
a symmetric t interval is mis-specified there; the order statistics need only exchangeable runs. In the
held-out check a half's whole-run range uses that half's residuals at the efficiency fitted on the same half:
for a fit that is one multiplicative constant this is exactly the jackknife+ interval with signed residuals,
0.1 per tail (Barber, Candès, Ramdas and Tibshirani 2021, "Predictive inference with the jackknife+", Ann.
Statist. 49:486: the leave-one-out fit's shift cancels against the leave-one-out residual), whose guarantee is
weaker (≥ 1 − 2·0.2 = 60 %) but whose coverage in practice is the nominal one. Five sets,
widest where the spec leaves the most to assumption:
- step time, layout given: the step-time model on a published layout, each run predicted with the constants
  fitted on the runs of the other software stacks (leave one stack out, plan/published.py `stack`: a user's own
  stack is not among the calibration runs' either; `STEP_RANGE["layout"]`; split halves, which share stacks,
  gave 0.92-1.23x and held only 48 % of the runs outside the file, bench/published_heldout.yaml);
- step time, no layout given: the planner's own searched best against what the published layout measured
  (the planner's layout is not the one a team will run, and usually predicted faster: `STEP_RANGE["searched"]`);
- step time of a mixture-of-experts model: the MoE throughput runs (`moe_runs`), each predicted with the constants
  fitted on the dense runs and the MoE-layer overhead fitted on the runs of the other releases (one release left
  out at a time, plan/published_moe.py), widened to the dense range (`STEP_RANGE["moe"]`; the held-out check
  leaves one release out of the overhead and of the range, `moe_range_coverage`);
- whole run, fleet unknown (no `plan.whole_run_efficiency`, no `--calibrate`): published whole-run GPU-hours
  against the planner's, the whole-run efficiency fitted on the other half of the whole runs (`WHOLE_RUN_RANGE`);
- whole run, fleet known (its whole-run efficiency or calibrated runs in the spec): the step-time range.
The constants are what `bench/plan_accuracy.py` computes from the data file (a test recomputes them), and
its held-out checks are the coverage docs/plan.md reports: for the step range one stack left out of both the
constants and the range (`step_range_coverage`) and the runs outside the file; for the whole run each half's
range from that half alone, and for the whole runs (about twenty a half) the same check
over random half-splits (`whole_run_range_coverage_resampled`), whose mean is the range's expected coverage.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

# log(measured / predicted) at P10, P50, P90; recomputed by tests/test_plan_ranges.py from the data file.
# The searched and whole-run ranges move with the memory model (the planner searches layouts with it): refitted
# when torch pipelining's unsharded stage, its receive buffers and SP's gathered inputs were planned (2026-12-03),
# and the medians again when fp8 left the output head in bf16 (2026-12-04), and the searched and whole-run ranges
# when an interleaved pipeline stopped adding the gradients of chunks not yet in their backward to its peak
# and priced fewer micro-batches than stages as they run (2026-12-04), and the whole-run range when 19 published
# whole runs were added to the 21 (2026-12-06: P90 1.36x -> 1.62x), and when MoE layers' fixed time per micro-batch
# was priced (2026-12-06: 0.76-1.62x -> 0.78-1.52x; the whole-run efficiency 0.75 -> 0.78), and when DeepSeek LLM
# 67B, Falcon-180B and OLMo 2 1B were added to the 40 (2026-12-06: 0.77-1.56x around 0.99x; efficiency 0.81) and
# MiniCPM-2.4B to those 43 (0.76-1.56x around 1.00x; efficiency 0.80), and the searched and whole-run ranges when
# the search kept only layouts the spec rules accept (2026-12-06: dp × micro-batch divides the global batch, tp
# divides the KV heads and the FFN; OPT-175B's and DeepSeek LLM 67B's searched layouts changed: searched 0.92-1.69x
# around 1.05x -> 0.92-1.66x around 1.04x, whole run 0.77-1.56x around 0.99x; efficiency 0.81).
# The MoE range (2026-12-06): 16 MoE runs of 9 releases, measured 0.78-2.33x the planned step time, median 1.23x,
# before the MoE layers' fixed time per micro-batch was priced (plan/inputs.py MOE_LAYER_OVERHEAD_S); with it, and
# each release predicted with the overhead fitted on the others, 0.69-1.77x around 1.01x.
# The layout range (2026-12-06): each run's constants fitted without its software stack, 0.82-1.21x around 0.97x; from
# split halves (which share stacks) it was 0.92-1.23x around 1.00x. Full recompute then stopped repeating the output
# projection (every stack) and, with torch's early stop (this trainer, torchtitan: `plan.recompute_early_stop`), a
# dense block's down projection and the TP collective after it (2026-12-06): torchtitan's full-AC 70B rows 0.85x ->
# 0.90x of the measured tokens/s; layout 0.81-1.24x around 0.99x, searched 0.92-1.66x around 1.05x, whole run
# 0.77-1.56x around 0.99x.
STEP_RANGE = {"layout": (-0.2063, -0.0063, 0.217), "searched": (-0.0879, 0.0464, 0.5062),
              "moe": (-0.3709, 0.0123, 0.5691)}
WHOLE_RUN_RANGE = (-0.2652, -0.0083, 0.4439)


def conformal_range(residuals: Iterable[float]) -> tuple[float, float, float]:
    """(P10, P50, P90) of log residuals: split-conformal order statistics and the median, 4 decimals."""
    s = sorted(residuals)
    n = len(s)
    if n == 0:
        raise ValueError("a range needs at least one residual")
    lo = s[max(1, math.floor(0.1 * (n + 1))) - 1]
    hi = s[min(n, math.ceil(0.9 * (n + 1))) - 1]
    return round(lo, 4), round(statistics.median(s), 4), round(hi, 4)


def scaled(value: float, offsets: tuple[float, float, float]) -> tuple[float, float, float]:
    """(P10, P50, P90) of a predicted quantity (time, GPU-hours, cost: all scale with the step time)."""
    return tuple(value * math.exp(r) for r in offsets)  # type: ignore[return-value]


def step_offsets(*, layout_given: bool, moe: bool = False) -> tuple[float, float, float]:
    """The step-time range; without a layout never narrower than with one; for a mixture-of-experts model the
    MoE runs' range and median, never narrower than the dense one."""
    if layout_given:
        dense = STEP_RANGE["layout"]
    else:
        (lo, mid, hi), (given_lo, _, given_hi) = STEP_RANGE["searched"], STEP_RANGE["layout"]
        dense = min(lo, given_lo), mid, max(hi, given_hi)
    if not moe:
        return dense
    lo, mid, hi = STEP_RANGE["moe"]
    return min(lo, dense[0]), mid, max(hi, dense[2])


def whole_run_offsets(*, layout_given: bool, fleet_known: bool, moe: bool = False) -> tuple[float, float, float]:
    """The whole-run range: the step-time range when the fleet's own efficiency is given, else the published
    whole runs' (which mostly ran layouts the planner had to search for), never narrower than the step's."""
    step = step_offsets(layout_given=layout_given, moe=moe)
    if fleet_known:
        return step
    lo, mid, hi = WHOLE_RUN_RANGE
    return min(lo, step[0]), mid, max(hi, step[2])


def range_dict(name: str, offsets: tuple[float, float, float], value: float) -> dict[str, float]:
    p10, p50, p90 = scaled(value, offsets)
    return {f"{name}_p10": p10, f"{name}_p50": p50, f"{name}_p90": p90}
