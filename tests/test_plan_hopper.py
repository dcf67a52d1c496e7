"""Hopper priced right: GEMM efficiency by the shapes a layout gives each GPU, FlashAttention at its
measured rate, power-capped parts (`hardware.power_w`, the catalog's 500 W H100-HBM2e) and the fp8 speed-up by
GEMM size; and the held-out published runs (bench/published_heldout.yaml) that no constant is fitted on."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest

from leantrain.errors import UserInputError
from leantrain.plan.inputs import POWER_EXPONENT, plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.published import fit_constants, load_runs, measured_tokens_per_gpu_s, predicted_with
from leantrain.plan.timing import gemm_time_factor, step_time
from leantrain.spec import spec_from_dict

HELD_OUT = Path(__file__).resolve().parents[1] / "bench" / "published_heldout.yaml"


def _inputs(d_model: int, *, accelerator: str = "H100-SXM", compute: str = "bf16", **hardware):
    return plan_inputs(spec_from_dict({
        "model": {"n_layers": 8, "d_model": d_model, "n_heads": max(1, d_model // 128), "vocab_size": 32000},
        "data": {"tokens_total": 1e10, "seq_len": 4096}, "precision": {"compute": compute},
        "hardware": {"accelerator": accelerator, "num_nodes": 1, **hardware},
        "budget": {"target_days": None, "num_gpus": 8}}))


def test_narrow_gemms_are_slower_per_flop() -> None:
    """A wide layer's GEMMs run near the large-GEMM rate; narrow layers and wide TP (smaller N, K per GPU) do not,
    and Hopper (more FLOPs per byte of HBM) loses more than A100 on the same shapes."""
    wide, narrow = _inputs(8192), _inputs(1024)
    assert 1.0 < gemm_time_factor(wide, 8192, 1) < 1.1
    assert gemm_time_factor(narrow, 8192, 1) > gemm_time_factor(wide, 8192, 1) + 0.1
    assert gemm_time_factor(wide, 8192, 8) > gemm_time_factor(wide, 8192, 1)
    a100 = _inputs(1024, accelerator="A100-80GB")
    assert gemm_time_factor(a100, 8192, 1) < gemm_time_factor(narrow, 8192, 1)


def test_fp8_gains_less_on_small_gemms() -> None:
    """Per GEMM the fp8 speed-up grows with size towards its large-GEMM limit; small ones can lose (the scaling
    casts cost more than the faster math), as torchao's linear benchmarks show."""
    def speedup(d: int, tokens: int) -> float:
        return gemm_time_factor(_inputs(d), tokens, 1) / gemm_time_factor(_inputs(d, compute="fp8"), tokens, 1)

    small, large = speedup(1024, 1024), speedup(16384, 16384)
    assert small < 1.0 < large < _inputs(16384, compute="fp8").fp8_speedup
    assert speedup(4096, 8192) < large



def test_fp8_leaves_the_output_head_in_bf16() -> None:
    """The trainer converts every Linear to float8 except the output head (train/precision.py), so the plan
    prices the head's GEMM at bf16: a model that is mostly head gains almost nothing from fp8, one that is
    mostly layers gains what its layers' GEMMs gain."""
    def speedup(n_layers: int, vocab: int) -> float:
        def inputs(compute: str):
            return plan_inputs(spec_from_dict({
                "model": {"n_layers": n_layers, "d_model": 4096, "n_heads": 32, "vocab_size": vocab},
                "data": {"tokens_total": 1e10, "seq_len": 8192}, "precision": {"compute": compute},
                "hardware": {"accelerator": "H100-SXM", "num_nodes": 1}, "budget": {"target_days": None,
                                                                                     "num_gpus": 8}}))
        return gemm_time_factor(inputs("bf16"), 8192, 1) / gemm_time_factor(inputs("fp8"), 8192, 1)

    layers_only, head_heavy = speedup(32, 256), speedup(1, 2_000_000)
    assert layers_only > 1.2
    assert 1.0 < head_heavy < 1.03

