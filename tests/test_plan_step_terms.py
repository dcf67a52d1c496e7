"""Planner v2 step-time and memory terms: ring bandwidth over nodes, the memory-bound passes, the experts'
weight roofline, DualPipe (planning only), DeepSeek's latent attention (planning only), and their refusals
by the trainer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from leantrain.model.transformer import model_args_from_spec
from leantrain.plan.inputs import FP8_GEMM_SPEEDUP, plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.memory import memory_per_gpu
from leantrain.plan.planner import make_plan
from leantrain.plan.timing import elementwise_s, expert_weight_s, ring_bandwidth, step_time
from leantrain.spec import load_spec, spec_from_dict
from leantrain.spec.shapes import resolve_shape

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def dense():
    return plan_inputs(load_spec(EXAMPLES / "llama3-8b-h100.yaml"))


@pytest.fixture(scope="module")
def dsv3():
    return plan_inputs(load_spec(EXAMPLES / "deepseek-v3.yaml"))


def test_ring_bandwidth_counts_the_nics_a_group_spans(dense) -> None:
    nic, nvlink = dense.inter_node_bytes_s, dense.intra_node_bytes_s
    assert ring_bandwidth(dense, ranks=8, stride=1) == nvlink  # one node
    assert ring_bandwidth(dense, ranks=64, stride=1) == min(nvlink, 8 * nic)  # FSDP over whole nodes
    assert ring_bandwidth(dense, ranks=64, stride=8) == nic  # DP of TP8 replicas: one member per node
    assert ring_bandwidth(dense, ranks=64, stride=4) == 2 * nic  # TP4: two members per node


def test_memory_bound_passes_cost_more_for_small_widths_and_follow_recompute(dense) -> None:
    layout = Layout(dp=8, tp=1, pp=1, zero=3)
    base = elementwise_s(dense, layout)
    assert base > 0
    assert elementwise_s(dataclasses.replace(dense, elementwise_passes=0.0), layout) == 0.0
    assert elementwise_s(dataclasses.replace(dense, elementwise_passes=2 * dense.elementwise_passes),
                         layout) == pytest.approx(2 * base)
    assert elementwise_s(dense, dataclasses.replace(layout, recompute="full")) > base  # the forward runs twice
    t = step_time(dense, layout, sequences_per_step=64)
    no_mem = step_time(dataclasses.replace(dense, elementwise_passes=0.0), layout, sequences_per_step=64)
    assert t.step_s > no_mem.step_s
    # relative to the matmuls, the memory-bound share falls as the hidden size grows (it scales as h, FLOPs as h²)
    wide = plan_inputs(load_spec(EXAMPLES / "llama3-405b.yaml"))
    one = Layout(dp=1, tp=1, pp=1)
    share_8b = elementwise_s(dense, one) / (dense.hardware_flops_per_token("none") * dense.seq_len
                                            / dense.compute_flops_s)
    share_405b = elementwise_s(wide, one) / (wide.hardware_flops_per_token("none") * wide.seq_len
                                             / wide.compute_flops_s)
    assert share_405b < share_8b


def test_the_memory_bound_pass_reads_the_routed_rows_whole_where_the_experts_are_split_over_tp() -> None:
    """Under TP without EP every TP rank routes all the layer's tokens (parallel/expert.py), so the routed rows are
    whole on each rank: in the memory plan (activations.layer_activation_bytes, measured in
    tests/test_plan_tp_activations.py) and, since 2026-12-07, in the memory-bound pass over them, which divided them
    by tp."""
    from leantrain.plan.timing import _saved_terms

    moe = plan_inputs(load_spec(EXAMPLES / "moe-small-cpu.yaml"))
    split = Layout(dp=2, tp=2, pp=1)
    assert split.experts_split_over_tp and moe.elementwise_passes > 0
    rows_split = dataclasses.replace(split, experts_tp_split=False)  # the same sizes, the rows divided by tp
    rows = _saved_terms(moe)[1].expert_rows  # bytes per token and MoE layer
    layers = min(moe.shape.n_layers, moe.shape.num_moe_layers)
    missing = moe.elementwise_passes * layers * moe.seq_len * rows / 2 / moe.memory_bandwidth_bytes_s
    assert rows > 0 and elementwise_s(moe, split) - elementwise_s(moe, rows_split) == pytest.approx(missing)


def test_expert_weights_bind_when_few_tokens_reach_each_expert(dsv3) -> None:
    """DeepSeek-V3 on one pipeline of 16 stages: without EP each GPU reads all 256 experts' weights for 128
    tokens per expert (weight-bound); with EP64 each holds 4 experts that see 64× the tokens (FLOP-bound)."""
    no_ep = Layout(dp=128, tp=1, pp=16, ep=1, zero=1)
    ep64 = Layout(dp=128, tp=1, pp=16, ep=64, zero=1)
    assert expert_weight_s(dsv3, no_ep) > 0
    assert expert_weight_s(dsv3, ep64) == 0.0
    dense = plan_inputs(load_spec(EXAMPLES / "llama3-8b-h100.yaml"))
    assert expert_weight_s(dense, Layout(dp=8, tp=1, pp=1)) == 0.0


def test_dualpipe_is_priced_with_its_bubble_two_weight_copies_and_p_plus_one_micro_batches(dsv3) -> None:
    dual = Layout(dp=128, tp=1, pp=16, ep=64, zero=1, schedule="dualpipe")
    plain = dataclasses.replace(dual, schedule="1f1b")
    m = dual.num_microbatches(15360)
    t_dual, t_plain = (step_time(dsv3, x, sequences_per_step=15360) for x in (dual, plain))
    assert t_dual.bubble_s < t_plain.bubble_s / 3  # (p/2 − 1)·2/3 = 4.7 against p − 1 = 15 micro-batch times
    mem_dual, mem_plain = (memory_per_gpu(dsv3, x, num_microbatches=m) for x in (dual, plain))
    from leantrain.plan.memory import rope_table_bytes

    rope = rope_table_bytes(dsv3)  # the RoPE tables: one buffer per stage, not doubled
    assert mem_dual.params - rope == pytest.approx(2 * (mem_plain.params - rope))
    assert mem_dual.grads == pytest.approx(2 * mem_plain.grads)
    assert mem_dual.optimizer == pytest.approx(mem_plain.optimizer)
    assert mem_dual.activations > mem_plain.activations


def test_mla_counts_deepseek_v3_parameters_and_attention(dsv3) -> None:
    shape = dsv3.shape
    assert shape.total_params() == pytest.approx(671e9, rel=0.005)
    assert shape.active_params() == pytest.approx(37e9, rel=0.02)
    assert shape.attention_core_widths == (128 * 192, 128 * 128)
    # per layer: q 7168·1536 + 1536 + 1536·128·192, kv 7168·576 + 512 + 512·128·256, o 128·128·7168
    assert shape.attention_params() == (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512
                                        + 512 * 128 * 256 + 128 * 128 * 7168)
    mha = resolve_shape(load_spec(EXAMPLES / "deepseek-v3.yaml", overrides=["model.mla=null"]).model)
    assert mha.attention_params() > shape.attention_params()  # MLA's low-rank projections are smaller
    assert mha.attention_core_widths == (7168, 7168)


def test_planning_only_features_are_refused_by_the_trainer(tmp_path: Path) -> None:
    """DualPipe is planned, not trained (MLA trains since 8933d2c: the trainer builds DeepSeek-V3's model args)."""
    spec = load_spec(EXAMPLES / "deepseek-v3.yaml")
    assert model_args_from_spec(spec.model, max_seq_len=4096) is not None
    bad = tmp_path / "dualpipe.yaml"
    bad.write_text((EXAMPLES / "tiny-cpu.yaml").read_text(encoding="utf-8") + "\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "leantrain.cli", "train", str(bad), "--set",
                          "parallelism.pipeline_parallel=2", "--set", "parallelism.pipeline_schedule=dualpipe",
                          "--set", "parallelism.data_parallel=1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "dualpipe is planning only" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


def test_fp8_speedup_and_whole_run_efficiency_are_spec_knobs() -> None:
    base = load_spec(EXAMPLES / "deepseek-v3.yaml")
    assert plan_inputs(base).fp8_speedup == pytest.approx(FP8_GEMM_SPEEDUP)
    te = load_spec(EXAMPLES / "deepseek-v3.yaml", overrides=["plan.fp8_speedup=1.6"])
    assert plan_inputs(te).fp8_speedup == pytest.approx(1.6)
    data = {"model": {"size_billion": 1}, "data": {"tokens_total": 1e10, "seq_len": 2048},
            "hardware": {"accelerator": "H100", "num_nodes": 1}, "budget": {"target_days": None, "num_gpus": 8}}
    t = make_plan(spec_from_dict(data))["time"]
    own = make_plan(spec_from_dict({**data, "plan": {"whole_run_efficiency": 1.0}}))["time"]
    assert own["whole_run_gpu_hours"] == pytest.approx(t["whole_run_gpu_hours"] * t["whole_run_efficiency"])
    assert own["predicted_gpu_hours"] == pytest.approx(t["predicted_gpu_hours"])  # the step-time part is apart
