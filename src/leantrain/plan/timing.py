"""Step time, tokens/s and MFU for a layout: compute at an efficiency factor, ring communication per axis,
overlap, and the pipeline bubble.

Model (constants documented in docs/plan.md and plan/inputs.py):
- Compute per micro-batch on the heaviest stage = hardware FLOPs (recompute included) of its tokens,
  divided over tp × pp (× ceil(L/p)·p/L for uneven stages), at `compute_efficiency` × peak.
- Ring collectives over n ranks moving a tensor of B bytes at link bandwidth W (per direction):
  all-reduce 2·(n−1)/n·B/W, reduce-scatter and all-gather (n−1)/n·B/W, all-to-all (n−1)/n·B/W, each
  plus a fixed latency per call. Links: tp and an ep/dp group inside a node use the intra-node link,
  anything spanning nodes the per-GPU inter-node share.
- TP (Megatron): 2 all-reduces (or 2 all-gathers + 2 reduce-scatters with sequence parallelism, the
  same bytes) of s·b·h in the forward and 2 in the backward per layer; full recompute repeats the forward's.
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
- Pipeline bubble: (p−1)/v micro-batch times, i.e. a fraction (p−1)/(v·m) of the compute.
- Optimizer: a memory-bound pass over the local shard (weights, gradients, master, moments; read + write).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leantrain.plan.dispatch import all_to_all_s, exposed_all_to_all_s
from leantrain.plan.inputs import COLLECTIVE_LATENCY_S, PlanInputs
from leantrain.plan.layout import Layout


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


def ring_time_s(*, num_bytes: float, ranks: int, bandwidth_bytes_s: float, kind: str) -> float:
    """Time of one ring collective (kind: all_reduce, all_gather, reduce_scatter, all_to_all)."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return COLLECTIVE_LATENCY_S + factor * (ranks - 1) / ranks * num_bytes / bandwidth_bytes_s


def pipeline_bubble_fraction(*, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over useful time for 1F1B: (p − 1) / (v · m) (Narayanan et al. 2021)."""
    return (pp - 1) / (virtual_stages * num_microbatches)


def _link(inputs: PlanInputs, group_span_gpus: int) -> float:
    """Bandwidth of a group whose ranks lie within `group_span_gpus` consecutive GPUs."""
    return inputs.intra_node_bytes_s if group_span_gpus <= inputs.gpus_per_node else inputs.inter_node_bytes_s


def _local_params(inputs: PlanInputs, layout: Layout) -> float:
    """Parameters one GPU holds before ZeRO sharding (its tp/pp/ep slice), for DP and optimizer volumes."""
    shape = inputs.shape
    layers = math.ceil(shape.n_layers / layout.pp)
    per_layer = shape.non_embedding_params() / shape.n_layers
    if shape.moe is not None:  # the routed experts are split over ep
        routed = shape.num_moe_layers * shape.moe.num_experts * 3 * shape.d_model * shape.moe.expert_hidden
        per_layer -= routed / shape.n_layers * (1 - 1 / layout.ep)
    table = shape.vocab_size * shape.d_model
    return (layers * per_layer + table * (1 if layout.pp > 1 or shape.tie_embeddings else 2)) / layout.tp


def step_time(inputs: PlanInputs, layout: Layout, *, sequences_per_step: int) -> StepTime:
    """Predicted step time for a layout (see the module docstring)."""
    shape = inputs.shape
    m = layout.num_microbatches(sequences_per_step)
    tokens_mb = layout.micro_batch * inputs.seq_len
    stage_imbalance = math.ceil(shape.n_layers / layout.pp) * layout.pp / shape.n_layers
    hw_flops_mb = inputs.hardware_flops_per_token(layout.recompute) * tokens_mb * stage_imbalance
    compute_mb = hw_flops_mb / (layout.tp * layout.pp) / inputs.compute_flops_s

    layers = math.ceil(shape.n_layers / layout.pp)
    activation_bytes = tokens_mb * shape.d_model * inputs.act_bytes
    tp_calls = 4 + (2 if layout.recompute == "full" else 0)
    tp_mb = layers * tp_calls * ring_time_s(num_bytes=activation_bytes, ranks=layout.tp,
                                            bandwidth_bytes_s=_link(inputs, layout.tp), kind="all_reduce")
    tp_mb *= 1 - inputs.tp_overlap

    ep_mb = 0.0
    if shape.moe is not None and layout.ep > 1:
        raw = all_to_all_s(inputs, layout, tokens=tokens_mb, moe_layers=min(layers, shape.num_moe_layers))
        ep_mb = exposed_all_to_all_s(raw, compute_s=compute_mb, overlap=inputs.ep_overlap)

    per_mb = compute_mb + tp_mb + ep_mb
    compute_s = m * compute_mb
    bubble_s = (layout.pp - 1) / layout.virtual_stages * per_mb if layout.pp > 1 else 0.0

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
    shard = layout.dp_shard if layout.zero >= 1 else 1
    optimizer_s = 2 * touched * local / shard / inputs.memory_bandwidth_bytes_s

    step_s = compute_s + m * (tp_mb + ep_mb) + bubble_s + pp_s + dp_s + optimizer_s
    tokens_per_step = layout.dp * m * tokens_mb
    tokens_per_s = tokens_per_step / step_s
    peak_all = layout.num_gpus * inputs.peak_flops
    return StepTime(
        compute_s=compute_s, bubble_s=bubble_s, tp_comm_s=m * tp_mb, pp_comm_s=pp_s, dp_comm_s=dp_s,
        ep_comm_s=m * ep_mb, optimizer_s=optimizer_s, step_s=step_s, tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_s, mfu=inputs.flops.model * tokens_per_s / peak_all,
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
    if layout.zero == 0 or shard == 1:  # DDP: one gradient all-reduce
        return ring_time_s(num_bytes=grad_bytes, ranks=layout.dp,
                           bandwidth_bytes_s=_link(inputs, layout.dp * layout.tp), kind="all_reduce")
    reductions = num_microbatches if layout.zero >= 2 and inputs.grad_sync == "every_micro_batch" else 1
    shard_link = _link(inputs, shard * layout.tp)
    scatter = reductions * ring_time_s(num_bytes=grad_bytes, ranks=shard, bandwidth_bytes_s=shard_link,
                                       kind="reduce_scatter")
    if layout.zero <= 2:  # ZeRO-1/2: then the updated weight shards are all-gathered once
        return scatter + ring_time_s(num_bytes=weight_bytes, ranks=shard, bandwidth_bytes_s=shard_link,
                                     kind="all_gather")
    gathers = 2 * num_microbatches * ring_time_s(num_bytes=weight_bytes, ranks=shard, bandwidth_bytes_s=shard_link,
                                                 kind="all_gather")
    total = scatter + gathers
    if layout.dp_replicate > 1:  # HSDP: the reduced shard is all-reduced across replicas once per step
        total += ring_time_s(num_bytes=grad_bytes / shard, ranks=layout.dp_replicate,
                             bandwidth_bytes_s=inputs.inter_node_bytes_s, kind="all_reduce")
    return total
