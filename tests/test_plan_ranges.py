"""P10–P90 ranges (plan/uncertainty.py): the shipped residual quantiles are what the published runs give, the
ranges hold out of sample (the step range with each software stack left out of the constants and the range, the
whole-run range half against half, the MoE range release by release), and every time, GPU-hour and cost figure of
plan.json and the what-if rows carries one."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest

from leantrain.plan.planner import build_plan, what_if_rows
from leantrain.plan.published import (
    fit_constants,
    load_runs,
    searched_step_residuals,
    split_halves,
    step_range_coverage,
    step_residuals_out_of_sample,
    whole_run_range_coverage,
    whole_run_range_coverage_resampled,
    whole_run_residuals,
    whole_run_split_errors,
)
from leantrain.plan.render import plot_what_if
from leantrain.plan.uncertainty import (
    STEP_RANGE,
    WHOLE_RUN_RANGE,
    conformal_range,
    prediction_range,
    student_t_quantile,
)
from leantrain.spec import load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def runs():
    return load_runs()


@pytest.fixture(scope="module")
def whole_split(runs):
    return whole_run_split_errors(runs[1])


def test_conformal_range_order_statistics() -> None:
    values = [float(i) for i in range(1, 20)]  # n = 19: the 2nd and the 18th smallest
    assert conformal_range(values) == (2.0, 10.0, 18.0)
    assert conformal_range([0.3, -0.1, 0.1]) == (-0.1, 0.1, 0.3)  # few residuals: their extremes
    with pytest.raises(ValueError):
        conformal_range([])


def test_student_t_quantile_matches_the_tables() -> None:
    """Student's t at 0.90 (scipy.stats.t.ppf, the tables): 1.4759 at 5 degrees of freedom, 1.3722 at 10,
    1.3232 at 21, 1.3016 at 43; the normal's 1.2816 in the limit."""
    for dof, exact in ((5, 1.475884), (10, 1.372184), (21, 1.323188), (43, 1.301552), (10**6, 1.281552)):
        assert student_t_quantile(0.9, dof) == pytest.approx(exact, abs=3e-5)
    assert student_t_quantile(0.1, 21) == pytest.approx(-1.323188, abs=3e-5)
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_quantile(0.9, 4)


def test_prediction_range_is_the_normal_theory_interval() -> None:
    values = [-0.3, -0.1, 0.0, 0.05, 0.1, 0.2, 0.4]  # n = 7: mean 0.05, s 0.2217, t(0.9, 6) = 1.4398
    lo, mid, hi = prediction_range(values)
    half = 1.439756 * statistics.stdev(values) * math.sqrt(1 + 1 / 7)
    assert (lo, mid, hi) == pytest.approx((0.05 - half, 0.05, 0.05 + half), abs=1e-4)
    assert prediction_range([v + 1 for v in values]) == pytest.approx((lo + 1, mid + 1, hi + 1), abs=1e-4)
    with pytest.raises(ValueError, match="at least 6"):
        prediction_range(values[:5])


def test_step_range_is_the_published_runs_out_of_sample_residuals(runs) -> None:
    assert conformal_range(step_residuals_out_of_sample(runs[0])) == STEP_RANGE["layout"]


def test_whole_run_range_is_the_published_whole_runs_residuals(whole_split) -> None:
    ratios, a, b = whole_split["ratios_at_1"], whole_split["half_a"], whole_split["half_b"]
    residuals = [*whole_run_residuals(ratios, whole_split["fit_on_b"], a),
                 *whole_run_residuals(ratios, whole_split["fit_on_a"], b)]
    assert prediction_range(residuals) == WHOLE_RUN_RANGE


@pytest.mark.slow
def test_searched_step_range_is_the_published_runs_residuals(runs) -> None:
    """The planner's own searched layout against each run's measured one, constants from the other half."""
    a, b = split_halves(runs[0])
    fit_a, fit_b = fit_constants(a), fit_constants(b)
    fits = {**{r.name: fit_b for r in a}, **{r.name: fit_a for r in b}}
    assert conformal_range(searched_step_residuals(runs[0], fits)) == STEP_RANGE["searched"]


