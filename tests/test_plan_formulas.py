"""Formula unit tests: FLOPs per token, Korthikanti et al. 2022 activations, ZeRO divisions, pipeline bubble."""

from __future__ import annotations

import pytest

from leantrain.plan.activations import activation_terms, in_flight_microbatches, layer_activation_bytes
from leantrain.plan.flops import flops_per_token
from leantrain.plan.inputs import (
    RING_BASE_LATENCY_S,
    RING_STEP_LATENCY_S,
    TREE_LEVEL_LATENCY_S,
    plan_inputs,
)
from leantrain.plan.layout import Layout
from leantrain.plan.memory import memory_per_gpu
from leantrain.plan.timing import pipeline_bubble_fraction, ring_latency_s, ring_time_s, step_time
from leantrain.spec import resolve_shape, spec_from_dict
from leantrain.spec.schema import ModelSpec

S, B, H, A = 2048, 4, 4096, 32  # sequence, micro-batch, hidden, heads (GPT-style, as in the paper)


def gpt_shape():
    return resolve_shape(ModelSpec(n_layers=4, d_model=H, n_heads=A, n_kv_heads=A, ffn_hidden=4 * H,
                                   vocab_size=51200))


def korthikanti_bytes(*, tp: int, sp: bool, recompute: str) -> float:
    terms = activation_terms(gpt_shape(), seq_len=S, act_bytes=2, flash=False, moe_layer=False, gpt_style=True)
    return layer_activation_bytes(terms, tokens=S * B, tp=tp, sp=sp, recompute=recompute, act_bytes=2, d_model=H)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table_2(t: int) -> None:
    sbh, extra = S * B * H, 5 * A * S / H
    assert korthikanti_bytes(tp=t, sp=False, recompute="none") == pytest.approx(sbh * (10 + 24 / t + extra / t))
    assert korthikanti_bytes(tp=t, sp=True, recompute="none") == pytest.approx(sbh / t * (34 + extra))
    assert korthikanti_bytes(tp=t, sp=False, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert korthikanti_bytes(tp=t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert korthikanti_bytes(tp=t, sp=False, recompute="full") == pytest.approx(2 * sbh)
    assert korthikanti_bytes(tp=t, sp=True, recompute="full") == pytest.approx(2 * sbh / t)


def test_our_block_activations_swiglu_gqa_flash() -> None:
    """Our block in bf16: 2 norms (fp32 input copy, normalised, scaled + fp32 rstd), RoPE tables cast for q and
    k, q/k/v (GQA: k and v are kv_dim wide), out-projection input, 4 SwiGLU tensors, fp32 log-sum-exp."""
    shape = resolve_shape(ModelSpec(n_layers=2, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336))
    terms = activation_terms(shape, seq_len=8192, act_bytes=2, flash=True, moe_layer=False)
    assert terms.replicated == 2 * ((4 + 2 * 2) * 4096 + 4) + 2 * 2 * 2 * 128
    assert terms.sharded == 2 * (4096 + 2 * 1024) + 2 * 4096 + 4 * 2 * 14336
    assert terms.core == 4 * 32


def test_flops_count_gqa_swiglu_and_moe_active() -> None:
    dense = resolve_shape(ModelSpec(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn_hidden=512,
                                    vocab_size=1000))
    f = flops_per_token(dense, seq_len=128)
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512  # q, o + k, v (GQA) + SwiGLU
    assert f.matmul == 6 * (2 * per_layer + 1000 * 256)
    assert f.attention == 12 * 2 * 256 * 128
    assert flops_per_token(dense, seq_len=128, causal_halving=True).attention == f.attention / 2
    assert f.hardware("full") == pytest.approx(f.model * 4 / 3)
    moe = resolve_shape(ModelSpec(architecture="moe", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2,
                                  ffn_hidden=512, vocab_size=1000,
                                  moe={"num_experts": 8, "top_k": 2, "num_shared_experts": 1, "expert_hidden": 128}))
    active_mlp = 256 * 8 + 3 * 3 * 256 * 128  # router + (2 routed + 1 shared) experts
    assert flops_per_token(moe, seq_len=128).matmul == 6 * (2 * (2 * 256 * 256 + 2 * 256 * 128 + active_mlp)
                                                            + 1000 * 256)


def _inputs(**parallel):
    spec = spec_from_dict({"model": {"n_layers": 8, "d_model": 1024, "n_heads": 8, "n_kv_heads": 8,
                                     "ffn_hidden": 2816, "vocab_size": 32000},
                           "data": {"tokens_total": 1e9, "seq_len": 1024},
                           "training": {"global_batch_tokens": 64 * 1024},
                           "precision": {"compute": "bf16", "master_weights": "fp32", "grad_reduce": "fp32",
                                         "optimizer_state": "fp32"},
                           "hardware": {"accelerator": "H100-SXM"}})
    return plan_inputs(spec)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_levels_divide_the_right_states(zero: int) -> None:
    """As the trainer's FSDP2 holds them: the fp32 parameter is the master copy at every level, and every level
    ≥ 1 shards it with its gradient and both moments (FSDP2 has no ZeRO-1/2 that keeps gradients whole);
    ZeRO-0 replicates. The fp32 RoPE tables are an unsharded buffer beside the parameters."""
    from leantrain.plan.memory import rope_table_bytes

    inputs = _inputs()
    rope = rope_table_bytes(inputs)
    base = memory_per_gpu(inputs, Layout(dp=1, tp=1, pp=1, zero=0), num_microbatches=1)
    mem = memory_per_gpu(inputs, Layout(dp=8, tp=1, pp=1, zero=zero), num_microbatches=1)
    params = inputs.shape.total_params()
    assert base.params - rope == pytest.approx(4 * params, rel=1e-3)  # the fp32 master is the parameter
    assert base.optimizer == pytest.approx(8 * params, rel=1e-3)  # two fp32 moments
    shard = 8 if zero >= 1 else 1
    assert mem.params - rope == pytest.approx(4 * params / shard, rel=1e-3)
    assert mem.grads == pytest.approx(base.grads / shard)
    assert mem.optimizer == pytest.approx(base.optimizer / shard)
    assert mem.params + mem.grads + mem.optimizer - rope == pytest.approx(16 * params / shard, rel=1e-3)


def test_hsdp_shards_only_within_a_replica() -> None:
    from leantrain.plan.memory import rope_table_bytes

    inputs = _inputs()
    rope = rope_table_bytes(inputs)
    full = memory_per_gpu(inputs, Layout(dp=16, tp=1, pp=1, zero=3), num_microbatches=1)
    hsdp = memory_per_gpu(inputs, Layout(dp=16, tp=1, pp=1, zero=3, dp_replicate=2), num_microbatches=1)
    assert hsdp.params - rope == pytest.approx(2 * (full.params - rope))
    assert hsdp.optimizer == pytest.approx(2 * full.optimizer)


def test_eight_bit_states_shrink_the_optimizer() -> None:
    spec_inputs = _inputs()
    from dataclasses import replace

    from leantrain.plan.inputs import MOMENT_BYTES
    eight = replace(spec_inputs, moment_bytes=MOMENT_BYTES["8bit"])
    layout = Layout(dp=1, tp=1, pp=1, zero=0)
    ratio = (memory_per_gpu(eight, layout, num_microbatches=1).optimizer
             / memory_per_gpu(spec_inputs, layout, num_microbatches=1).optimizer)
    assert ratio == pytest.approx(2 * (1 + 4 / 256) / 8)  # the moments only: the fp32 parameter is the master


def test_pipeline_bubble_and_in_flight_microbatches() -> None:
    assert pipeline_bubble_fraction(pp=4, num_microbatches=12) == pytest.approx(3 / 12)
    assert pipeline_bubble_fraction(pp=4, num_microbatches=12, virtual_stages=2) == pytest.approx(3 / 24)
    # DualPipe: (p/2 − 1)(F&B + B − 3W) with B = 2F, W = F, F&B = 3F → (p/2 − 1)·2F of a 3F micro-batch
    assert pipeline_bubble_fraction(pp=16, num_microbatches=120, schedule="dualpipe") == pytest.approx(7 * 2 / 3 / 120)
    assert pipeline_bubble_fraction(pp=2, num_microbatches=8, schedule="dualpipe") == 0.0
    assert in_flight_microbatches(Layout(dp=1, tp=1, pp=4), 16) == 4  # 1F1B: p on the first stage
    assert in_flight_microbatches(Layout(dp=1, tp=1, pp=4), 2) == 2
    assert in_flight_microbatches(Layout(dp=1, tp=1, pp=4, schedule="gpipe"), 16) == 16
    interleaved = Layout(dp=1, tp=1, pp=4, schedule="interleaved_1f1b", virtual_stages=2)
    # Megatron's warm-up on rank 0: 2(p − 1) + (v − 1)p + 1 = 11 chunks of half a stage = p + (p − 1)/v
    assert in_flight_microbatches(interleaved, 16) == 5.5
    assert in_flight_microbatches(interleaved, 16, stage=3) == 2.5  # last rank: (v − 1)p + 1 chunks
    assert in_flight_microbatches(Layout(dp=1, tp=1, pp=4), 16, stage=1) == 3  # 1F1B: p − stage
    inputs = _inputs()
    st = step_time(inputs, Layout(dp=1, tp=1, pp=4), sequences_per_step=64)
    assert st.bubble_s / st.compute_s == pytest.approx(3 / 64)


def test_ring_costs() -> None:
    ar = ring_time_s(num_bytes=1e9, ranks=8, bandwidth_bytes_s=1e11, kind="all_reduce")
    ag = ring_time_s(num_bytes=1e9, ranks=8, bandwidth_bytes_s=1e11, kind="all_gather")
    # bandwidth: all-reduce moves twice all-gather's bytes; latency: 2(n − 1) ring steps against n − 1
    assert ar - ag == pytest.approx(7 / 8 * 1e9 / 1e11 + 7 * RING_STEP_LATENCY_S["intra"])
    assert ag == pytest.approx(RING_BASE_LATENCY_S + 7 * RING_STEP_LATENCY_S["intra"] + 7 / 8 * 1e9 / 1e11)
    # a ring over 2,048 ranks pays ~13.5 ms per call; an all-reduce takes the tree (22 levels) instead
    big = ring_latency_s(ranks=2048, kind="all_gather", across_nodes=True)
    assert big == pytest.approx(RING_BASE_LATENCY_S + 2047 * RING_STEP_LATENCY_S["inter"])
    assert ring_latency_s(ranks=2048, kind="all_reduce", across_nodes=True) == pytest.approx(
        RING_BASE_LATENCY_S + 22 * TREE_LEVEL_LATENCY_S)
    assert ring_time_s(num_bytes=1e9, ranks=8, bandwidth_bytes_s=1e11, kind="all_gather", calls=3) == pytest.approx(
        ag + 2 * (RING_BASE_LATENCY_S + 7 * RING_STEP_LATENCY_S["intra"]))
    assert ring_time_s(num_bytes=1e9, ranks=1, bandwidth_bytes_s=1e11, kind="all_reduce") == 0.0


def test_recompute_reruns_the_tp_collectives_it_does_not_keep() -> None:
    """Per layer and micro-batch TP moves 4 all-reduces' bytes (2 forward, 2 backward); full recompute repeats the
    forward's 2; op keeps the reduce-scatters' outputs, so with sequence parallelism it repeats only the 2 all-gathers
    (1 all-reduce's bytes) and without it both all-reduces (until 2026-12-06 op was priced with no repeat)."""
    from dataclasses import replace

    inputs = replace(_inputs(), tp_overlap=0.0)

    def tp_comm(recompute: str, sp: bool) -> float:
        layout = Layout(dp=2, tp=4, pp=1, zero=3, recompute=recompute, sequence_parallel=sp)  # type: ignore[arg-type]
        return step_time(inputs, layout, sequences_per_step=8).tp_comm_s

    for sp in (True, False):
        none = tp_comm("none", sp)
        assert tp_comm("selective", sp) == pytest.approx(none)
        assert tp_comm("full", sp) == pytest.approx(none * 6 / 4)
    assert tp_comm("op", True) == pytest.approx(tp_comm("none", True) * 5 / 4)
    assert tp_comm("op", False) == pytest.approx(tp_comm("full", False))