def test_power_limit_lowers_the_matmul_rate() -> None:
    capped = _inputs(4096, accelerator="H100-HBM2e")
    assert capped.power_factor == pytest.approx((500 / 700) ** POWER_EXPONENT)
    assert _inputs(4096, accelerator="H100-HBM2e", power_w=700).power_factor == 1.0
    assert _inputs(4096, power_w=600).power_factor == pytest.approx((600 / 700) ** POWER_EXPONENT)
    layout = Layout(dp=8, tp=1, pp=1, zero=3)
    full = step_time(dataclasses.replace(capped, power_factor=1.0), layout, sequences_per_step=64)
    assert step_time(capped, layout, sequences_per_step=64).step_s > full.step_s
    with pytest.raises(UserInputError, match="power_w"):
        _inputs(4096, accelerator="L40S", power_w=300)
    # above the TDP no limit applies, and a spec that says so is refused, naming the TDP (it was planned as at TDP)
    with pytest.raises(UserInputError, match=r"power_w \(900 W\) is above H100-SXM's 700 W TDP"):
        _inputs(4096, power_w=900)
    with pytest.raises(UserInputError, match="400 W TDP"):
        _inputs(4096, accelerator="A100-80GB", power_w=500)


def test_attention_runs_at_the_flash_kernels_rate() -> None:
    """On Hopper FlashAttention-2 reaches a third of the bf16 peak (hardware catalog), so long sequences cost
    more than at the GEMM rate; parts without a measured rate keep the GEMM rate."""
    h100 = _inputs(4096)
    layout = Layout(dp=8, tp=1, pp=1, zero=3)
    at_gemm_rate = step_time(dataclasses.replace(h100, attention_flops_s=0.0), layout, sequences_per_step=64)
    assert step_time(h100, layout, sequences_per_step=64).compute_s > at_gemm_rate.compute_s
    assert _inputs(4096, accelerator="L40S").attention_flops_s == 0.0


def test_held_out_runs_are_predicted_without_being_fitted_on() -> None:
    """bench/published_heldout.yaml (torchtitan's 500 W H100s, Trainy's H200s, LLM Foundry rows) is never in the
    fit: predicted with the constants fitted on the calibration file, median |error| 8.6 % (Hopper 8.4 %) when
    measured; the pin leaves room (target: 10 %). The MoE rows held out here until 2026-12-06 (20.0 %, every
    one but a B200 layout predicted faster than measured) are the calibration file's `moe_runs` now, which set an
    MoE plan's step range and fit only the MoE layers' fixed time per micro-batch (tests/test_plan_ranges.py)."""
    calibration, _ = load_runs()
    held, whole = load_runs(HELD_OUT)
    assert not whole and not {r.name for r in held} & {r.name for r in calibration}
    assert {r.accelerator for r in held} >= {"H100-HBM2e", "H200", "H100-SXM"}
    fit = fit_constants(list(calibration))
    errors = {r.name: abs(predicted_with(r, fit) / measured_tokens_per_gpu_s(r) - 1) for r in held}
    assert all(math.isfinite(e) for e in errors.values())
    assert all(r.model.get("architecture") != "moe" for r in held)
    assert statistics.median(errors.values()) < 0.10, errors
    hopper = [errors[r.name] for r in held if r.family == "H100"]
    assert statistics.median(hopper) < 0.10, errors


