"""Activation memory: the bytes one transformer block saves for backward per token, per recompute mode and
kernel set, and how many micro-batches each pipeline stage holds at its peak.

Per-layer terms follow the bookkeeping of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, §4 and Table 2): every tensor autograd keeps, split into
- `replicated`: layer-boundary tensors (norm inputs/outputs), divided by tp only with sequence parallelism;
- `sharded`: tensors inside attention and the MLP, divided by tp;
- `core`: the attention core (scores or flash's log-sum-exp), which selective recompute drops.
Three kernel sets:
- `gpt_style`: their GPT block (LayerNorm, 4h GeLU MLP, dropout, unfused softmax): reproduces Table 2 exactly.
- eager (our block, model/transformer.py, as the FakeTensor trace sees it): RMSNorm keeps an fp32 copy of its
  input, the normalised and the scaled tensor and an fp32 rstd; SwiGLU keeps gate, up, silu(gate), product
  (`model.mlp: gelu` / `squared_relu`: two tensors of the hidden width); RoPE's cos/sin tables are cast for q and k.
- fused (torch.compile, Transformer Engine, Megatron's fused kernels): a norm keeps its input, its output
  (the next matmul's input) and an fp32 rstd; SwiGLU keeps its input (gate and up) and its output (the down
  projection's input); RoPE is recomputed. With fp8 compute the Linear inputs are cached in fp8 (DeepSeek-V3
  report §3.3.3): `linear_bytes` = 1.
Recompute modes: none; selective (Korthikanti: the attention core is recomputed; with fused kernels also
the norm outputs and SwiGLU outputs, Megatron-core's recompute modules core_attn, layernorm and moe_act, the
set DeepSeek-V3 §3.3.3 recomputes: RMSNorm, the up-projections and SwiGLU; with MLA also its q/k/v
up-projection outputs, only the latents are kept); op (torchtitan's
selective-op policy: every matmul output except every second one is kept, plus the attention output and the
block input; elementwise ops are recomputed); full (only the block input survives the forward, and one
block's activations are rebuilt at a time during its backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from leantrain.plan.flops import Recompute
from leantrain.plan.layout import Layout
from leantrain.spec.shapes import ModelShape, stage_layer_counts

LOGIT_SAVED_BYTES = 4.0  # per logit: the fp32 log-softmax cross-entropy keeps for backward (an activation)
# Sequence parallelism's gathered matmul inputs (ActivationTerms.sp_gathered), measured by `leantrain
# rehearse` (TP8 activations 0.99 with them, 0.86 without; bench/plan_vs_rehearsal.py). A switch so that the
# calibration can be compared without them (tests/test_plan_calibration.py, docs/plan.md).
SP_GATHERED_PLANNED = True


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes saved for backward per token of one layer, split by how tensor parallelism divides them."""

    replicated: float  # layer-boundary tensors: divided by tp only with sequence parallelism
    sharded: float  # inside attention/MLP: divided by tp
    core: float  # attention-core tensors that selective recompute drops (also divided by tp)
    op_saved: float = 0.0  # what torchtitan's selective-op policy keeps (recompute="op"), before tp
    selective_replicated: float = 0.0  # boundary bytes selective recompute also drops (fused: norm outputs)
    selective_sharded: float = 0.0  # inner bytes it also drops (fused: SwiGLU outputs)
    # Part of `replicated` that sequence parallelism does not divide: in our eager blocks under torch's DTensor
    # sequence parallelism each norm's output is all-gathered for the column-parallel matmuls that follow, and
    # those keep the gathered (whole-sequence) tensor for their backward (Megatron's SP keeps the shard and
    # gathers again in the backward). Measured by `leantrain rehearse` at TP 2 and 8: 2 + 2 × 4 + 1 whole-
    # sequence bf16 hidden tensors for 4 layers and the head. Also the eager block's cast RoPE tables, made for the
    # whole sequence that q and k carry under sequence parallelism (tests/test_plan_tp_activations.py, to the byte).
    sp_gathered: float = 0.0
    # Part of `sharded` (an MoE layer's) that is whole rows: the routed copies' input and output rows, their
    # indices and routing weights, the router's scores. Experts split over TP (`Layout.experts_split_over_tp`: the
    # trainer's TP without EP, parallel/expert.py `apply_expert_tensor_parallel`) split only the experts' hidden
    # width, and every TP rank routes all of the layer's tokens: these rows are whole on each (`leantrain rehearse`,
    # the grid's `moe fsdp4 tp2`). EP × TP splits the tokens over TP instead: divided by tp like the rest.
    expert_rows: float = 0.0


