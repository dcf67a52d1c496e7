"""Formula unit tests: FLOPs per token, Korthikanti et al. 2022 activations, ZeRO divisions, pipeline bubble."""

from __future__ import annotations

import contextlib

import pytest
import torch

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
    # full recompute: the blocks' forward again, not the output projection (1000 × 256); with early stop not the
    # down projections either (2 layers × 512 × 256)
    assert f.hardware("full") == pytest.approx(f.model * 4 / 3 - 2 * 1000 * 256)
    assert f.hardware("full", early_stop=True) == pytest.approx(f.model * 4 / 3 - 2 * 1000 * 256 - 2 * 2 * 512 * 256)
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


def _count_grouped_mm() -> None:
    """Teach torch's FLOP counter `aten._grouped_mm` (the MoE experts' GEMMs, model/moe.py), which it does not
    count: 2·m·k·n for rows (m, k) against stacked (experts, k, n) weights, and for the weight gradient's
    (k, rows) against (rows, n)."""
    from torch.utils.flop_counter import register_flop_formula

    op = torch.ops.aten._grouped_mm
    from torch.utils.flop_counter import flop_registry
    if op in flop_registry or op.default in flop_registry:
        return

    @register_flop_formula(op)
    def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
        n = b_shape[2] if len(b_shape) == 3 else b_shape[1]
        return 2 * a_shape[0] * a_shape[1] * n


MOE = {"architecture": "moe", "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "num_shared_experts": 0}}


@pytest.mark.parametrize("compute,model", [
    ("bf16", "dense"), ("fp8", "dense"), ("bf16", "moe"), ("bf16", "moe-shared"), ("bf16", "moe-shared-dense1"),
])
def test_recompute_flops_are_the_matmuls_the_trainer_runs(compute: str, model: str) -> None:
    """The plan's hardware FLOPs per token under none / op / full against torch's FLOP counter on the trainer's
    model (forward + backward, recompute included; the counter sees the matmuls, not the CPU attention kernel, so
    the plan's attention part is taken off). Full recompute repeats the blocks' forward but not the output
    projection's, and torch's early stop ends it before a block's last matmul in bf16: a dense block's down
    projection, an MoE block's shared experts' (the routed experts' runs again: their weighted combine saves
    its output), which a float8 Linear (torchao saves after its GEMM) runs again. Until 2026-12-06 full was
    priced as model × 4/3: 7.6 % (bf16) above what the dense model runs; and until that evening with every
    MoE block's shared down projection repeated (1.5 % above what the shared-expert model runs)."""
    from torch.utils.flop_counter import FlopCounterMode

    from leantrain.model import build_model, model_args_from_spec
    from leantrain.plan.inputs import plan_inputs
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    _count_grouped_mm()
    model_fields = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                    "vocab_size": 96, "tie_embeddings": False}
    if model.startswith("moe"):
        moe = {**MOE["moe"], "num_shared_experts": 1 if "shared" in model else 0,
               "first_dense_layers": 1 if "dense1" in model else 0}
        model_fields = {**model_fields, "architecture": "moe", "moe": moe}
    spec = spec_from_dict({"model": model_fields, "data": {"tokens_total": 1e6, "seq_len": 32},
                           "training": {"global_batch_tokens": 64}, "precision": {"compute": compute}})
    inputs = plan_inputs(spec)
    assert inputs.recompute_skips_down is (compute == "bf16")
    policy = PrecisionPolicy(compute=compute, param_dtype=torch.float32, device_type="cpu")
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    modes = ("none", "op", "full") if model == "dense" else ("none", "full")  # op: dense SwiGLU only
    for recompute in modes:
        built = apply_precision(build_model(model_args_from_spec(spec.model, max_seq_len=32),
                                            device=torch.device("cpu"), seed=0), policy)
        built.set_recompute(recompute)  # type: ignore[arg-type]
        with FlopCounterMode(display=False) as counter:
            with policy.autocast():
                loss = built(tokens).float().logsumexp(-1).mean()
            loss.backward()
        planned = (inputs.hardware_flops_per_token(recompute) - inputs.flops.hardware_attention(recompute))  # type: ignore[arg-type]
        assert counter.get_total_flops() / tokens.numel() == pytest.approx(planned, rel=1e-9), recompute


