"""Planner accuracy against published runs (src/leantrain/plan/published_runs.yaml), out of sample.

1. Step time: the step-time constants (a compute efficiency per accelerator family, one memory-bound pass
   count, the fp8 speed-up of the fp8 runs) are fitted on one half of the throughput runs and the other half
   is predicted, and the reverse; the median |predicted / measured − 1| of tokens per second per GPU is printed
   per half. Baseline, side by side: the sizing rule of thumb, a constant 40 % MFU (tokens/s = 0.4 × peak /
   FLOPs per token), which needs no fit.
2. Whole run: the planner's whole-run GPU-hours (step-time model on the published layout, or its own search
   when none is published, divided by the expected goodput and the whole-run efficiency) against the
   published GPU-hours. The step-time constants never see these runs; the whole-run efficiency is fitted on
   alternate runs and the median |error| is printed for the others, both ways. Baseline: 6·N·D at a
   constant 40 % MFU.
3. Held out: bench/published_heldout.yaml, runs no constant is fitted on (torchtitan's 500 W H100s, Trainy's
   H200s, LLM Foundry rows left out of the calibration file), predicted with the constants fitted on all
   calibration runs; median |error| overall, on Hopper rows, and the share inside the shipped P10–P90 range.
   MoE: the calibration file's `moe_runs` fit one constant of their own, the MoE layers' fixed time per
   micro-batch (the dense constants held; a part with no calibration run, B200, at its shipped efficiency); each
   release is predicted with it fitted on the other releases, and the step range is checked the same way.
4. P10–P90 ranges (plan/uncertainty.py): the share of held-out runs whose measured value falls inside the range
   built without them (target ~80 %) — for the step range each software stack left out of the constants and the
   range in turn, for the whole-run range each half's from the other half alone — and the shipped ranges (ratios
   measured / predicted). For whole runs also the same check over 2,000 random half-splits
   (seeded): their mean coverage, the share of single splits inside 70-90 % (with ~20 whole runs per half
   one run moves a half's coverage by 5 points) and the mean width P90/P10 (a range that covers by being wide
   is no better); beside it, as the baseline, the same figures for the order statistics (`conformal_range`),
   which the whole-run range used until 2026-12-07 and the step ranges still use.

Prints `name: value unit (ratio vs baseline)` lines.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

from leantrain.plan.published import (
    fit_constants,
    load_moe_runs,
    load_runs,
    measured_tokens_per_gpu_s,
    predicted_with,
    range_coverage,
    run_inputs,
    split_half_errors,
    split_halves,
    step_range_coverage,
    whole_run_gpu_hours,
    whole_run_range_coverage,
    whole_run_range_coverage_resampled,
    whole_run_split_errors,
)
from leantrain.plan.published_moe import fit_moe_layer_overhead, moe_range_coverage, moe_residuals_out_of_sample
from leantrain.plan.uncertainty import STEP_RANGE, WHOLE_RUN_RANGE, conformal_range

BASELINE_MFU = 0.40
HELD_OUT = Path(__file__).with_name("published_heldout.yaml")


def moe_ratios(moe_runs, fitted) -> list[tuple]:
    """(run, predicted / measured tokens/s with the MoE-layer overhead fitted on the other releases, the same without
    any overhead) per MoE run; tests/test_plan_ranges.py pins the direction."""
    bare = replace(fitted, moe_layer_overhead_s=0.0)
    residuals = moe_residuals_out_of_sample(moe_runs, fitted)  # log(predicted / measured tokens/s), as log_errors
    return [(run, math.exp(e), predicted_with(run, bare) / measured_tokens_per_gpu_s(run))
            for run, e in zip(moe_runs, residuals, strict=True)]


def baseline_tokens_per_gpu_s(run) -> float:
    inputs = run_inputs(run)
    return BASELINE_MFU * inputs.peak_flops / inputs.flops.model


def main() -> None:
    throughput, whole = load_runs()
    fitted = fit_constants(list(throughput))
    print(f"plan_accuracy_runs: {len(throughput)} throughput + {len(whole)} whole-run entries")
    print(f"plan_fit_all: {fitted!r}")
    base_errors = []
    for run in throughput:
        measured = measured_tokens_per_gpu_s(run)
        ratio = predicted_with(run, fitted) / measured
        base = baseline_tokens_per_gpu_s(run) / measured
        base_errors.append(abs(base - 1))
        print(f"plan_step_{run.name}: {ratio:.3f} predicted/measured ({base:.3f} with 40% MFU)")
    split = split_half_errors(throughput)
    base_median = statistics.median(base_errors)
    for key, label in (("error_b_with_fit_a", "half_b_fit_on_a"), ("error_a_with_fit_b", "half_a_fit_on_b")):
        print(f"plan_step_out_of_sample_{label}: {split[key]:.1%} median |error| "
              f"({split[key] / base_median:.2f}x of the 40%-MFU rule's {base_median:.1%})")
    print(f"plan_step_in_sample: {split['error_a_in_sample']:.1%} (half a), {split['error_b_in_sample']:.1%} (half b)")
    print(f"plan_fit_on_a: {split['fit_on_a']!r}; fit_on_b: {split['fit_on_b']!r}")
    a, b = split_halves(throughput)
    hopper = [abs(predicted_with(r, fit) / measured_tokens_per_gpu_s(r) - 1)
              for half, fit in ((b, split["fit_on_a"]), (a, split["fit_on_b"])) for r in half if r.family == "H100"]
    print(f"plan_step_out_of_sample_hopper_only: {statistics.median(hopper):.1%} median |error| ({len(hopper)} runs)")
    held, _ = load_runs(HELD_OUT)
    dense, held_hopper = [], []
    for run in held:
        ratio = predicted_with(run, fitted) / measured_tokens_per_gpu_s(run)
        dense.append(abs(ratio - 1))
        if run.family == "H100":
            held_hopper.append(abs(ratio - 1))
        print(f"plan_heldout_{run.name}: {ratio:.3f} predicted/measured ({run.accelerator})")
    inside = range_coverage(list(held), fitted, STEP_RANGE["layout"])
    p10 = STEP_RANGE["layout"][0]
    faster = range_coverage(list(held), fitted, (-math.inf, 0.0, p10))  # measured step below P10 (or at it)
    print(f"plan_heldout_median: {statistics.median(dense):.1%} median |error| ({len(dense)} dense runs; Hopper "
          f"{statistics.median(held_hopper):.1%} on {len(held_hopper)}); {inside:.0%} inside the shipped P10-P90 "
          f"step range, {faster:.0%} faster than its P10, {1 - inside - faster:.0%} slower than its P90")
    moe_runs = load_moe_runs()
    overhead = fit_moe_layer_overhead(moe_runs, fitted)
    moe_errors, bare_errors = [], []
    for run, ratio, before in moe_ratios(moe_runs, fitted):
        moe_errors.append(abs(ratio - 1))
        bare_errors.append(abs(before - 1))
        print(f"plan_moe_{run.name}: {ratio:.3f} predicted/measured tokens/s, MoE-layer overhead fitted on the other "
              f"releases ({before:.3f} without the overhead; {run.accelerator})")
    moe_cover = moe_range_coverage(moe_runs, fitted)
    lo, mid, hi = STEP_RANGE["moe"]
    print(f"plan_moe_layer_overhead: {overhead * 1e3:.2f} ms per MoE layer and micro-batch, fitted on all "
          f"{len(moe_runs)} MoE runs (the dense constants held)")
    print(f"plan_moe_median: {statistics.median(moe_errors):.1%} median |error| ({len(moe_runs)} MoE runs, one release "
          f"left out of the overhead's fit at a time; {statistics.median(bare_errors):.1%} without the overhead); "
          f"step range P10 {math.exp(lo):.3f}x, P50 {math.exp(mid):.3f}x, P90 {math.exp(hi):.3f}x; one release left "
          f"out of the overhead and the range: {moe_cover['runs']:.0%} of runs and {moe_cover['releases']:.0%} of "
          f"{moe_cover['n_releases']} releases inside the others' range")
    cover = step_range_coverage(throughput)
    stacks = "; ".join(f"{name} {share:.0%}" for name, share in cover.items() if name != "all")
    print(f"plan_step_range_coverage_by_stack: {cover['all']:.0%} of the {len(throughput)} runs inside the P10-P90 "
          f"range built with their stack left out of the constants and the range ({stacks})")
    for kind, (lo, mid, hi) in STEP_RANGE.items():
        print(f"plan_step_range_{kind}: P10 {math.exp(lo):.3f}x, P50 {math.exp(mid):.3f}x, P90 {math.exp(hi):.3f}x")
    errors, published, base_whole = [], [], []
    for run in whole:
        result = whole_run_gpu_hours(run)
        inputs = run_inputs(run)
        base_hours = 6 * inputs.shape.active_params() * run.tokens / (BASELINE_MFU * inputs.peak_flops) / 3600
        base_whole.append(abs(base_hours / run.gpu_hours - 1))
        errors.append(abs(result["error"]))
        if run.layout is not None:
            published.append(abs(result["error"]))
        print(f"plan_whole_{run.name}: {result['predicted_gpu_hours'] / 1e6:.3f}M GPU-h vs {run.gpu_hours / 1e6:.3f}M "
              f"published ({1 + result['error']:.3f}x; goodput {result['goodput']:.1%}, layout {result['layout']}, "
              f"MFU {result['mfu']:.1%}; 40% MFU rule {base_hours / run.gpu_hours:.3f}x)")
    print(f"plan_whole_median_error_published_layouts: {statistics.median(published):.1%} "
          f"({len(published)} runs, default whole-run efficiency)")
    print(f"plan_whole_median_error_all: {statistics.median(errors):.1%} "
          f"({statistics.median(errors) / statistics.median(base_whole):.2f}x of the 40%-MFU rule's "
          f"{statistics.median(base_whole):.1%}; in sample: the default is fitted on all of them)")
    ws = whole_run_split_errors(whole)
    print(f"plan_whole_efficiency_fit: {ws['fit_on_all']} on all, {ws['fit_on_a']} on half a, {ws['fit_on_b']} "
          f"on half b; without it (efficiency 1) {ws['error_all_unfitted']:.1%} median |error|")
    rule = statistics.median(base_whole)
    for key, label in (("error_b_with_fit_a", "half_b_fit_on_a"), ("error_a_with_fit_b", "half_a_fit_on_b")):
        print(f"plan_whole_out_of_sample_{label}: {ws[key]:.1%} median |error| "
              f"({ws[key] / rule:.2f}x of the 40%-MFU rule's {rule:.1%})")
    cover = whole_run_range_coverage(ws)
    for key in ("b_with_range_from_a", "a_with_range_from_b"):
        lo, hi = cover[f"{key}_range"]
        print(f"plan_whole_range_coverage_{key}: {cover[key]:.0%} of held-out runs inside P10-P90 "
              f"({math.exp(lo):.3f}x-{math.exp(hi):.3f}x of the predicted GPU-hours, P90/P10 {math.exp(hi - lo):.2f}x)")
    many = whole_run_range_coverage_resampled(ws)
    print(f"plan_whole_range_coverage_resampled: {many['mean']:.1%} mean over {many['splits']:.0f} random half-splits "
          f"of {len(whole)} whole runs (P10 {many['p10']:.0%}, P90 {many['p90']:.0%} of single halves; "
          f"{many['in_70_90']:.0%} of single halves inside 70-90 %; P90/P10 {many['width']:.2f}x on average)")
    order = whole_run_range_coverage_resampled(ws, method=conformal_range)
    fixed = whole_run_range_coverage(ws, method=conformal_range)
    print(f"plan_whole_range_method_baseline: the order statistics (conformal_range) on the same splits: "
          f"{order['mean']:.1%} mean, {order['in_70_90']:.0%} of single halves inside 70-90 %, P90/P10 "
          f"{order['width']:.2f}x; fixed halves {fixed['b_with_range_from_a']:.0%} / "
          f"{fixed['a_with_range_from_b']:.0%} "
          f"(the t interval: {many['in_70_90'] / order['in_70_90']:.2f}x the share inside 70-90 %)")
    lo, mid, hi = WHOLE_RUN_RANGE
    print(f"plan_whole_range: P10 {math.exp(lo):.3f}x, P50 {math.exp(mid):.3f}x, P90 {math.exp(hi):.3f}x")
    assert all(math.isfinite(e) for e in errors)


if __name__ == "__main__":
    main()
