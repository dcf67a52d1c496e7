"""Calibration that generalises: the step-time constants fitted on one half of the published runs
(plan/published_runs.yaml) predict the other half; the whole-run efficiency fitted on half the whole runs
predicts the other half's GPU-hours."""

from __future__ import annotations

import statistics

import pytest

from leantrain.plan.inputs import (
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_WHOLE_RUN_EFFICIENCY,
    ELEMENTWISE_PASSES,
    ELEMENTWISE_PASSES_EAGER,
)
from leantrain.plan.published import (
    fit_constants,
    load_runs,
    measured_tokens_per_gpu_s,
    median_abs_error,
    split_half_errors,
    split_halves,
    whole_run_gpu_hours,
    whole_run_split_errors,
)


@pytest.fixture(scope="module")
def runs():
    return load_runs()


@pytest.fixture(scope="module")
def whole_split(runs):
    return whole_run_split_errors(runs[1])


def test_data_file_covers_the_required_runs(runs) -> None:
    throughput, whole = runs
    every = [*throughput, *whole]
    assert len(throughput) >= 20 and all(r.source for r in every)
    assert {r.accelerator for r in every} >= {"A100-80GB", "H100-SXM", "H800"}
    assert {"moe"} <= {str(r.model.get("architecture", "dense")) for r in every} | {"dense"}
    assert all(measured_tokens_per_gpu_s(r) > 0 for r in throughput)
    a, b = split_halves(throughput)
    assert {r.family for r in a} == {r.family for r in b} == {"A100", "H100"}
    assert not {r.name for r in a} & {r.name for r in b}


def test_out_of_sample_step_time_error_is_under_the_target(runs) -> None:
    """Measured 4.0 % (half B, constants fitted on A) and 4.8 % (A on B), 3.6 % on the Hopper runs; the target
    is ≤ 10 %. The constant-40 %-MFU rule scores 19.5 % on them, with nothing fitted (bench/plan_accuracy.py)."""
    result = split_half_errors(runs[0])
    assert result["error_b_with_fit_a"] < 0.10, result
    assert result["error_a_with_fit_b"] < 0.10, result
    # the out-of-sample error is what the test pins; the in-sample one is lower, as a fit's must be
    assert result["error_a_in_sample"] <= result["error_a_with_fit_b"] + 1e-9


def test_out_of_sample_step_time_error_on_hopper_rows_alone(runs) -> None:
    """The second step-time target, ≤ 10 % on the Hopper rows alone (each predicted with the constants
    fitted on the other half): measured 3.6 % on 39 H100-family runs (bench/plan_accuracy.py,
    plan_step_out_of_sample_hopper_only)."""
    from leantrain.plan.published import measured_tokens_per_gpu_s, predicted_with

    result = split_half_errors(runs[0])
    a, b = split_halves(runs[0])
    hopper = [abs(predicted_with(r, fit) / measured_tokens_per_gpu_s(r) - 1)
              for half, fit in ((b, result["fit_on_a"]), (a, result["fit_on_b"])) for r in half if r.family == "H100"]
    assert len(hopper) >= 20
    assert statistics.median(hopper) < 0.10, statistics.median(hopper)


def test_memory_bound_term_is_what_generalises(runs) -> None:
    """Without the memory-bound passes (0) the fit on all runs is worse than with the fitted count."""
    throughput = list(runs[0])
    fitted = fit_constants(throughput)
    without = type(fitted)({f: fitted.efficiency[f] for f in fitted.efficiency}, 0.0)
    assert median_abs_error(throughput, fitted) < median_abs_error(throughput, without)


def test_defaults_are_the_fit_on_all_runs(runs, whole_split) -> None:
    fitted = fit_constants(list(runs[0]))
    assert DEFAULT_COMPUTE_EFFICIENCY["A100"] == fitted.efficiency["A100"]
    assert DEFAULT_COMPUTE_EFFICIENCY["H100"] == fitted.efficiency["H100"]
    assert fitted.elementwise_passes == ELEMENTWISE_PASSES
    assert fitted.passes(False) == ELEMENTWISE_PASSES_EAGER
    assert whole_split["fit_on_all"] == DEFAULT_WHOLE_RUN_EFFICIENCY