def norm_saved_bytes(*, act_bytes: float, gpt_style: bool, fused: bool = False) -> float:
    """Bytes per hidden value one pre-norm keeps, including the norm output that feeds the next matmul.

    GPT (LayerNorm) and fused kernels: its input and its output. Our eager RMSNorm normalises in fp32 and then
    multiplies by its weight: an fp32 copy of the input, the normalised tensor and the scaled output."""
    return 2 * act_bytes if gpt_style or fused else 4.0 + 2 * act_bytes


def _moe_mlp_bytes(shape: ModelShape, *, e: float, lin: float, fused: bool) -> tuple[float, float]:
    """(per-token bytes of an MoE layer's MLP, the part of them that is whole rows, not the experts' hidden
    width): dispatched copies, experts' SwiGLU tensors, shared experts and fp32 router scores (balanced routing:
    a GPU holds its own tokens' share of the expert work). The rows (each routed copy's input and output rows,
    its indices and routing weight, the router's scores) are what expert tensor parallelism does not split."""
    assert shape.moe is not None
    m, h = shape.moe, shape.d_model
    if fused:  # SwiGLU input (gate, up) + output; the routing weight is applied inside the expert (before
        # its down projection, as Megatron's moe_apply_probs_on_input), so expert outputs need not be kept
        per_expert = 2 * lin * m.expert_hidden + lin * m.expert_hidden
        rows = m.top_k * lin * h
    else:  # our eager MoE (model/moe.py): per routed copy the dispatched input, the expert's gate, up,
        # silu(gate) and product, its output (kept for the routing weight's gradient), the int64 sort order and
        # token index and the fp32 routing weight
        per_expert = 4 * e * m.expert_hidden
        rows = m.top_k * (e * h + e * h + 2 * 8.0 + 4.0)
    # Router (fp32): logits, scores and the selection scores per expert, the int64 top-k indices.
    router = 3 * 4.0 * m.num_experts + 8.0 * m.top_k
    routed = rows + m.top_k * per_expert
    return routed + m.num_shared_experts * per_expert + router, rows + router