def test_every_throughput_run_has_a_software_stack(runs) -> None:
    """The step range leaves one stack out at a time; a run whose name no stack claims is refused, not filed under
    one silently."""
    from collections import Counter

    from leantrain.plan.published import stack

    assert Counter(stack(r) for r in runs[0]) == {"NVIDIA NeMo/Megatron": 26, "LLM Foundry": 11,
                                                  "Megatron-LM 2021": 10, "torchtitan": 6, "MT-NLG": 3,
                                                  "Meta Llama 3": 2}
    with pytest.raises(ValueError, match="no software stack"):
        stack(dataclasses.replace(runs[0][0], name="trainy-h200-8b"))


def test_step_range_covers_held_out_runs(runs) -> None:
    """Each software stack left out of the constants and of the range in turn (the range from the other stacks'
    own leave-one-stack-out residuals): 78 % of the 58 runs inside (target ~80 %). By stack: Megatron-LM 2021,
    Meta's Llama 3 and torchtitan 100 %, LLM Foundry 73 %, MT-NLG 67 % and NVIDIA's NeMo/Megatron 65 %. Until full
    recompute stopped repeating the output projection and, under torch's early stop, the down projection (2026-12-06:
    torchtitan's full-AC rows 0.85x -> 0.90x, which widened the others' ranges on the slow side and narrowed them on
    the fast) it was 84 %: NeMo 85 %, LLM Foundry 82 %, MT-NLG 0 % (its DeepSpeed pipeline runs are 1.19-1.24x
    slower than the other stacks' constants predict).
    (Until 2026-12-06 the range came from split halves, which share stacks: 86 % / 100 % on the halves, but 48 % on
    the runs outside the file, test_plan_hopper.py.) Only six stacks: the guarantee is over stacks, not runs."""
    coverage = step_range_coverage(runs[0])
    assert 0.75 <= coverage["all"] <= 0.9, coverage
    assert coverage["torchtitan"] == 1.0 and coverage["MT-NLG"] < 1.0, coverage


def test_whole_run_range_covers_held_out_runs(whole_split) -> None:
    """Measured on the fixed halves (alternate runs in name order, 22 and 22 of the 44 whole runs): 82 % (18 of
    22) of B inside the range from A alone (0.756-1.455x) and 82 % of A inside B's (0.697-1.493x), both inside the
    70-90 % target. With the order statistics (`conformal_range`, shipped until 2026-12-07) the same halves gave
    73 % and 95 %: B holds the extremes (Phi-3-small 1.92x and Llama 3 8B 1.68x published / predicted, Falcon-RW-1B
    0.60x), and the 2nd and 21st of its 22 residuals made a range (0.711-1.679x) that over-covered A. With ~20 runs
    per half one run is 5 points, so the resampled check below is the calibration; this pins what holds."""
    coverage = whole_run_range_coverage(whole_split)
    assert 0.7 <= coverage["b_with_range_from_a"] <= 0.9, coverage
    assert 0.7 <= coverage["a_with_range_from_b"] <= 0.9, coverage


def test_whole_run_range_is_calibrated_over_random_splits(whole_split) -> None:
    """Over 2,000 seeded random half-splits of the 44 whole runs the held-out coverage averages 80.2 % (target
    ~80 %), 63 % of single halves land in 70-90 %, and the halves' P90/P10 averages 2.01x. The order statistics on
    the same splits: 82.6 %, 54 %, 2.16x. So the prediction interval is the better-calibrated, the steadier and the
    narrower range on these residuals (which a normal fits: next test); plan/uncertainty.py argues the choice."""
    many = whole_run_range_coverage_resampled(whole_split, n_splits=500)
    assert 0.75 <= many["mean"] <= 0.85, many
    assert many["p10"] < many["mean"] < many["p90"], many
    order = whole_run_range_coverage_resampled(whole_split, n_splits=500, method=conformal_range)
    assert many["in_70_90"] > order["in_70_90"] and many["width"] < order["width"] < 2.5, (many, order)
    assert abs(many["mean"] - 0.8) < abs(order["mean"] - 0.8), (many, order)