def test_held_out_runs_against_the_shipped_step_range() -> None:
    """The step range (the calibration runs' residuals with their software stack left out of the constants) on the
    23 held-out dense runs: 96 % (22) inside P10-P90 (0.81-1.24x), the other (torchtitan's 500 W 405B 1F1B fp8
    row, 0.81x) faster than P10, none slower than P90. Until full recompute stopped repeating the output projection
    and, under torch's early stop, the down projection (2026-12-06), 87 % (20) inside a 0.82-1.21x range, torchtitan's
    500 W 70B 2D and 405B fp8 rows (full AC, 0.80-0.81x) faster than P10. With the range from
    split-half residuals (0.92-1.23x; halves share stacks) 48 % (11) were inside and 12 faster than P10 (the
    planner 0.80-0.92x their throughput: six of torchtitan's nine December 2024 500 W H100 rows, its June 2025 70B
    TP8 fp8 row, LLM Foundry's two A100 rows and three of its H100 rows); with 11 sources left out one at a time
    (2026-12-06 morning) 26 %. The stack grouping was chosen after those were seen, so this is not a blind test of
    it; the in-file check with each stack left out of both (test_plan_ranges.py, 78 %) is. Until 2026-12-06
    bench/plan_accuracy.py checked them with the residual's sign flipped (log(predicted / measured step time));
    `range_coverage` uses the ranges' own residual, log(measured / predicted)."""
    from leantrain.plan.published import range_coverage
    from leantrain.plan.uncertainty import STEP_RANGE

    held, _ = load_runs(HELD_OUT)
    fit = fit_constants(list(load_runs()[0]))
    hi = STEP_RANGE["layout"][2]
    inside = range_coverage(list(held), fit, STEP_RANGE["layout"])
    assert 0.8 <= inside < 1.0, inside  # not every run: the range is not so wide that nothing falls outside
    assert range_coverage(list(held), fit, (-math.inf, 0.0, hi)) == 1.0  # none slower than P90
    # the residual's sign: a run the planner over-predicts (tokens/s) took longer than planned, above P50
    slow = [r for r in held if predicted_with(r, fit) > measured_tokens_per_gpu_s(r)]
    assert slow and range_coverage(slow, fit, (0.0, 0.0, math.inf)) == 1.0


def test_a_part_without_calibration_runs_is_priced_at_its_shipped_efficiency() -> None:
    """B200 has no calibration run: the MoE runs' check prices it as a user's plan does (plan/inputs.py's judged
    0.5), not at Hopper's fitted efficiency, which the planner never uses for it."""
    from leantrain.plan.inputs import DEFAULT_COMPUTE_EFFICIENCY
    from leantrain.plan.published import family, family_efficiency, load_moe_runs

    fit = fit_constants(list(load_runs()[0]))
    b200 = next(r for r in load_moe_runs() if r.accelerator == "B200")
    assert family("B200") == "B200" and family("H800") == family("H200") == family("H100-SXM") == "H100"
    assert family_efficiency(fit, b200) == DEFAULT_COMPUTE_EFFICIENCY["B200"] != fit.efficiency["H100"]


def test_plan_states_the_kernels_mlp_and_power_it_assumed() -> None:
    """The kernel set moves activations and the memory-bound passes and the power limit the matmul rate, so a plan
    says which it used and where each came from (an H100-HBM2e is planned at its catalog limit of 500 W)."""
    from pathlib import Path

    from leantrain.plan.planner import make_plan
    from leantrain.spec import load_spec

    example = Path(__file__).resolve().parents[1] / "examples" / "llama3-8b-h100.yaml"
    a = make_plan(load_spec(example))["assumptions"]
    assert (a["kernels"], a["kernels_from"], a["mlp"], a["power_w"], a["power_from"]) == (
        "eager", "plan.kernels: auto, training.compile: false", "swiglu", 700, "the TDP")
    capped = make_plan(load_spec(example, overrides=["hardware.accelerator=H100-HBM2e", "plan.kernels=fused",
                                                     "model.mlp=gelu"]))["assumptions"]
    assert (capped["kernels"], capped["kernels_from"], capped["mlp"]) == ("fused", "plan.kernels: fused", "gelu")
    assert capped["power_w"] == 500 and capped["power_from"] == "the catalog's default limit"
    assert capped["power_factor"] == pytest.approx((500 / 700) ** POWER_EXPONENT)
