"""Memory per GPU: parameters, gradients, optimizer states, activations and buffers for one layout.

Conventions (docs/plan.md has the derivations):
- Weights, gradients and optimizer states are counted for the heaviest pipeline stage and divided by the
  ZeRO/FSDP shard degree (dp / dp_replicate): ZeRO-1 shards optimizer states, ZeRO-2 also gradients,
  ZeRO-3 also weights (Rajbhandari et al. 2020). Routed experts are split over ep and then sharded over
  the shard degree / ep. "Optimizer" holds the fp32 master copy (when weights train in 16-bit) and the
  two Adam moments (fp32, bf16 or 8-bit).
- Activations per layer follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", Table 2): with their GPT block (`gpt_style`) the formula is exactly theirs,
  sbh·(34 + 5as/h) and the tensor/sequence-parallel and recompute variants (tests pin them); by default it
  counts the tensors our own block (model/transformer.py) saves, checked against a FakeTensor trace
  (plan/trace.py). Tensor parallelism divides the tensors inside attention and the MLP; sequence
  parallelism also the layer-boundary ones. Selective recompute drops the attention core; full recompute
  keeps each layer's input plus one layer's activations while its backward runs.
- The first pipeline stage holds the activations of p micro-batches under 1F1B (all m under GPipe,
  p·(1 + (p−1)/(p·v)) under interleaved 1F1B); the last stage holds one, the final norm and the fp32
  log-probabilities of the loss. Routed experts' activations are per token routed (top-k copies): spread
  evenly over the expert-parallel group, a GPU holds those of its own tokens' share.
- Buffers: the FSDP all-gather of the largest unit (two prefetched in the compute dtype plus its
  unsharded gradient), the logits and their fp32 gradient during the loss's backward (tokens × vocab / tp),
  DDP gradient buckets, and a framework reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leantrain.plan.flops import Recompute
from leantrain.plan.inputs import PlanInputs
from leantrain.plan.layout import Layout
from leantrain.spec.shapes import ModelShape

DDP_BUCKET_BYTES = 2 * 25 * 2**20  # two 25 MiB gradient buckets in flight (DDP's default bucket_cap_mb)
LOGIT_SAVED_BYTES = 4.0  # per logit: the fp32 log-softmax cross-entropy keeps for backward (an activation)
LOGIT_TRANSIENT_BYTES = 4.0  # per logit: its fp32 gradient, live with the logits during backward (a buffer)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the heaviest stage; `capacity` is the accelerator's memory."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    capacity: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def headroom(self) -> float:
        """Free bytes (negative when it does not fit)."""
        return self.capacity - self.total

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "total": self.total}


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes saved for backward per token of one layer, split by how tensor parallelism divides them."""

    replicated: float  # layer-boundary tensors: divided by tp only with sequence parallelism
    sharded: float  # inside attention/MLP: divided by tp
    core: float  # attention-core tensors that selective recompute drops (also divided by tp)


def norm_saved_bytes(*, act_bytes: float, gpt_style: bool) -> float:
    """Bytes per hidden value one pre-norm keeps, including the norm output that feeds the next matmul.

    GPT (LayerNorm): its input and its output. Our RMSNorm (model/transformer.py) normalises in fp32 and then
    multiplies by its weight: an fp32 copy of the input, the normalised tensor and the scaled output."""
    return 2 * act_bytes if gpt_style else 4.0 + 2 * act_bytes


