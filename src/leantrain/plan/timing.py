"""Step time, tokens/s and MFU for a layout: compute at an efficiency factor, ring communication per axis,
overlap, and the pipeline bubble.

Model (constants documented in docs/plan.md and plan/inputs.py):
- Compute per micro-batch on the heaviest stage = hardware FLOPs (recompute included) of its tokens,
  divided over tp × pp (× ceil(L/p)·p/L for uneven stages), at `compute_efficiency` × peak, plus the
  memory-bound ops: `elementwise_passes` passes over the activation bytes its layers produce, at HBM
  bandwidth (`elementwise_s`), and for MoE the routed experts' roofline: an expert GEMM with few tokens
  is bound by reading its weights (`expert_weight_s`).
- Ring collectives over n ranks moving a tensor of B bytes at link bandwidth W (per direction):
  all-reduce 2·(n−1)/n·B/W, reduce-scatter and all-gather (n−1)/n·B/W, all-to-all (n−1)/n·B/W, each
  plus a start-up latency per call that grows with the ring (NCCL's model: a latency per ring step, a tree
  for large all-reduces; `ring_latency_s`). Links: a group inside a node uses the intra-node link; a ring spanning
  nodes gets the per-GPU inter-node share times the group's members per node (one NCCL ring per NIC,
  `ring_bandwidth`); pipeline sends between nodes get one GPU's share.
- TP (Megatron): 2 all-reduces (or 2 all-gathers + 2 reduce-scatters with sequence parallelism, the
  same bytes) of s·b·h in the forward and 2 in the backward per layer; a recompute repeats those of the forward it
  redoes (`tp_recompute_calls`: torch's early stop ends it before the collective after the down projection).
- PP: one activation send forward and one gradient send backward of s·b·h (÷tp with sequence parallelism)
  per micro-batch and chunk, on the critical path.
- DP: ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them once and all-gathers the
  updated weights; ZeRO-2 the same, but reduce-scatters after every micro-batch (it holds only its gradient
  shard; once per step with `grad_sync: last_micro_batch`); ZeRO-3 (FSDP) all-gathers weights in the forward
  and the backward of every micro-batch and reduce-scatters like ZeRO-2; HSDP adds an all-reduce of the shard
  across replicas. A share `dp_overlap` of it hides under compute.
- EP: an all-to-all dispatch and combine of each token's routed copies per MoE layer, forward and backward,
  priced in plan/dispatch.py (plain or node-limited routing, inter-node vs NVLink copies, fp8 dispatch); a
  share `ep_overlap` (default 0.8: DeepSeek-V3 §3.2.1 hides nearly all of it with DualPipe's paired
  forward/backward chunks) hides under the micro-batch's compute, never more than that compute, and the
  hidden part costs the SMs the communication kernels take from compute.
- MoE layers: a fixed time per MoE layer and micro-batch (`moe_layer_overhead_s`, plan/inputs.py: the dispatcher's
  host synchronisation and launch-bound routing kernels, fitted on published MoE runs), on the critical path
  beside the micro-batch's compute (`moe_overhead_s`).
- Pipeline bubble: (p−1)/v micro-batch times, i.e. a fraction (p−1)/(v·m) of the compute; DualPipe's
  (p/2−1)·2/3 (`pipeline_bubble_fraction`).
- Optimizer: a memory-bound pass over the local shard (weights, gradients, master, moments; read + write).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from leantrain.plan.activations import ActivationTerms, activation_terms, layer_activation_bytes
from leantrain.plan.dispatch import all_to_all_s, exposed_all_to_all_s
from leantrain.plan.inputs import (
    COLLECTIVE_LATENCY_S,
    FLASH_WORK_PER_FLOP,
    GEMM_KAPPA,
    GEMM_RATE_SHARE,
    RING_BASE_LATENCY_S,
    RING_STEP_LATENCY_S,
    TREE_LEVEL_LATENCY_S,
    PlanInputs,
)
from leantrain.plan.layout import Layout
from leantrain.spec.shapes import ModelShape


@dataclass(frozen=True)
class StepTime:
    """One optimizer step, seconds, and what it implies."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float  # exposed
    pp_comm_s: float
    dp_comm_s: float  # exposed
    ep_comm_s: float  # exposed
    optimizer_s: float
    moe_overhead_s: float  # MoE layers' fixed per-micro-batch time (moe_overhead_s), outside the bubble
    step_s: float
    tokens_per_step: int
    tokens_per_s: float
    mfu: float
    hfu: float

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s

    @property
    def comm_fraction(self) -> float:
        return (self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.ep_comm_s) / self.step_s