def test_recompute_reruns_the_tp_collectives_it_does_not_keep() -> None:
    """Per layer and micro-batch TP moves 4 all-reduces' bytes (2 forward, 2 backward). A recompute repeats those of
    the forward it redoes, up to torch's early stop, which comes before the collective after the down projection:
    full 1.5 all-reduces' bytes with sequence parallelism (two all-gathers and the reduce-scatter after wo) and 1
    without (the all-reduce after wo); op keeps the reduce-scatters' outputs, so 1 with SP (the all-gathers) and 1
    without. A reentrant recompute (`plan.recompute_early_stop: false`) repeats full's 2."""
    from dataclasses import replace

    inputs = replace(_inputs(), tp_overlap=0.0)

    def tp_comm(recompute: str, sp: bool, **changes: object) -> float:
        layout = Layout(dp=2, tp=4, pp=1, zero=3, recompute=recompute, sequence_parallel=sp)  # type: ignore[arg-type]
        return step_time(replace(inputs, **changes), layout, sequences_per_step=8).tp_comm_s

    for sp in (True, False):
        none = tp_comm("none", sp)
        assert tp_comm("selective", sp) == pytest.approx(none)
        assert tp_comm("op", sp) == pytest.approx(none * 5 / 4)
        assert tp_comm("full", sp, recompute_early_stop=False) == pytest.approx(none * 6 / 4)
    assert tp_comm("full", True) == pytest.approx(tp_comm("none", True) * 5.5 / 4)
    assert tp_comm("full", False) == pytest.approx(tp_comm("none", False) * 5 / 4)


def test_tp_recompute_calls_are_what_the_rehearsal_counts() -> None:
    """`leantrain rehearse` (the trainer under a fake process group) at TP 2, 2 layers, 8 micro-batches: the TP
    collectives each recompute mode adds per layer and micro-batch, in all-reduces' bytes (an all-gather or a
    reduce-scatter moves half an all-reduce's), are `timing.tp_recompute_calls`."""
    from pathlib import Path

    from leantrain.golive.rehearse import rehearse
    from leantrain.plan.timing import tp_recompute_calls
    from leantrain.spec import load_spec

    weight = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"
    for sp in (True, False):
        counted = {}
        for recompute in ("none", "op", "full"):
            spec = load_spec(example, overrides=[
                "parallelism.tensor_parallel=2", "parallelism.data_parallel=1",
                f"parallelism.sequence_parallel={str(sp).lower()}", f"training.activation_checkpointing={recompute}",
                "model.n_layers=2", "training.micro_batch=1", "hardware.num_nodes=1", "hardware.gpus_per_node=2"])
            rank = rehearse(spec, ranks=[0], isolated=False, depth="full")["ranks"][0]
            counted[recompute] = sum(weight[c["op"]] * c["count"] for c in rank["collectives_per_step"]
                                     if c["group"] == "tp")
            per = 2 * rank["num_microbatches"]  # layers × micro-batches
        for recompute in ("op", "full"):
            layout = Layout(dp=1, tp=2, pp=1, zero=3, recompute=recompute, sequence_parallel=sp)  # type: ignore[arg-type]
            assert (counted[recompute] - counted["none"]) / per == tp_recompute_calls(layout), (sp, recompute, counted)


def _saved_bytes_per_token(model_fields: dict, *, layers: int, seq_len: int, bf16_weights: bool = False) -> float:
    """Bytes autograd saves in one forward of the trainer's model as it runs on one rank without FSDP2: fp32
    parameters under bf16 autocast (train/precision.py), once per storage. `bf16_weights`: the weights in bf16
    and no autocast, as the blocks compute under FSDP2's bf16 gathering."""
    from leantrain.model import build_model, model_args_from_spec
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    spec = spec_from_dict({"model": {**model_fields, "n_layers": layers}, "data": {"tokens_total": 1e6,
                           "seq_len": seq_len}, "training": {"global_batch_tokens": seq_len},
                           "precision": {"compute": "bf16"}})
    policy = PrecisionPolicy(compute="bf16", param_dtype=torch.float32, device_type="cpu")
    model = apply_precision(build_model(model_args_from_spec(spec.model, max_seq_len=seq_len),
                                        device=torch.device("cpu"), seed=0), policy)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if bf16_weights:  # the parameters only: buffers (RoPE's tables) stay fp32, as FSDP2's param_dtype leaves them
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
            contextlib.nullcontext() if bf16_weights else policy.autocast()):
        model(torch.randint(0, model_fields["vocab_size"], (1, seq_len)))
    return float(sum(saved.values()))