def activation_terms(shape: ModelShape, *, seq_len: int, act_bytes: float, flash: bool, moe_layer: bool,
                     gpt_style: bool = False) -> ActivationTerms:
    """Per-token saved bytes of one transformer block.

    gpt_style=True is Korthikanti et al.'s GPT block (LayerNorm, GeLU MLP of 2 saved tensors, dropout masks,
    unfused softmax attention) and reproduces their Table 2 exactly. Otherwise it is our block: RMSNorm as
    above (+ an fp32 rstd per token), grouped-query q/k/v, SwiGLU (gate, up, silu(gate), product), RoPE's
    cos/sin tables cast to the compute dtype for q and k when activations are 16-bit, and an attention core
    that keeps only an fp32 log-sum-exp per head with flash attention (its output is the out-projection
    input, counted once) or the softmax scores without it."""
    e, h, a = act_bytes, shape.d_model, shape.n_heads
    if gpt_style:
        replicated = 2 * norm_saved_bytes(act_bytes=e, gpt_style=True) * h + 2 * 1.0 * h  # + 2 dropout masks
        core = (2 * e + 1.0) * a * seq_len  # softmax output, dropout mask, dropout output
        mlp = 2 * e * shape.ffn_hidden
        rope = 0.0
    else:
        replicated = 2 * (norm_saved_bytes(act_bytes=e, gpt_style=False) * h + 4.0)
        core = 4.0 * a if flash else e * a * seq_len
        mlp = 4 * e * shape.ffn_hidden
        rope = 0.0 if e >= 4 else 2 * 2 * e * shape.head_dim
    if moe_layer and shape.moe is not None:
        m = shape.moe
        per_expert = 4 * e * m.expert_hidden  # SwiGLU: gate, up, silu(gate), product
        # Dispatched copies of each token's hidden state, the experts' hidden tensors, fp32 router scores.
        mlp = m.top_k * (e * h + per_expert) + m.num_shared_experts * per_expert + 4.0 * m.num_experts
    qkv = e * (h + 2 * shape.kv_dim)
    out_proj_input = e * h
    return ActivationTerms(replicated=replicated + rope, sharded=qkv + out_proj_input + mlp, core=core)


def head_activation_bytes(shape: ModelShape, *, tokens: int, act_bytes: float, tp: int) -> float:
    """The last stage's final norm (its output feeds the output projection) and the fp32 log-probabilities
    cross-entropy keeps, for one micro-batch."""
    final_norm = tokens * (norm_saved_bytes(act_bytes=act_bytes, gpt_style=False) * shape.d_model + 4.0)
    return final_norm + tokens * shape.vocab_size / tp * LOGIT_SAVED_BYTES


def layer_activation_bytes(terms: ActivationTerms, *, tokens: int, tp: int, sp: bool, recompute: Recompute,
                           act_bytes: float, d_model: int) -> float:
    """Bytes one layer keeps for one micro-batch of `tokens` (s·b) under a recompute policy."""
    if recompute == "full":  # only the layer input survives the forward
        return tokens * act_bytes * d_model / (tp if sp else 1)
    sharded = terms.sharded + (0.0 if recompute == "selective" else terms.core)
    replicated = terms.replicated / tp if sp else terms.replicated
    return tokens * (replicated + sharded / tp)


