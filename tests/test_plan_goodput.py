"""Whole-run time with goodput: Daly's interval and goodput, evaluation share, the low-goodput warning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from leantrain.plan.budget import daly_interval_s, expected_goodput
from leantrain.plan.inputs import DEFAULT_WHOLE_RUN_EFFICIENCY
from leantrain.plan.planner import make_plan
from leantrain.spec import load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_daly_is_young_for_small_delta_and_the_optimum_otherwise() -> None:
    m = 3600.0
    assert daly_interval_s(blocking_s=1.0, mtbf_s=m) == pytest.approx(math.sqrt(2 * m), rel=0.01)
    for delta in (10.0, 0.22 * m, 1.5 * m):  # δ/M up to 1.5: Young's first order is far off there
        tau = daly_interval_s(blocking_s=delta, mtbf_s=m)
        best = expected_goodput(interval_s=tau, blocking_s=delta, mtbf_s=m, restart_s=60)
        for other in (0.7 * tau, 1.4 * tau):
            assert best >= expected_goodput(interval_s=other, blocking_s=delta, mtbf_s=m, restart_s=60)
        assert 0 < best < 1
    assert daly_interval_s(blocking_s=3 * m, mtbf_s=m) == m


def test_goodput_counts_stalls_lost_work_and_restarts() -> None:
    base = expected_goodput(interval_s=1800, blocking_s=30, mtbf_s=10 * 3600, restart_s=300)
    assert base < 1 - 30 / 1800  # more than the save stall alone
    assert expected_goodput(interval_s=1800, blocking_s=30, mtbf_s=10 * 3600, restart_s=900) < base


def test_whole_run_divides_the_step_time_prediction_by_goodput() -> None:
    plan = make_plan(load_spec(EXAMPLES / "llama3-405b.yaml"))
    t = plan["time"]
    pure_gpu_hours = t["predicted_gpu_hours"]
    assert t["whole_run_gpu_hours"] == pytest.approx(
        pure_gpu_hours * (1 + t["eval_share"]) / t["expected_goodput"] / t["whole_run_efficiency"])
    assert t["whole_run_efficiency"] == DEFAULT_WHOLE_RUN_EFFICIENCY
    own = make_plan(load_spec(EXAMPLES / "llama3-405b.yaml", overrides=["plan.whole_run_efficiency=0.9"]))["time"]
    assert own["whole_run_gpu_hours"] == pytest.approx(t["whole_run_gpu_hours"] * DEFAULT_WHOLE_RUN_EFFICIENCY / 0.9)
    assert t["whole_run_gpu_hours"] > pure_gpu_hours


def test_low_goodput_warns_with_remedies() -> None:
    spec = load_spec(EXAMPLES / "llama3-405b.yaml",
                     overrides=["checkpoint.async_save=false", "checkpoint.write_bandwidth_gb_s=20"])
    plan = make_plan(spec)
    assert plan["checkpoint"]["expected_goodput"] < 0.9
    (warning,) = plan["warnings"]
    assert "checkpoint.async_save: true" in warning and "faster store" in warning and "in-memory" in warning
    fine = make_plan(load_spec(EXAMPLES / "llama3-405b.yaml"))
    assert fine["checkpoint"]["expected_goodput"] >= 0.9 and not fine["warnings"]


def test_405b_on_16384_gpus_with_default_checkpoint_settings_keeps_goodput() -> None:
    """Sync saves and no store bandwidth in the spec: the default is 1 GB/s per node writing in parallel (Llama 3
    §3.3.1: 2 TB/s over 2,048 nodes), so a 4.9 TB checkpoint takes seconds, not 40 minutes (2 GB/s per job,
    which gave 46 % goodput); measured 95 %."""
    spec = load_spec(EXAMPLES / "llama3-405b.yaml",
                     overrides=["checkpoint.async_save=false", "checkpoint.write_bandwidth_gb_s=null"])
    plan = make_plan(spec)
    assert plan["resources"]["layout_gpus"] == 16384
    assert plan["checkpoint"]["save_s"] < 10
    assert plan["time"]["expected_goodput"] >= 0.9 and not plan["warnings"]


def test_low_goodput_warning_names_the_defaults_in_play() -> None:
    spec = load_spec(EXAMPLES / "llama3-405b.yaml",
                     overrides=["checkpoint.write_bandwidth_gb_s=null", "checkpoint.write_bandwidth_gb_s_per_node=0.01",
                                "checkpoint.async_save=false"])
    (warning,) = make_plan(spec)["warnings"]
    assert "Defaults in play" in warning and "fault.restart_s" in warning
    assert "write_bandwidth_gb_s_per_node" not in warning.split("Would raise it")[0]  # set, not a default


def test_an_async_save_waits_for_the_previous_write_as_the_trainer_does() -> None:
    """ckpt/manager.py joins the previous async write before it stages the next: with a 487 s write (405B at
    10 GB/s) the auto interval is at least the write (the trainer's AutoInterval floor), and a fixed 3-step interval
    (21 s) stalls every save for the rest of the write. Until 2026-12-06 both were priced at 97 % goodput with a
    0.0 s stall."""
    slow = ["checkpoint.write_bandwidth_gb_s=10"]
    auto = make_plan(load_spec(EXAMPLES / "llama3-405b.yaml", overrides=slow))["checkpoint"]
    assert auto["save_s"] == pytest.approx(487, rel=0.01)
    assert auto["interval_s"] >= auto["save_s"] and auto["write_wait_s"] == 0
    assert auto["blocking_s"] == auto["host_copy_s"] < 1
    assert auto["durability_lag_s"] == pytest.approx(auto["save_s"])  # a failure mid-write falls back one more save
    assert auto["expected_goodput"] < 0.95
    plan = make_plan(load_spec(EXAMPLES / "llama3-405b.yaml", overrides=[*slow, "checkpoint.interval_steps=3"]))
    fixed = plan["checkpoint"]
    assert fixed["write_wait_s"] == pytest.approx(fixed["save_s"] - fixed["interval_s"])
    assert fixed["blocking_s"] == pytest.approx(fixed["host_copy_s"] + fixed["write_wait_s"])
    assert fixed["expected_goodput"] < 0.1
    (warning,) = plan["warnings"]
    assert f"checkpoint.interval_steps: auto → {auto['expected_goodput']:.0%}" in warning  # the auto plan's
    assert "fault.restart_s: 60" in warning


def test_an_async_save_at_zero_0_copies_the_whole_replica_to_the_host() -> None:
    """At ZeRO-0 every rank stages its whole replica (the plan's host memory counts it so): the save blocks for that
    copy, not for the checkpoint divided by the GPUs."""
    overrides = ["hardware.gpus_per_node=8", "budget.num_gpus=8", "parallelism.data_parallel=8",
                 "parallelism.zero_stage=0", "training.micro_batch=1", "checkpoint.async_save=true",
                 "checkpoint.interval_steps=auto"]
    plan = make_plan(load_spec(EXAMPLES / "gpu-1b-bench.yaml", overrides=overrides))
    staged = plan["host_memory"]["per_process"]["async_staging"]
    assert plan["checkpoint"]["host_copy_s"] == pytest.approx(staged / 20e9)
    assert plan["checkpoint"]["host_copy_s"] > 0.5  # ~12 GB of fp32 weights and moments, not 1/8 of them