def activation_terms(shape: ModelShape, *, seq_len: int, act_bytes: float, flash: bool, moe_layer: bool,
                     gpt_style: bool = False, fused: bool = False, linear_bytes: float | None = None,
                     autocast: bool = False) -> ActivationTerms:
    """Per-token saved bytes of one transformer block (see the module docstring for each kernel set).
    `autocast` (`PlanInputs.autocast_casts`): the eager block runs under torch.autocast over fp32 weights, and
    each Linear reading a norm's fp32 output saves its own bf16 cast of it (`autocast_cast_bytes`)."""
    e, h, a, f = act_bytes, shape.d_model, shape.n_heads, shape.ffn_hidden
    lin = e if linear_bytes is None else linear_bytes
    if gpt_style:
        replicated = 2 * norm_saved_bytes(act_bytes=e, gpt_style=True) * h + 2 * 1.0 * h  # + 2 dropout masks
        core = (2 * e + 1.0) * a * seq_len  # softmax output, dropout mask, dropout output
        mlp = 2 * e * f
        rope = 0.0
    elif fused:
        replicated = 2 * (e * h + lin * h + 4.0)  # two norms: input, output (the next matmul's input), rstd
        core = 4.0 * a if flash else e * a * seq_len
        # the activation's input (SwiGLU: gate and up; GeLU/squared ReLU: the up projection) and its output
        mlp = (shape.mlp_matrices - 1) * e * f + lin * f
        rope = 0.0
    else:
        replicated = 2 * (norm_saved_bytes(act_bytes=e, gpt_style=False) * h + 4.0)
        core = 4.0 * a if flash else e * a * seq_len
        # SwiGLU: gate, up, silu(gate), their product; GeLU: its input and output; squared ReLU: relu's output
        # (which the square also keeps) and the square
        mlp = (4 if shape.mlp == "swiglu" else 2) * e * f
        rope = 0.0 if e >= 4 else 2 * 2 * e * shape.head_dim
    expert_rows = 0.0
    if moe_layer and shape.moe is not None:
        mlp, expert_rows = _moe_mlp_bytes(shape, e=e, lin=lin, fused=fused or gpt_style)
    q_width, k_width, v_width = shape.attention_widths
    qkv = e * (q_width + k_width + v_width)
    if shape.mla is not None:  # the latents the up-projections read are kept too
        qkv += lin * (shape.mla.q_lora_rank + shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim)
    out_proj_input = lin * shape.attention_core_widths[1]
    sel_replicated = sel_sharded = 0.0
    if fused and not gpt_style:  # Megatron's recompute modules core_attn + layernorm + moe_act / SwiGLU
        sel_replicated = 2 * lin * h
        sel_sharded = lin * f
        if moe_layer and shape.moe is not None:
            sel_sharded = lin * shape.moe.expert_hidden * (shape.moe.top_k + shape.moe.num_shared_experts)
        if shape.mla is not None:  # DeepSeek-V3 §3.3.3 also recomputes the MLA up-projections
            sel_sharded += e * (q_width + k_width + v_width)
    # torchtitan's op policy over wq, wk, wv, wo, w1, w3, w2 keeps the 1st, 3rd, 5th and 7th outputs (q, v,
    # w1, w2) plus the attention output and the block input; MoE layers keep their routed tensors as above.
    op_mlp = mlp if moe_layer and shape.moe is not None else e * (f + h)
    op_saved = e * (shape.q_dim + shape.kv_dim) + op_mlp + e * shape.q_dim + e * h
    # the two norms' outputs (see ActivationTerms), kept whole-sequence by torch's DTensor SP, and RoPE's cast tables
    sp_gathered = (2 * e * h if SP_GATHERED_PLANNED and not (fused or gpt_style) else 0.0) + rope
    if autocast and not (fused or gpt_style):
        replicated += autocast_cast_bytes(shape, act_bytes=e, moe_layer=moe_layer)
    return ActivationTerms(replicated=replicated + rope, sharded=qkv + out_proj_input + mlp, core=core,
                           op_saved=op_saved, selective_replicated=sel_replicated, selective_sharded=sel_sharded,
                           sp_gathered=sp_gathered, expert_rows=expert_rows)


def autocast_cast_bytes(shape: ModelShape, *, act_bytes: float, moe_layer: bool) -> float:
    """Per-token bytes of the compute-dtype input copies one eager block saves under torch.autocast over fp32
    weights: autocast casts each Linear's fp32 input itself, so the Linears that read one norm's output keep a
    copy each (wq, wk, wv; SwiGLU's w1 and w3, GeLU's w1; an MoE layer's router and its shared experts' w1 and w3),
    where under FSDP2's bf16 gathering they share one bf16 output. The routed experts cast their dispatched rows
    once (model/moe.py), the copy `_moe_mlp_bytes` counts. Counted on the trainer's model with saved-tensor hooks
    (tests/test_plan_formulas.py; until 2026-12-07 top-k more copies were counted here, which matched because
    torch's `index_add_` kept the weighted expert outputs, a copy the MoE layer no longer saves). Latent
    attention (`model.mla`): its two down-projections' copies; the latents' own casts are not counted."""
    attention = 3 if shape.mla is None else 2
    if moe_layer and shape.moe is not None:
        mlp = 1 + (2 if shape.moe.num_shared_experts else 0)
    else:
        mlp = shape.mlp_matrices - 1
    return act_bytes * shape.d_model * (attention + mlp)