def in_flight_microbatches(layout: Layout, num_microbatches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b" and v > 1:
        return float(min(m, math.ceil(p * (1 + (p - 1) / (p * v)))))
    return float(min(p, m))


def _stage_params(shape: ModelShape, layout: Layout) -> tuple[float, float, float]:
    """(params sharded like dense weights, routed-expert params, largest FSDP unit) on the heaviest stage."""
    tp, layers = layout.tp, math.ceil(shape.n_layers / layout.pp)
    moe_layers = min(layers, shape.num_moe_layers)
    dense_layers = layers - moe_layers
    attn_and_norms = shape.attention_params() / tp + 2 * shape.d_model
    dense_layer = attn_and_norms + shape.dense_mlp_params() / tp
    dense = dense_layers * dense_layer
    experts = 0.0
    largest_unit = dense_layer if dense_layers else 0.0
    if moe_layers and shape.moe is not None:
        m = shape.moe
        per_expert = 3 * shape.d_model * m.expert_hidden
        non_routed = attn_and_norms + shape.d_model * m.num_experts + m.num_shared_experts * per_expert / tp
        routed = m.num_experts * per_expert / (layout.ep * tp)
        dense += moe_layers * non_routed
        experts = moe_layers * routed
        largest_unit = max(largest_unit, non_routed + routed)
    table = shape.vocab_size * shape.d_model / tp
    # One stage of a pipeline holds the input table or the output projection; without a pipeline both.
    embeddings = table * (1 if shape.tie_embeddings else 2) if layout.pp == 1 else table
    dense += embeddings + shape.d_model
    return dense, experts, max(largest_unit, table)


def memory_per_gpu(inputs: PlanInputs, layout: Layout, *, num_microbatches: int) -> MemoryBreakdown:
    """Memory on the heaviest GPU for a layout (see the module docstring for every convention)."""
    shape = inputs.shape
    dense, experts, largest_unit = _stage_params(shape, layout)
    shard = layout.dp_shard
    expert_shard = max(1, shard // layout.ep)
    z = layout.zero

    def sharded(count_dense: float, count_experts: float, applies: bool) -> float:
        return count_dense / shard + count_experts / expert_shard if applies else count_dense + count_experts

    # FSDP2 with a mixed-precision policy (parallel/fsdp.py) keeps only the sharded fp32 parameter, which is
    # the master copy the optimizer updates; the bf16 copy exists per unit while gathered (the buffers below).
    # Without full sharding the compute-dtype weights stay resident beside the fp32 master.
    fsdp_master_is_param = z >= 3 and inputs.master_bytes > 0
    params = sharded(dense, experts, z >= 3) * (inputs.master_bytes if fsdp_master_is_param else inputs.weight_bytes)
    grads = sharded(dense, experts, z >= 2) * inputs.grad_bytes
    opt_per_param = (0.0 if fsdp_master_is_param else inputs.master_bytes) + 2 * inputs.moment_bytes
    optimizer = 0.0 if inputs.cpu_offload else sharded(dense, experts, z >= 1) * opt_per_param
    if inputs.cpu_offload:
        params = 0.0
    activations, logits = _activations(inputs, layout, num_microbatches=num_microbatches)
    buffers = inputs.framework_reserve_bytes + logits
    if z >= 3 and shard > 1:
        buffers += largest_unit * (2 * inputs.weight_bytes + inputs.grad_bytes)
    elif layout.dp > 1:
        buffers += DDP_BUCKET_BYTES
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer, activations=activations,
                           buffers=buffers, capacity=inputs.memory_bytes)


def _activations(inputs: PlanInputs, layout: Layout, *, num_microbatches: int) -> tuple[float, float]:
    """(activations, logits buffer) of the heaviest stage: the first stage's in-flight micro-batches, or the
    last stage's one micro-batch plus the logits."""
    shape = inputs.shape
    tokens = layout.micro_batch * inputs.seq_len
    layers = math.ceil(shape.n_layers / layout.pp)
    moe_layers = min(layers, shape.num_moe_layers)
    per_microbatch = 0.0
    one_layer_full = 0.0
    for count, is_moe in ((layers - moe_layers, False), (moe_layers, True)):
        if not count:
            continue
        terms = activation_terms(shape, seq_len=inputs.seq_len, act_bytes=inputs.act_bytes,
                                 flash=inputs.flash_attention, moe_layer=is_moe)
        per_layer = layer_activation_bytes(terms, tokens=tokens, tp=layout.tp, sp=layout.sp,
                                           recompute=layout.recompute, act_bytes=inputs.act_bytes,
                                           d_model=shape.d_model)
        per_microbatch += count * per_layer
        if layout.recompute == "full":  # backward rebuilds one layer's full activations at a time
            one_layer_full = max(one_layer_full, layer_activation_bytes(
                terms, tokens=tokens, tp=layout.tp, sp=layout.sp, recompute="none",
                act_bytes=inputs.act_bytes, d_model=shape.d_model))
    head = head_activation_bytes(shape, tokens=tokens, act_bytes=inputs.act_bytes, tp=layout.tp)
    # Transient during the loss's backward: the logits in the compute dtype and their fp32 gradient.
    logits = tokens * shape.vocab_size / layout.tp * (inputs.act_bytes + LOGIT_TRANSIENT_BYTES)
    first = per_microbatch * in_flight_microbatches(layout, num_microbatches)
    if layout.pp == 1 or per_microbatch + head + logits > first:  # the GPU holding the loss is the heaviest
        return (first if layout.pp == 1 else per_microbatch) + head + one_layer_full, logits
    return first + one_layer_full, 0.0