def test_whole_run_residuals_are_consistent_with_a_normal(whole_split) -> None:
    """The prediction interval assumes normal log residuals: the 44 out-of-sample whole-run residuals give
    Shapiro-Wilk p = 0.65 and skewness 0.36 (the 58 step-time ones: p = 0.005, skewness 0.49, so the step and MoE
    ranges keep the order statistics)."""
    stats = pytest.importorskip("scipy.stats")
    ratios, a, b = whole_split["ratios_at_1"], whole_split["half_a"], whole_split["half_b"]
    residuals = [*whole_run_residuals(ratios, whole_split["fit_on_b"], a),
                 *whole_run_residuals(ratios, whole_split["fit_on_a"], b)]
    assert stats.shapiro(residuals).pvalue > 0.1
    assert abs(stats.skew(residuals)) < 0.5


def _ordered(section: dict, name: str) -> None:
    assert 0 < section[f"{name}_p10"] <= section[f"{name}_p50"] <= section[f"{name}_p90"], (name, section)


def test_plan_json_carries_every_range(tmp_path: Path) -> None:
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml")
    plan = build_plan(spec)
    data = plan.to_json()
    for name in ("gpu_hours", "days"):
        _ordered(data["time"], name)
    _ordered(data["throughput"], "step_s")
    _ordered(data["cost"], "total")
    t = data["time"]
    assert t["gpu_hours_p10"] <= t["whole_run_gpu_hours"] <= t["gpu_hours_p90"]
    assert data["cost"]["total_p90"] == pytest.approx(t["gpu_hours_p90"] * spec.budget.price_per_gpu_hour)
    # a fleet's own whole-run efficiency narrows the whole-run range to the step-time one
    known = build_plan(load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=["plan.whole_run_efficiency=0.7"]))
    k = known.to_json()["time"]
    assert k["gpu_hours_p90"] / k["gpu_hours_p10"] < t["gpu_hours_p90"] / t["gpu_hours_p10"]
    rows = what_if_rows(plan, [32, 64])
    for row in rows:
        if row["fits"]:
            assert row["predicted_days_p10"] <= row["predicted_days"] <= row["predicted_days_p90"]
    assert plot_what_if(rows, tmp_path / "what_if.png").stat().st_size > 0