def _random_split_errors(ratios: dict[str, float], *, n_splits: int = 2000, seed: int = 0) -> list[float]:
    """The held-out median |error| of both halves of `n_splits` seeded random half-splits of the whole runs, the
    whole-run efficiency fitted on the other half each time (the fixed halves' recipe, over many halves)."""
    import random

    from leantrain.plan.published import fit_whole_run_efficiency

    names, rng, errors = sorted(ratios), random.Random(seed), []
    for _ in range(n_splits):
        shuffled = rng.sample(names, len(names))
        halves = shuffled[:len(names) // 2 + 1], shuffled[len(names) // 2 + 1:]
        for fit_half, held_out in (halves, halves[::-1]):
            fit = fit_whole_run_efficiency([ratios[n] for n in fit_half])
            errors.append(statistics.median(abs(ratios[n] / fit - 1) for n in held_out))
    return errors


def test_whole_run_gpu_hours_out_of_sample(whole_split) -> None:
    """The step-time constants never see the whole runs; the whole-run efficiency fitted on half the runs predicts the
    other half. The planner searches most published runs' layouts with its memory model, which plans what this
    trainer holds (torch pipelining's gathered stage, unsharded fp32 gradients and receive buffers, sequence
    parallelism's gathered inputs): layouts other frameworks ran are dearer here, the searched ones slower, and the
    whole runs' ratios spread (the fit on all 44 is 0.81, 0.80 until the search kept only layouts the spec rules
    accept; 0.78 on the first 40 and on the first 21). Over 2,000 random half-splits of the 44 the held-out median
    error averages 17.5 % (P90 21.5 %; 17.4 % before full recompute stopped repeating the output projection, 17.8 %
    before the search tried op recompute; 18.3 % before the spec-rule
    filter and on the first 40; 19.4 % before MoE layers'
    fixed time per micro-batch was priced; on the first 21 runs 12.7 %, P90 17.3 %: the 19 runs added on 2026-12-06
    include recent small models whose published hours imply 15-25 % MFU); without the whole-run efficiency (1.0) the
    planner misses by 21.6 %."""
    errors = _random_split_errors(whole_split["ratios_at_1"])
    mean = statistics.mean(errors)
    assert mean < 0.20, mean
    assert mean < whole_split["error_all_unfitted"], (mean, whole_split["error_all_unfitted"])
    assert not set(whole_split["half_a"]) & set(whole_split["half_b"])


def test_whole_run_gpu_hours_fixed_halves_meet_the_target(whole_split) -> None:
    """The whole-run target (median ≤ 20 %) on bench/plan_accuracy.py's fixed halves (alternate runs in name
    order) of the 44 whole runs: 17.6 % (B on A's fit) and 17.1 % (A on B's), fits 0.81 / 0.80 (17.6 % / 17.8 %
    before the search tried op recompute, 16.6 % / 17.8 % before it kept only layouts the spec rules accept). Each
    run added re-alternates the halves: with the first 43 (MiniCPM-2.4B not yet in) 11.2 % and 21.0 %, A missing
    the target; with the first 40 16.6 % and 19.6 % (fits 0.80 / 0.78); with the first 21 15.4 / 17.1 %."""
    assert whole_split["error_b_with_fit_a"] < 0.20, whole_split
    assert whole_split["error_a_with_fit_b"] < 0.20, whole_split


def test_whole_run_uses_goodput_and_the_published_layout(runs) -> None:
    """DeepSeek-V3 is priced with its node-limited routing on its published layout, within 30 % (the target)."""
    results = {r.name: whole_run_gpu_hours(r) for r in runs[1] if r.name in ("deepseek-v3", "bloom-176b")}
    assert all(x["goodput"] < 1 and x["layout"] == "spec" for x in results.values())
    assert abs(results["deepseek-v3"]["error"]) < 0.30, results
    assert statistics.median(abs(x["error"]) for x in results.values()) < 0.20, results