def ring_latency_s(*, ranks: int, kind: str, across_nodes: bool) -> float:
    """Start-up time of one ring collective over `ranks` ranks (NCCL's model, plan/inputs.py)."""
    step = RING_STEP_LATENCY_S["inter" if across_nodes else "intra"]
    if kind == "all_reduce":
        ring = 2 * (ranks - 1) * step
        tree = 2 * math.ceil(math.log2(ranks)) * TREE_LEVEL_LATENCY_S if across_nodes else ring
        return RING_BASE_LATENCY_S + min(ring, tree)
    return RING_BASE_LATENCY_S + (ranks - 1) * step


def ring_time_s(*, num_bytes: float, ranks: int, bandwidth_bytes_s: float, kind: str, calls: int = 1,
                across_nodes: bool = False) -> float:
    """Time of `calls` ring collectives moving `num_bytes` in all (kind: all_reduce, all_gather,
    reduce_scatter): a start-up latency per call plus the bandwidth term of the bytes."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    latency = calls * ring_latency_s(ranks=ranks, kind=kind, across_nodes=across_nodes)
    return latency + factor * (ranks - 1) / ranks * num_bytes / bandwidth_bytes_s


def pipeline_bubble_fraction(*, pp: int, num_microbatches: int, virtual_stages: int = 1,
                             schedule: str = "1f1b") -> float:
    """Idle time over useful time. 1F1B (and GPipe): (p − 1) / (v · m) (Narayanan et al. 2021, v chunks).
    DualPipe (DeepSeek-V3 §3.2.1; deepseek-ai/DualPipe's table): (p/2 − 1)(F&B + B − 3W) against 1F1B's
    (p − 1)(F + B); with B = 2F, W = F and an overlapped F&B = F + B that is (p/2 − 1) · 2F, i.e.
    (p/2 − 1) · 2/3 of a micro-batch's forward and backward, over m."""
    if pp <= 1:
        return 0.0
    if schedule == "dualpipe":
        return max(0.0, pp / 2 - 1) * 2 / 3 / num_microbatches
    m, v = num_microbatches, virtual_stages
    if schedule == "interleaved_1f1b" and v > 1 and m < pp:
        # Fewer micro-batches than stages (torch's flex-pp interleaving allows it): a round's m micro-batches
        # cross all p·v chunk positions one after another, v·p + m − 1 chunk steps for v·m of work, so the idle
        # share is (v·(p − m) + m − 1) / (v·m), the formula below at m = p (m = 1 on 2 stages: half idle).
        return (v * (pp - m) + m - 1) / (v * m)
    return (pp - 1) / (v * m)


def _link(inputs: PlanInputs, group_span_gpus: int) -> float:
    """Bandwidth of a point-to-point path between ranks within `group_span_gpus` consecutive GPUs."""
    return inputs.intra_node_bytes_s if group_span_gpus <= inputs.gpus_per_node else inputs.inter_node_bytes_s


def ring_bandwidth(inputs: PlanInputs, *, ranks: int, stride: int) -> float:
    """Per-rank bandwidth of a ring collective over `ranks` ranks `stride` GPUs apart.

    Inside a node: the intra-node link. Across nodes, NCCL builds one ring per NIC, each entering and leaving
    every node once, so a group with c members in each node moves its bytes over c NICs at once: c × the
    per-GPU inter-node share (capped by the intra-node link). An FSDP group spanning whole nodes (c = 8) runs
    near the node's aggregate NIC bandwidth, as nccl-tests' multi-node bus bandwidth shows; a data-parallel
    group of TP8 replicas (c = 1) gets one NIC."""
    if ranks * stride <= inputs.gpus_per_node:
        return inputs.intra_node_bytes_s
    per_node = max(1, min(ranks, inputs.gpus_per_node // max(stride, 1)))
    return min(inputs.intra_node_bytes_s, per_node * inputs.inter_node_bytes_s)


def _local_params(inputs: PlanInputs, layout: Layout) -> float:
    """Parameters one GPU holds before ZeRO sharding (its tp/pp/ep slice), for DP and optimizer volumes."""
    shape = inputs.shape
    layers = math.ceil(shape.n_layers / layout.pp)
    per_layer = _non_embedding_params(shape) / shape.n_layers
    if shape.moe is not None:  # the routed experts are split over ep
        routed = shape.num_moe_layers * shape.moe.num_experts * 3 * shape.d_model * shape.moe.expert_hidden
        per_layer -= routed / shape.n_layers * (1 - 1 / layout.ep)
    table = shape.vocab_size * shape.d_model
    return (layers * per_layer + table * (1 if layout.pp > 1 or shape.tie_embeddings else 2)) / layout.tp


@lru_cache(maxsize=512)
def _non_embedding_params(shape: ModelShape) -> int:
    return shape.non_embedding_params()


@lru_cache(maxsize=512)
def _recompute_ratio(inputs: PlanInputs, recompute: str) -> float:
    """Hardware FLOPs under a recompute policy over those without: how often the forward's work repeats."""
    return inputs.hardware_flops_per_token(recompute) / inputs.hardware_flops_per_token("none")  # type: ignore[arg-type]


@lru_cache(maxsize=512)
def _saved_terms(inputs: PlanInputs) -> tuple[ActivationTerms, ActivationTerms | None]:
    """Per-token saved bytes of a dense layer and (MoE models) of an MoE layer."""
    kw = {"seq_len": inputs.seq_len, "act_bytes": inputs.act_bytes, "flash": inputs.flash_attention,
          "fused": inputs.fused_kernels, "linear_bytes": inputs.linear_input_bytes}
    moe = activation_terms(inputs.shape, moe_layer=True, **kw) if inputs.shape.moe is not None else None
    return activation_terms(inputs.shape, moe_layer=False, **kw), moe


def elementwise_s(inputs: PlanInputs, layout: Layout) -> float:
    """Memory-bound time of one micro-batch on the heaviest stage: `elementwise_passes` passes over the bytes
    its layers produce for backward (recompute none; sharded over tp, boundary tensors too with sequence
    parallelism, but the routed rows where the experts are split over tp: every TP rank routes all the tokens, as
    the memory plan counts them) at HBM bandwidth, scaled by hardware / model FLOPs for the forwards recompute
    repeats."""
    if inputs.elementwise_passes <= 0:
        return 0.0
    saved = _stage_saved_bytes(inputs, math.ceil(inputs.shape.n_layers / layout.pp), layout.micro_batch,
                               layout.tp, layout.sp, layout.experts_split_over_tp)
    repeat = _recompute_ratio(inputs, layout.recompute)
    return inputs.elementwise_passes * repeat * saved / inputs.memory_bandwidth_bytes_s


@lru_cache(maxsize=4096)
def _stage_saved_bytes(inputs: PlanInputs, layers: int, micro_batch: int, tp: int, sp: bool,
                       experts_whole_rows: bool = False) -> float:
    """Bytes `layers` layers produce for backward in one micro-batch (no recompute), tp-sharded
    (`experts_whole_rows`: activations.layer_activation_bytes)."""
    shape = inputs.shape
    dense, moe = _saved_terms(inputs)
    moe_layers = min(layers, shape.num_moe_layers) if moe is not None else 0
    kw = {"tokens": micro_batch * inputs.seq_len, "tp": tp, "sp": sp, "recompute": "none",
          "act_bytes": inputs.act_bytes, "d_model": shape.d_model}
    saved = (layers - moe_layers) * layer_activation_bytes(dense, **kw)  # type: ignore[arg-type]
    if moe_layers:
        saved += moe_layers * layer_activation_bytes(  # type: ignore[arg-type]
            moe, **kw, experts_whole_rows=experts_whole_rows)
    return saved


def expert_weight_s(inputs: PlanInputs, layout: Layout) -> float:
    """Extra time of one micro-batch when the routed experts' GEMMs are bound by reading their weights.

    Each GPU holds E/ep experts of every MoE layer on its stage; per micro-batch it reads each expert's weights
    in the forward and for the input gradient and updates its gradient accumulator (read + write). An expert
    GEMM takes the longer of that traffic and its FLOPs (the roofline): with few tokens per expert (small
    ep, small micro-batch) the weights, not the FLOPs, set the time, which is why expert parallelism pays.
    Under TP without EP each expert is split over TP; with EP each TP rank runs whole experts on its 1/tp of the
    tokens (parallel/expert.py): the same FLOPs, tp times the weights read (`Layout.experts_split_over_tp`)."""
    shape, moe = inputs.shape, inputs.shape.moe
    if moe is None:
        return 0.0
    layers = min(math.ceil(shape.n_layers / layout.pp), shape.num_moe_layers)
    per_expert = 3 * shape.d_model * moe.expert_hidden / layout.tp
    repeat = _recompute_ratio(inputs, layout.recompute)
    weight_reads = (2 + (repeat > 1)) * inputs.weight_bytes + 2 * inputs.grad_bytes
    held = per_expert * (1 if layout.experts_split_over_tp else layout.tp)
    traffic_s = layers * moe.num_experts / layout.ep * held * weight_reads / inputs.memory_bandwidth_bytes_s
    tokens = layout.micro_batch * inputs.seq_len
    flops_s = layers * tokens * moe.top_k * 6 * per_expert * repeat / inputs.compute_flops_s
    return max(0.0, traffic_s - flops_s)


def moe_overhead_s(inputs: PlanInputs, layout: Layout) -> float:
    """Fixed time of one micro-batch on the heaviest stage's MoE layers: `moe_layer_overhead_s` per layer for its
    forward and backward. Not charged again for the forward a full recompute repeats: the one full-recompute run it
    is fitted on (DGXC 25.08's DeepSeek-V3) shows the same gap per layer as the selective ones. It does not shrink
    with tokens, so larger micro-batches and fewer, wider layers pay less of it per token."""
    shape = inputs.shape
    if shape.moe is None or inputs.moe_layer_overhead_s <= 0:
        return 0.0
    layers = min(math.ceil(shape.n_layers / layout.pp), shape.num_moe_layers)
    return layers * inputs.moe_layer_overhead_s


def _layer_gemms(shape: ModelShape, tokens: int, tp: int) -> list[tuple[int, int, int, int]]:
    """(M, K, N, count) of the forward GEMMs one GPU runs per dense layer and for the output head, tp-split as
    Megatron splits them; the backward's two GEMMs per forward one move the same FLOPs and bytes."""
    d, q = shape.d_model, shape.attention_widths[0]
    gemms = [(tokens, d, max(1, (q + 2 * shape.kv_dim) // tp), shape.n_layers),
             (tokens, max(1, shape.attention_core_widths[1] // tp), d, shape.n_layers)]
    dense = shape.num_dense_layers
    if dense:
        ffn = max(1, shape.ffn_hidden // tp)
        gemms += [(tokens, d, ffn, dense * (shape.mlp_matrices - 1)), (tokens, ffn, d, dense)]
    return [*gemms, (tokens, d, max(1, shape.vocab_size // tp), 1)]


@lru_cache(maxsize=4096)
def gemm_time_factor(inputs: PlanInputs, tokens: int, tp: int) -> float:
    """Time of the model's matmul FLOPs for a micro-batch of `tokens` at tensor parallelism `tp`, over their time
    at the large-GEMM rate (plan/inputs.py GEMM_RATE_SHARE, GEMM_KAPPA): each GEMM takes F/R + κ·B/W, and under
    fp8 F/(R·S) + κ·B/W + the scaling casts' traffic, so narrow GEMMs are slower per FLOP and gain less from fp8.
    MoE routed experts are left to `expert_weight_s`."""
    ridge = GEMM_RATE_SHARE * inputs.peak_flops * inputs.power_factor / inputs.memory_bandwidth_bytes_s
    gemms = _layer_gemms(inputs.shape, tokens, tp)
    flops = cost = 0.0
    for index, (m, k, n, count) in enumerate(gemms):
        # under fp8 the output head (the last GEMM) stays bf16, as train/precision.py's filter (torchtitan's,
        # and Transformer Engine's, which converts the transformer layers only) leaves it
        fp8 = inputs.fp8_speedup != 1.0 and index < len(gemms) - 1
        f = 2.0 * m * k * n * count
        operands = (m * k + k * n + m * n) * count
        unhidden = GEMM_KAPPA * ridge * operands * inputs.act_bytes
        cost += unhidden + (f / inputs.fp8_speedup + ridge * inputs.fp8_cast_bytes * operands if fp8 else f)
        flops += f
    return cost / flops


def matmul_s(inputs: PlanInputs, layout: Layout, tokens: int) -> float:
    """Tensor-core time of one micro-batch of `tokens` on one GPU (recompute included, before stage imbalance):
    the GEMMs at their shape's rate (gemm_time_factor, fp8 included), the attention core at the FlashAttention
    kernel's measured rate (hardware catalog, scaled by the same in-step share of a microbenchmark as the GEMMs;
    the GEMM rate where the part has none or attention is unfused), both power-capped."""
    rate = inputs.compute_flops_s / inputs.fp8_speedup  # large bf16 GEMMs, in a step
    attention = inputs.flops.hardware_attention(layout.recompute) * tokens
    gemm = inputs.hardware_flops_per_token(layout.recompute) * tokens - attention
    attention_rate = rate
    if inputs.attention_flops_s and inputs.flash_attention:
        attention_rate = (inputs.attention_flops_s / FLASH_WORK_PER_FLOP * inputs.power_factor
                          * inputs.compute_efficiency / GEMM_RATE_SHARE)
    split = layout.tp * layout.pp
    return (gemm * gemm_time_factor(inputs, tokens, layout.tp) / rate + attention / attention_rate) / split


def tp_recompute_calls(layout: Layout, *, early_stop: bool = True) -> float:
    """All-reduce-sized TP collectives per layer and micro-batch that the recompute runs again. torch's early stop
    (`PlanInputs.recompute_early_stop`) ends the recompute before the collective that follows the down projection
    (it runs in w2's forward hook). Full recompute: with sequence parallelism the two all-gathers and the reduce-
    scatter after wo (1.5 all-reduces' bytes), without it the all-reduce after wo; a reentrant one redoes the
    forward's two. op (model/transformer.py `_op_policy_context`, which keeps the reduce-scatters' outputs): the two
    all-gathers with sequence parallelism (one all-reduce's bytes), the all-reduce after wo without it. Counted by
    `leantrain rehearse --depth full` at TP 2 (tests/test_plan_formulas.py)."""
    if layout.recompute == "full":
        return (1.5 if layout.sp else 1.0) if early_stop else 2.0
    return 1.0 if layout.recompute == "op" else 0.0


def step_time(inputs: PlanInputs, layout: Layout, *, sequences_per_step: int) -> StepTime:
    """Predicted step time for a layout (see the module docstring)."""
    shape = inputs.shape
    m = layout.num_microbatches(sequences_per_step)
    tokens_mb = layout.micro_batch * inputs.seq_len
    stage_imbalance = math.ceil(shape.n_layers / layout.pp) * layout.pp / shape.n_layers
    compute_mb = (matmul_s(inputs, layout, tokens_mb) * stage_imbalance + elementwise_s(inputs, layout)
                  + expert_weight_s(inputs, layout))

    layers = math.ceil(shape.n_layers / layout.pp)
    activation_bytes = tokens_mb * shape.d_model * inputs.act_bytes
    tp_calls = 4 + tp_recompute_calls(layout, early_stop=inputs.recompute_early_stop)
    tp_mb = layers * tp_calls * ring_time_s(num_bytes=activation_bytes, ranks=layout.tp,
                                            bandwidth_bytes_s=ring_bandwidth(inputs, ranks=layout.tp, stride=1),
                                            kind="all_reduce", across_nodes=layout.tp > inputs.gpus_per_node)
    tp_mb *= 1 - inputs.tp_overlap

    ep_mb = 0.0
    if shape.moe is not None and layout.ep > 1:
        raw = all_to_all_s(inputs, layout, tokens=tokens_mb, moe_layers=min(layers, shape.num_moe_layers))
        ep_mb = exposed_all_to_all_s(raw, compute_s=compute_mb, overlap=inputs.ep_overlap)
    moe_mb = moe_overhead_s(inputs, layout)

    per_mb = compute_mb + tp_mb + ep_mb + moe_mb
    compute_s = m * compute_mb
    bubble_s = pipeline_bubble_fraction(pp=layout.pp, num_microbatches=m, virtual_stages=layout.virtual_stages,
                                        schedule=layout.schedule) * m * per_mb

    pp_s = 0.0
    if layout.pp > 1:
        send = activation_bytes / (layout.tp if layout.sp else 1)
        # The mesh puts pp outermost (parallel/dims.py): neighbouring stages sit dp × tp ranks apart.
        link = _link(inputs, layout.num_gpus)
        pp_s = (m * layout.virtual_stages + layout.pp - 1) * 2 * (COLLECTIVE_LATENCY_S + send / link)

    local = _local_params(inputs, layout)
    dp_raw = _dp_comm_s(inputs, layout, local_params=local, num_microbatches=m)
    hidden = min(dp_raw * inputs.dp_overlap, compute_s)
    dp_s = dp_raw - hidden

    touched = inputs.weight_bytes + inputs.grad_bytes + inputs.master_bytes + 2 * inputs.moment_bytes
    shard = layout.state_shard
    optimizer_s = 2 * touched * local / shard / inputs.memory_bandwidth_bytes_s

    step_s = compute_s + m * (tp_mb + ep_mb + moe_mb) + bubble_s + pp_s + dp_s + optimizer_s
    tokens_per_step = layout.dp * m * tokens_mb
    tokens_per_s = tokens_per_step / step_s
    peak_all = layout.num_gpus * inputs.peak_flops
    return StepTime(
        compute_s=compute_s, bubble_s=bubble_s, tp_comm_s=m * tp_mb, pp_comm_s=pp_s, dp_comm_s=dp_s,
        ep_comm_s=m * ep_mb, moe_overhead_s=m * moe_mb, optimizer_s=optimizer_s, step_s=step_s,
        tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_s, mfu=inputs.flops.model * tokens_per_s / peak_all,
        hfu=inputs.hardware_flops_per_token(layout.recompute) * tokens_per_s / peak_all,
    )


def _dp_comm_s(inputs: PlanInputs, layout: Layout, *, local_params: float, num_microbatches: int) -> float:
    """Data-parallel communication per step before overlap.

    Gradients are reduced once per step where every parameter's gradient is held between micro-batches
    (ZeRO-0/1, or `grad_sync: last_micro_batch`), else after every micro-batch: a ZeRO-2 or -3 rank holds only
    its shard (memory.py), so with accumulation it must reduce-scatter each micro-batch's gradients."""
    if layout.dp <= 1:
        return 0.0
    grad_bytes = local_params * inputs.grad_bytes
    weight_bytes = local_params * inputs.weight_bytes
    shard = layout.dp_shard
    layers = math.ceil(inputs.shape.n_layers / layout.pp)
    if layout.zero == 0 or shard == 1:  # DDP: one gradient all-reduce
        return ring_time_s(num_bytes=grad_bytes, ranks=layout.dp,
                           bandwidth_bytes_s=ring_bandwidth(inputs, ranks=layout.dp, stride=layout.tp),
                           kind="all_reduce", across_nodes=layout.dp * layout.tp > inputs.gpus_per_node)
    reductions = num_microbatches if layout.zero >= 2 and inputs.grad_sync == "every_micro_batch" else 1
    shard_link = ring_bandwidth(inputs, ranks=shard, stride=layout.tp)
    across = shard * layout.tp > inputs.gpus_per_node
    # ZeRO-3 (FSDP) gathers and reduces each block apart (one unit per layer); ZeRO-1/2 in large buckets.
    calls = layers if layout.zero >= 3 else 1
    scatter = reductions * ring_time_s(num_bytes=grad_bytes, ranks=shard, bandwidth_bytes_s=shard_link,
                                       kind="reduce_scatter", calls=calls, across_nodes=across)
    if layout.zero <= 2:  # ZeRO-1/2: then the updated weight shards are all-gathered once
        return scatter + ring_time_s(num_bytes=weight_bytes, ranks=shard, bandwidth_bytes_s=shard_link,
                                     kind="all_gather", across_nodes=across)
    gathers = 2 * num_microbatches * ring_time_s(num_bytes=weight_bytes, ranks=shard, bandwidth_bytes_s=shard_link,
                                                 kind="all_gather", calls=calls, across_nodes=across)
    total = scatter + gathers
    if layout.dp_replicate > 1:  # HSDP: the reduced shard is all-reduced across replicas once per step
        total += ring_time_s(num_bytes=grad_bytes / shard, ranks=layout.dp_replicate,
                             bandwidth_bytes_s=ring_bandwidth(inputs, ranks=layout.dp_replicate,
                                                              stride=shard * layout.tp), kind="all_reduce",
                             across_nodes=True)
    return total