@pytest.mark.parametrize(("example", "source"), [("seed-10b.yaml", "search"), ("llama3-405b.yaml", "spec")])
def test_what_if_row_of_the_plans_own_gpu_count_repeats_the_plan(example: str, source: str) -> None:
    """A what-if row is the plan at that GPU count: the same layout choice (the spec's where it covers the count),
    goodput, whole-run days, GPU-hours and cost and their P10/P50/P90; the rows around it carry ordered ranges of
    their own. (Before 2026-12-06 a row searched a layout even where the spec gave one and carried only the
    step-time model's days with the step range: seed-10b.yaml's 120-GPU row read 27 days, 22-46, beside the plan's whole
    run of 36.5 days, 27.6-61.5, and its cost had no range.)"""
    spec = load_spec(EXAMPLES / example)
    plan = build_plan(spec)
    data = plan.to_json()
    own = plan.layout_gpus
    rows = {row["gpus"]: row for row in what_if_rows(plan, [own // 2, own, own * 2])}
    row = rows[own]
    assert row["layout_source"] == data["layout"]["source"] == source
    assert row["layout"] == plan.chosen.layout.describe()
    assert row["expected_goodput"] == pytest.approx(data["time"]["expected_goodput"])
    for p in ("p10", "p50", "p90"):
        assert row[f"whole_run_days_{p}"] == pytest.approx(data["time"][f"days_{p}"])
        assert row[f"whole_run_gpu_hours_{p}"] == pytest.approx(data["time"][f"gpu_hours_{p}"])
        assert row[f"whole_run_cost_{p}"] == pytest.approx(data["cost"][f"total_{p}"])
    assert row["whole_run_cost"] == pytest.approx(data["cost"]["whole_run"])
    price = spec.budget.price_per_gpu_hour
    for r in rows.values():
        if not r["fits"]:
            continue
        for name in ("whole_run_days", "whole_run_gpu_hours", "whole_run_cost"):
            assert 0 < r[f"{name}_p10"] <= r[f"{name}_p50"] <= r[f"{name}_p90"], (r["gpus"], name)
        assert r["whole_run_cost_p90"] == pytest.approx(r["whole_run_gpu_hours_p90"] * price)
        # the whole run includes goodput and the whole-run efficiency: never shorter than the step model alone
        assert r["whole_run_days"] > r["predicted_days"]


def test_what_if_table_keeps_every_figure_whole_in_80_columns() -> None:
    """The what-if table's ranges are never cut to fit a terminal: each row's P10–P90 is printed whole at 80
    columns, and the layouts are listed under the table."""
    import io

    from rich.console import Console

    from leantrain.plan.render import render_what_if

    plan = build_plan(load_spec(EXAMPLES / "llama3-405b.yaml"))
    rows = what_if_rows(plan, [2048, 16384])
    buf = io.StringIO()
    render_what_if(rows, console=Console(file=buf, width=80, color_system=None), currency="USD")
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    for row in rows:
        assert f"{row['whole_run_days_p10']:.1f}–{row['whole_run_days_p90']:.1f}" in text
        assert f"{row['gpus']} GPUs: {row['layout']} ({row['layout_source']})" in text
    assert "…" not in text


def test_searched_layout_gets_the_wider_step_range() -> None:
    from leantrain.plan.uncertainty import step_offsets, whole_run_offsets

    given, searched = step_offsets(layout_given=True), step_offsets(layout_given=False)
    assert searched[0] <= given[0] and searched[2] >= given[2]
    unknown = whole_run_offsets(layout_given=False, fleet_known=False)
    assert unknown[0] <= searched[0] and unknown[2] >= searched[2]


def test_moe_step_range_is_the_moe_runs_residuals_and_holds_release_by_release(runs) -> None:
    """The MoE runs (`moe_runs`: DeepSeek-V3, Qwen3-30B-A3B/235B-A22B, Mixtral 8x7B and Grok-1 proxies on H100 and
    B200, 16 runs of 9 releases) are predicted with the constants fitted on the dense runs and one constant of their
    own, the MoE layers' fixed time per micro-batch (3.25 ms fitted on all 16). Without it the planner was
    optimistic on 15 of the 16 (median error 23 %, up to 2.33x on Qwen3-30B-A3B's small experts); with it fitted on
    the other releases, each release's runs are predicted within a median 15 %, and the range built from those
    residuals is 0.70-1.77x around 1.01x. One release left out of the overhead and the range at a time, the others'
    range covers 14 of the 16 runs (88 %) and 7 of the 9 releases."""
    from leantrain.plan.inputs import MOE_LAYER_OVERHEAD_S
    from leantrain.plan.published import load_moe_runs, log_errors
    from leantrain.plan.published_moe import (
        _moe_step_terms,
        fit_moe_layer_overhead,
        moe_range_coverage,
        moe_residuals_out_of_sample,
    )

    moe, fit = load_moe_runs(), fit_constants(list(runs[0]))
    assert len(moe) >= 16 and all(r.model["architecture"] == "moe" for r in moe)
    assert not {r.name for r in moe} & {r.name for r in runs[0]}
    assert fit_moe_layer_overhead(moe, fit) == MOE_LAYER_OVERHEAD_S
    residuals = moe_residuals_out_of_sample(moe, fit)
    assert conformal_range(residuals) == STEP_RANGE["moe"]
    # the arithmetic fit agrees with the full step-time model, sign included (log predicted / measured tokens/s)
    fitted = dataclasses.replace(fit, moe_layer_overhead_s=MOE_LAYER_OVERHEAD_S)
    bare = dataclasses.replace(fit, moe_layer_overhead_s=0.0)
    full = log_errors(list(moe), fitted)
    qwen = [r for r in moe if "qwen3-30b" in r.name]  # small experts: 2x optimistic without the overhead
    assert len(qwen) == 2 and all(e > math.log(1.9) for e in log_errors(qwen, bare))
    assert all(f < b - 0.3 for f, b in zip(log_errors(qwen, fitted), log_errors(qwen, bare), strict=True))
    terms = dict(zip([r.name for r in moe], full, strict=True))
    in_sample = [math.log(m / (b + MOE_LAYER_OVERHEAD_S * n)) for _, m, b, n in _moe_step_terms(moe, fit)]
    assert in_sample == pytest.approx([terms[r.name] for r in moe], abs=1e-9)
    out_of_sample = statistics.median(abs(math.exp(e) - 1) for e in residuals)
    without = statistics.median(abs(math.exp(e) - 1) for e in log_errors(list(moe), bare))
    assert out_of_sample < 0.17 < 0.2 < without, (out_of_sample, without)
    coverage = moe_range_coverage(moe, fit)
    # pinned: a range that leaks the held-out release into its residuals covers 15 of 16 and 8 of 9
    assert (coverage["runs"], coverage["releases"], coverage["n_releases"]) == (14 / 16, 7 / 9, 9), coverage


def test_plan_accuracy_prints_the_moe_runs_the_right_way_round(runs) -> None:
    """bench/plan_accuracy.py's MoE lines: predicted / measured tokens/s, with the overhead (fitted on the other
    releases) lower than without it, and Qwen3-30B-A3B still optimistic (1.23x and 1.29x, from 2.01x and 2.33x)."""
    import importlib.util

    from leantrain.plan.published import load_moe_runs

    path = Path(__file__).resolve().parents[1] / "bench" / "plan_accuracy.py"
    spec = importlib.util.spec_from_file_location("plan_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.moe_ratios(load_moe_runs(), fit_constants(list(runs[0])))
    assert all(ratio < before for _, ratio, before in rows)
    qwen = [(ratio, before) for run, ratio, before in rows if "qwen3-30b" in run.name]
    assert [round(r, 2) for r, _ in qwen] == [1.23, 1.29] and [round(b, 2) for _, b in qwen] == [2.01, 2.33]


def test_an_moe_plan_gets_the_moe_step_range() -> None:
    """DeepSeek-V3's plan (examples/deepseek-v3.yaml, its published layout) carries the MoE range, wider than the
    dense one on both sides; a dense plan's range is unchanged."""
    from leantrain.plan.uncertainty import step_offsets

    dense = build_plan(load_spec(EXAMPLES / "llama3-8b-h100.yaml")).to_json()["throughput"]
    plan = build_plan(load_spec(EXAMPLES / "deepseek-v3.yaml")).to_json()
    t = plan["throughput"]
    assert t["step_s_p50"] / t["step_s"] == pytest.approx(math.exp(STEP_RANGE["moe"][1]), rel=1e-6)
    assert t["step_s_p90"] / t["step_s"] > 1.7 and t["step_s_p10"] / t["step_s"] < 0.8
    assert "MoE" in plan["time"]["range_basis"]
    assert dense["step_s_p90"] / dense["step_s"] < 1.3
    moe_searched = step_offsets(layout_given=False, moe=True)
    assert moe_searched[0] <= step_offsets(layout_given=False)[0] and moe_searched[2] >= STEP_RANGE["moe"][2]


def test_a_gpu_count_without_a_layout_the_trainer_runs_is_a_row_and_an_error_not_a_crash(tmp_path: Path) -> None:
    """tiny-cpu's 8 sequences a step do not divide over 3 replicas and its 2 layers leave no pipeline of 3: no layout
    on 3 GPUs is one the trainer runs. The what-if row says so (within 80 columns, and the plot skips it), and a
    plan on 3 GPUs is refused naming why (it was an AssertionError)."""
    import io

    from rich.console import Console

    from leantrain.errors import UserInputError
    from leantrain.plan.render import render_what_if

    spec = load_spec(EXAMPLES / "tiny-cpu.yaml")
    plan = build_plan(spec)
    rows = what_if_rows(plan, [2, 3])
    assert rows[0]["fits"] and "whole_run_days_p50" in rows[0]
    assert not rows[1]["fits"] and rows[1]["layout"] is None and "whole_run_days_p50" not in rows[1]
    buf = io.StringIO()
    render_what_if(rows, console=Console(file=buf, width=80, color_system=None), currency="USD")
    text = buf.getvalue()
    assert "no fit" in text and "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert plot_what_if(rows, tmp_path / "w.png").stat().st_size > 0
    from leantrain.spec import spec_from_dict

    three = spec_from_dict({"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256},
                            "data": {"tokens_total": 1e6, "seq_len": 128}, "training": {"global_batch_tokens": 8 * 128},
                            "hardware": {"accelerator": "cpu", "gpus_per_node": 4},
                            "budget": {"target_days": None, "num_gpus": 3}})
    with pytest.raises(UserInputError, match="no layout on 3 GPUs is one the trainer runs"):
        build_plan(three)
