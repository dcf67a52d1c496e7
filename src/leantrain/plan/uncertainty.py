"""P10–P90 ranges for every time, GPU-hour and cost figure, from the spread of the planner's calibration
residuals on published runs (plan/published_runs.yaml; docs/plan.md says what the range covers).

A residual is log(measured / predicted) of a run the constants were not fitted on. The range of a prediction
x is [x·e^{r10}, x·e^{r50}, x·e^{r90}], r50 the residuals' median. Two methods give r10 and r90:
- step-time ranges: split-conformal order statistics (`conformal_range`; Lei et al. 2018, "Distribution-free
  predictive inference for regression", JASA 113:1094: of n residuals, the ⌊0.1(n + 1)⌋-th and ⌈0.9(n + 1)⌉-th
  smallest, which keep ≥ 80 % coverage for an exchangeable new run where plain empirical quantiles of few
  residuals undercover). The step-time residuals are skewed and not normal (the 58 stack-out ones: skewness 0.39,
  Shapiro–Wilk p = 0.011), so a symmetric interval is mis-specified there; the order statistics need only
  exchangeable runs.
- the whole-run range: the normal-theory prediction interval of one new residual, mean ± t_{0.90,n−1}·s·√(1 + 1/n)
  (`prediction_range`). Its 44 out-of-sample residuals are consistent with a normal (Shapiro–Wilk p = 0.64,
  skewness 0.37), and over 2,000 random half-splits (`whole_run_range_coverage_resampled`) it held 80.2 % of
  the other half on average against the order statistics' 82.6 %, with 63 % of single halves inside 70–90 %
  against 54 % and a narrower range (P90/P10 2.01× against 2.16×): with ~22 residuals a half, the 2nd and the
  21st smallest move with one extreme run, the mean and s much less. Chosen 2026-12-07 on those resampled
  figures (bench/RESULTS.md lists the other estimators scored on them).
In the held-out check a half's whole-run range uses that half's residuals at the efficiency fitted on the same
half; the prediction interval is centred on the residuals' mean, so the fitted efficiency (one multiplicative
constant) moves the range and the held-out residuals alike and drops out. Five sets,
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
# each release predicted with the overhead fitted on the others, 0.69-1.77x around 1.01x. The memory-bound pass
# then read the routed rows whole where the experts are split over TP (2026-12-07): 0.70-1.77x around 1.01x.
# The layout range (2026-12-06): each run's constants fitted without its software stack, 0.82-1.21x around 0.97x; from
# split halves (which share stacks) it was 0.92-1.23x around 1.00x. Full recompute then stopped repeating the output
# projection (every stack) and, with torch's early stop (this trainer, torchtitan: `plan.recompute_early_stop`), a
# dense block's down projection and the TP collective after it (2026-12-06): torchtitan's full-AC 70B rows 0.85x ->
# 0.90x of the measured tokens/s; layout 0.81-1.24x around 0.99x, searched 0.92-1.66x around 1.05x, whole run
# 0.77-1.56x around 0.99x.
# The whole-run range from the prediction interval in place of the order statistics (2026-12-07): 0.77-1.56x
# -> 0.74-1.46x around 0.99x.
STEP_RANGE = {"layout": (-0.2063, -0.0063, 0.217), "searched": (-0.0879, 0.0464, 0.5062),
              "moe": (-0.3617, 0.0125, 0.5691)}
WHOLE_RUN_RANGE = (-0.3077, -0.0083, 0.3751)


def conformal_range(residuals: Iterable[float]) -> tuple[float, float, float]:
    """(P10, P50, P90) of log residuals: split-conformal order statistics and the median, 4 decimals."""
    s = sorted(residuals)
    n = len(s)
    if n == 0:
        raise ValueError("a range needs at least one residual")
    lo = s[max(1, math.floor(0.1 * (n + 1))) - 1]
    hi = s[min(n, math.ceil(0.9 * (n + 1))) - 1]
    return round(lo, 4), round(statistics.median(s), 4), round(hi, 4)


def student_t_quantile(p: float, dof: int) -> float:
    """The p-quantile of Student's t with `dof` degrees of freedom, from the normal quantile by the
    Cornish-Fisher expansion to 1/dof⁴ (Abramowitz and Stegun 1964, 26.7.5): at p = 0.9 within 3e-5 of the
    exact value for dof ≥ 5 (1.3232 at 21, 1.3016 at 43)."""
    if dof < 5:
        raise ValueError(f"Student's t quantile: {dof} degrees of freedom; the expansion needs at least 5")
    x = statistics.NormalDist().inv_cdf(p)
    g = ((x**3 + x) / 4, (5 * x**5 + 16 * x**3 + 3 * x) / 96,
         (3 * x**7 + 19 * x**5 + 17 * x**3 - 15 * x) / 384,
         (79 * x**9 + 776 * x**7 + 1482 * x**5 - 1920 * x**3 - 945 * x) / 92160)
    return x + sum(gi / dof ** (i + 1) for i, gi in enumerate(g))


def prediction_range(residuals: Iterable[float]) -> tuple[float, float, float]:
    """(P10, P50, P90) of log residuals: the normal-theory prediction interval of one new residual,
    mean ± t(0.90, n−1)·s·√(1 + 1/n), and the median, 4 decimals; at least 6 residuals."""
    s = list(residuals)
    n = len(s)
    if n < 6:
        raise ValueError(f"a prediction interval needs at least 6 residuals, got {n}")
    half = student_t_quantile(0.9, n - 1) * statistics.stdev(s) * math.sqrt(1 + 1 / n)
    mean = statistics.fmean(s)
    return round(mean - half, 4), round(statistics.median(s), 4), round(mean + half, 4)


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