@pytest.mark.parametrize("top_k, shared", [(2, 0), (3, 1)])
def test_an_moe_layer_saves_what_the_plan_counts(top_k: int, shared: int) -> None:
    """Per layer and token, what an eager MoE block saves with bf16 weights (as under FSDP2) is the plan's count
    (plan/activations.py `_moe_mlp_bytes`: per routed copy the dispatched row, the expert's four SwiGLU tensors and
    its output, kept for the routing weight's gradient). Until 2026-12-07 the layer summed its weighted rows into
    their tokens with torch's `index_add_`, which saves its whole source as well: one more (tokens × k, d_model)
    tensor, 448 MiB per layer and micro-batch at DeepSeek-V3's widths (model/moe.py `_SumIntoTokens`)."""
    fields = {"d_model": 256, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 512, "vocab_size": 256,
              "tie_embeddings": False, "architecture": "moe",
              "moe": {"num_experts": 4, "top_k": top_k, "expert_hidden": 128, "num_shared_experts": shared,
                      "first_dense_layers": 0}}
    short, long = 128, 256
    per_layer = ((_saved_bytes_per_token(fields, layers=2, seq_len=long, bf16_weights=True)
                  - _saved_bytes_per_token(fields, layers=1, seq_len=long, bf16_weights=True))
                 - (_saved_bytes_per_token(fields, layers=2, seq_len=short, bf16_weights=True)
                    - _saved_bytes_per_token(fields, layers=1, seq_len=short, bf16_weights=True))) / (long - short)
    inputs = plan_inputs(spec_from_dict({"model": {**fields, "n_layers": 2}, "data": {"tokens_total": 1e6,
                                         "seq_len": long}, "training": {"global_batch_tokens": long},
                                         "precision": {"compute": "bf16"}}))
    terms = activation_terms(inputs.shape, seq_len=long, act_bytes=inputs.act_bytes, flash=True, moe_layer=True)
    planned = layer_activation_bytes(terms, tokens=1, tp=1, sp=False, recompute="none", act_bytes=inputs.act_bytes,
                                     d_model=256)
    assert planned == pytest.approx(per_layer, rel=0.005)


@pytest.mark.parametrize("model", ["swiglu", "gelu", "moe", "moe-shared-top3"])
def test_autocast_saves_a_cast_per_linear_that_the_plan_counts(model: str) -> None:
    """One rank without FSDP2 runs bf16 under torch.autocast over fp32 weights: each Linear casts the norm's fp32
    output itself and keeps its own copy (wq, wk, wv; w1 and w3; an MoE layer's router and shared w1/w3), where
    under FSDP2 one bf16 output is shared. Per layer and token, from two depths and two
    sequence lengths (weights and per-position tables cancel), the plan's eager count with `autocast` equals
    what the model saves; without it the plan was 10 d-model-widths of bf16 short on a SwiGLU block (20 %)."""
    from leantrain.plan.activations import activation_terms, layer_activation_bytes

    fields = {"d_model": 256, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 512, "vocab_size": 256,
              "tie_embeddings": False}
    if model == "gelu":
        fields |= {"mlp": "gelu", "ffn_hidden": 1024}
    elif model.startswith("moe"):
        shared, top_k = (1, 3) if "shared" in model else (0, 2)
        fields |= {"architecture": "moe", "moe": {"num_experts": 4, "top_k": top_k, "expert_hidden": 128,
                                                  "num_shared_experts": shared, "first_dense_layers": 0}}
    short, long = 128, 256
    per_layer = ((_saved_bytes_per_token(fields, layers=2, seq_len=long)
                  - _saved_bytes_per_token(fields, layers=1, seq_len=long))
                 - (_saved_bytes_per_token(fields, layers=2, seq_len=short)
                    - _saved_bytes_per_token(fields, layers=1, seq_len=short))) / (long - short)
    spec = spec_from_dict({"model": {**fields, "n_layers": 2}, "data": {"tokens_total": 1e6, "seq_len": long},
                           "training": {"global_batch_tokens": long}, "precision": {"compute": "bf16"}})
    inputs = plan_inputs(spec)
    assert inputs.autocast_casts(Layout(dp=1, tp=1, pp=1, zero=0))
    assert not inputs.autocast_casts(Layout(dp=2, tp=1, pp=1, zero=0))  # FSDP2 gathers bf16 weights
    assert not inputs.autocast_casts(Layout(dp=1, tp=2, pp=1, zero=0))
    planned = {}
    for autocast in (False, True):
        terms = activation_terms(inputs.shape, seq_len=long, act_bytes=inputs.act_bytes, flash=True,
                                 moe_layer=model.startswith("moe"), autocast=autocast)
        planned[autocast] = layer_activation_bytes(terms, tokens=1, tp=1, sp=False, recompute="none",
                                                   act_bytes=inputs.act_bytes, d_model=256)
    assert planned[True] == pytest.approx(per_layer, rel=0.005)  # MoE: 20 of 12,400 bytes a token apart
    assert planned[False] < 0.9 * per_layer