def float8_tp_saved_bytes(shape: ModelShape, *, tp: int, sp: bool, recompute: Recompute, act_bytes: float,
                          moe_layer: bool) -> float:
    """Per-token bytes one eager block saves less under fp8 with tensor parallelism than `layer_activation_bytes`
    counts (negative: more). torchao's float8 TP styles (parallel/tensor.py) cast each split Linear's input to
    float8 before its collective, and the Linear keeps that float8 copy for its weight gradient:
    - column-wise inputs: with sequence parallelism the sub-block's one gathered input (`sp_gathered`) in float8;
      without it each of wq, wk, wv (and w1, w3) keeps a float8 copy of the norm output the bf16 Linears share;
    - row-wise inputs: wo's (the attention output) and w2's (the activation's output, which no other backward
      needs) in float8. Without recompute the attention kernel also keeps its own bf16 output, so wo's float8
      copy is added to it; `selective` recomputes the kernel, which then keeps nothing.
    Counted with saved-tensor hooks on the trainer's block under a 2-rank TP mesh (tests/test_plan_tp_activations.py).
    Latent attention and an MoE layer's experts are left as bf16 counts them (the plan stays above)."""
    if tp == 1 or recompute not in ("none", "selective"):
        return 0.0
    h, e = shape.d_model, act_bytes

    def column_inputs(linears: int) -> float:
        if sp:  # the gathered copy the plan counts (`sp_gathered`), none when it does not
            return (e - 1) * h if SP_GATHERED_PLANNED else 0.0
        return (e - linears) * h

    saved = 0.0
    if shape.mla is None:
        q = shape.attention_core_widths[1] / tp
        saved += column_inputs(3) + ((e - 1) * q if recompute == "selective" else -q)
    if not (moe_layer and shape.moe is not None):
        saved += column_inputs(shape.mlp_matrices - 1) + (e - 1) * shape.ffn_hidden / tp
    return saved


def head_activation_bytes(shape: ModelShape, *, tokens: int, act_bytes: float, tp: int,
                          fused: bool = False, sp_tp: int = 1) -> float:
    """The last stage's final norm (its output feeds the output projection) and the fp32 log-probabilities
    cross-entropy keeps, for one micro-batch; `tp` splits the vocabulary, `sp_tp` the sequence (sequence
    parallelism: the norm runs on the rank's share of it, and in eager blocks the output projection keeps its
    gathered input, see ActivationTerms.sp_gathered)."""
    norm = norm_saved_bytes(act_bytes=act_bytes, gpt_style=False, fused=fused) * shape.d_model + 4.0
    gathered = act_bytes * shape.d_model if sp_tp > 1 and not fused else 0.0
    final_norm = tokens * ((norm - gathered) / sp_tp + gathered)
    return final_norm + tokens * shape.vocab_size / tp * LOGIT_SAVED_BYTES


def layer_activation_bytes(terms: ActivationTerms, *, tokens: int, tp: int, sp: bool, recompute: Recompute,
                           act_bytes: float, d_model: int, experts_whole_rows: bool = False) -> float:
    """Bytes one layer keeps for one micro-batch of `tokens` (s·b) under a recompute policy. `experts_whole_rows`:
    the routed experts are split over TP, so their rows (`ActivationTerms.expert_rows`) are whole on each rank."""
    if recompute == "full":  # only the layer input survives the forward
        return tokens * act_bytes * d_model / (tp if sp else 1)
    if experts_whole_rows and tp > 1 and terms.expert_rows:
        whole = terms.expert_rows * (1 - 1 / tp)  # counted below divided by tp, like the experts' hidden tensors
        return tokens * whole + layer_activation_bytes(terms, tokens=tokens, tp=tp, sp=sp, recompute=recompute,
                                                       act_bytes=act_bytes, d_model=d_model)
    if recompute == "op":  # the block input is boundary-sized, the kept matmul outputs are tp-sharded
        boundary = act_bytes * d_model
        kept = boundary / (tp if sp else 1) + (terms.op_saved - boundary + terms.core) / tp
        if tp > 1:
            # but w2 is row-parallel: its kept output is the whole width's partial sum before the reduction, and
            # with sequence parallelism the policy also keeps both reduce-scatters' outputs (after wo and w2).
            # `leantrain rehearse` of the 8B-wide grid row at TP 4 (bench/plan_vs_rehearsal.py "fsdp2 tp4 op").
            kept += boundary * (1 - 1 / tp) + (2 * boundary / tp if sp else 0.0)
        return tokens * kept
    selective = recompute == "selective"
    sharded = terms.sharded - terms.selective_sharded if selective else terms.sharded + terms.core
    replicated = terms.replicated - (terms.selective_replicated if selective else 0.0)
    if sp and tp > 1:
        replicated = (replicated - terms.sp_gathered) / tp + terms.sp_gathered
    return tokens * (replicated + sharded / tp)


@lru_cache(maxsize=1024)
def _stage_layers(n_layers: int, pp: int, virtual_stages: int) -> tuple[int, ...]:
    return tuple(stage_layer_counts(n_layers, pp, virtual_stages))


def stage_layers(n_layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Layers per pipeline stage, as the trainer splits them (`leantrain.spec.shapes.chunk_layers`: the missing
    layers off the first and the last chunk first, Llama 3 report §3.3.2), cached."""
    return list(_stage_layers(n_layers, pp, virtual_stages))


def backward_chunks_at_peak(layout: Layout, num_microbatches: int, *, stage: int = 0) -> int | None:
    """Interleaved 1F1B (v > 1): how many of the stage's v chunks have started their backward while its
    activations are at their peak. After the warm-up (see `in_flight_microbatches`) each steady step runs one
    chunk forward and one backward, the backwards visiting the chunks in blocks of r (torch's
    `_get_1f1b_rank_ops`: chunk v − 1 first), so ⌈steady steps / r⌉ chunks, at most v; then the cool-down only
    frees. 0: every chunk forward runs before the first backward (at most one steady step). None: another
    schedule, where the whole stage is touched at its peak."""
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if p == 1 or layout.schedule != "interleaved_1f1b" or v == 1:
        return None
    per_round = m // max(1, m // p)
    steady = m * v - min((v - 1) * per_round + 2 * (p - stage - 1), m * v)
    return 0 if steady <= 1 else min(v, math.ceil(steady / per_round))


def in_flight_microbatches(layout: Layout, num_microbatches: int, *, stage: int = 0) -> float:
    """Micro-batches (in units of the stage's whole layer set) whose activations a stage holds at its peak.

    1F1B: p − stage (warm-up forwards + the one in its backward), at most m. GPipe: all m. Interleaved 1F1B
    with v chunks, as torch's ScheduleInterleaved1F1B runs it (pipelining/schedules.py `_get_warmup_ops`):
    w = (v − 1)·r + 2(p − stage − 1) warm-up chunk forwards, r the micro-batches per round (m // (m // p), p
    when p divides m), at most m·v, then one more forward before the first backward: min(w + 1, m·v) chunk
    forwards of 1/v of the stage each, i.e. p + (p − 1)/v on the first stage when p divides m (Megatron's
    count: Narayanan et al. 2021; Korthikanti et al. 2022 §4.2.3). DualPipe: p + 1 (each rank runs a stage of
    both directions)."""
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "dualpipe":  # p + 1 on every rank (deepseek-ai/DualPipe's table)
        return float(min(m, p + 1))
    if layout.schedule == "interleaved_1f1b" and v > 1:
        per_round = m // max(1, m // p)
        warmup = min((v - 1) * per_round + 2 * (p - stage - 1), m * v)
        return min(warmup + 1, m * v) / v
    return float(min(p - stage, m))
