"""Memory per GPU: parameters, gradients, optimizer states, activations and buffers for one layout.

Conventions (docs/plan.md has the derivations; activation terms in plan/activations.py):
- Every pipeline stage that can be the heaviest is evaluated (the first, the first full-size one and the
  last: stages differ in layers, embedding/loss and in-flight micro-batches) and the largest total reported.
- Weights, gradients and optimizer states of the stage are divided by the ZeRO/FSDP shard degree
  (dp / dp_replicate): ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also weights
  (Rajbhandari et al. 2020). Routed experts are split over ep and then sharded over shard / ep.
  "Optimizer" holds the fp32 master copy (when weights train in 16-bit) and the two Adam moments.
- At ZeRO-3 without a pipeline (FSDP2, parallel/fsdp.py) the sharded fp32 parameter is the master copy and
  the compute-dtype copy exists per unit while gathered (buffers: two units prefetched + one unit's
  unsharded gradient). Under a pipeline, FSDP does not reshard after the forward (each micro-batch would
  gather again; torchtitan and Llama 3 §3.3.2 keep the stage's weights gathered): the stage's unsharded
  compute-dtype weights stay resident.
- DualPipe (planning only) holds a stage of each direction: two copies of the stage's weights and gradients
  (deepseek-ai/DualPipe: "Parameter 2×"; one optimizer state serves both copies) and p + 1 micro-batches.
- `parallelism.grad_sync: last_micro_batch` with accumulation keeps every parameter's unsharded gradient
  between micro-batches; `every_micro_batch` holds only the shard.
- Fine-tuning (plan/finetune.py): LoRA/QLoRA freeze the base (no gradients or optimizer states for it; QLoRA
  holds its Linear weights in NF4) and train adapters with their own states.
- Buffers: the logits in the compute dtype and their fp32 gradient during the loss backward (last stage),
  DDP gradient buckets, FSDP gathers, and a framework reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from leantrain.plan.activations import (
    activation_terms,
    head_activation_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
    stage_layers,
)
from leantrain.plan.finetune import adapter_activation_bytes, adapter_params, frozen_weight_bytes, reference_copies
from leantrain.plan.inputs import PlanInputs
from leantrain.plan.layout import Layout
from leantrain.spec.shapes import ModelShape

DDP_BUCKET_BYTES = 2 * 25 * 2**20  # two 25 MiB gradient buckets in flight (DDP's default bucket_cap_mb)
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
    stage: int = 0  # which pipeline stage is the heaviest

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
class StageParams:
    dense: float  # parameters sharded like dense weights (per tp rank)
    experts: float  # routed-expert parameters (per tp and ep rank)
    largest_unit: float  # the largest FSDP unit (a block or an embedding table)


def stage_params(shape: ModelShape, layout: Layout, *, layers: int, first: bool, last: bool,
                 first_layer: int = 0) -> StageParams:
    """Parameters on one pipeline stage of `layers` blocks starting at block `first_layer`."""
    return _stage_params(shape, layout.tp, layout.ep, layout.pp > 1, layers, first, last, first_layer)


@lru_cache(maxsize=8192)
def _stage_params(shape: ModelShape, tp: int, ep: int, pipelined: bool, layers: int, first: bool, last: bool,
                  first_layer: int) -> StageParams:
    dense_in_stage = max(0, min(layers, shape.num_dense_layers - first_layer))
    moe_layers = layers - dense_in_stage if shape.moe is not None else 0
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
        routed = m.num_experts * per_expert / (ep * tp)
        dense += moe_layers * non_routed
        experts = moe_layers * routed
        largest_unit = max(largest_unit, non_routed + routed)
    table = shape.vocab_size * shape.d_model / tp
    tables = (first + (last and not shape.tie_embeddings)) if pipelined else (2 - shape.tie_embeddings)
    dense += tables * table + (shape.d_model if last else 0)
    return StageParams(dense=dense, experts=experts, largest_unit=max(largest_unit, table if tables else 0.0))


def _states(inputs: PlanInputs, layout: Layout, sp: StageParams, *, num_microbatches: int
            ) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, gather buffers) bytes of a stage's parameters."""
    shard = layout.dp_shard
    expert_shard = max(1, shard // layout.ep)
    z = layout.zero

    def sharded(applies: bool) -> float:
        return sp.dense / shard + sp.experts / expert_shard if applies else sp.dense + sp.experts

    unsharded = sp.dense + sp.experts
    if not inputs.trains_base:  # LoRA/QLoRA: frozen base + trained adapters, sharded like the base
        shares = tuple(sharded(z >= level) / max(unsharded, 1.0) for level in (1, 2, 3))
        return _adapter_states(inputs, layout, sp, shares=shares)  # type: ignore[arg-type]
    # FSDP2 keeps only the sharded fp32 parameter (the master copy); its compute-dtype copy exists while
    # gathered. Without full sharding the compute-dtype weights stay resident beside the fp32 master.
    fsdp_master_is_param = z >= 3 and inputs.master_bytes > 0
    params = sharded(z >= 3) * (inputs.master_bytes if fsdp_master_is_param else inputs.weight_bytes)
    gather = 0.0
    if z >= 3 and shard > 1:
        if layout.pp > 1:  # not resharded after forward: the stage's compute copy stays gathered
            params += unsharded * inputs.weight_bytes
            gather = sp.largest_unit * inputs.grad_bytes
        else:
            gather = sp.largest_unit * (2 * inputs.weight_bytes + inputs.grad_bytes)
    keeps_full_grads = inputs.grad_sync == "last_micro_batch" and num_microbatches > 1
    grads = (unsharded if keeps_full_grads else sharded(z >= 2)) * inputs.grad_bytes
    opt_per_param = (0.0 if fsdp_master_is_param else inputs.master_bytes) + 2 * inputs.moment_bytes
    optimizer = sharded(z >= 1) * opt_per_param
    params *= reference_copies(inputs)  # full DPO: a frozen reference copy of the weights (plan/finetune.py)
    if layout.schedule == "dualpipe" and layout.pp > 1:  # a stage of each direction: two copies of the weights
        params, grads = 2 * params, 2 * grads
    if inputs.cpu_offload:
        params, optimizer = 0.0, 0.0
    return params, grads, optimizer, gather


def _adapter_states(inputs: PlanInputs, layout: Layout, sp: StageParams, *, shares: tuple[float, float, float]
                    ) -> tuple[float, float, float, float]:
    """Frozen base (compute dtype, or NF4 for QLoRA) + adapters trained with Adam. `shares` is the share of
    the stage a GPU keeps under ZeRO-1, -2 and -3 (optimizer, gradients, weights)."""
    optimizer_share, grad_share, weight_share = shares
    share_of_model = (sp.dense + sp.experts) * layout.tp / max(inputs.shape.total_params(), 1)
    base = frozen_weight_bytes(inputs) * share_of_model / layout.tp * weight_share
    adapters = adapter_params(inputs) * share_of_model / layout.tp
    params = base + adapters * inputs.weight_bytes * weight_share
    grads = adapters * inputs.grad_bytes * grad_share
    optimizer = adapters * (inputs.master_bytes + 2 * inputs.moment_bytes) * optimizer_share
    gather = 0.0
    if layout.zero >= 3 and layout.dp_shard > 1:
        gather = 2 * sp.largest_unit * inputs.weight_bytes
    return params, grads, optimizer, gather


@lru_cache(maxsize=8192)
def _per_microbatch(inputs: PlanInputs, *, layers: int, first_layer: int, tp: int, sp: bool, recompute: str,
                    micro_batch: int) -> tuple[float, float]:
    """(bytes the stage's layers keep per micro-batch, one layer rebuilt under full recompute); cached, as
    the search asks for the same stage shape many times."""
    shape = inputs.shape
    tokens = micro_batch * inputs.seq_len
    dense_in_stage = max(0, min(layers, shape.num_dense_layers - first_layer))
    moe_layers = layers - dense_in_stage if shape.moe is not None else 0
    per_microbatch = 0.0
    one_layer_full = 0.0
    for count, is_moe in ((layers - moe_layers, False), (moe_layers, True)):
        if not count:
            continue
        terms = activation_terms(shape, seq_len=inputs.seq_len, act_bytes=inputs.act_bytes,
                                 flash=inputs.flash_attention, moe_layer=is_moe, fused=inputs.fused_kernels,
                                 linear_bytes=inputs.linear_input_bytes)
        kw = {"tokens": tokens, "tp": tp, "sp": sp, "act_bytes": inputs.act_bytes, "d_model": shape.d_model}
        per_microbatch += count * layer_activation_bytes(terms, recompute=recompute, **kw)  # type: ignore[arg-type]
        if recompute == "full":  # backward rebuilds one layer's full activations at a time
            one_layer_full = max(one_layer_full, layer_activation_bytes(terms, recompute="none", **kw))
    if inputs.lora_rank:  # adapters inside a fully recomputed block are rebuilt with it, one layer at a time
        adapters = adapter_activation_bytes(inputs, tokens=tokens, tp=tp)
        if recompute == "full":
            one_layer_full += adapters
        else:
            per_microbatch += layers * adapters
    return per_microbatch, one_layer_full


def _stage_activations(inputs: PlanInputs, layout: Layout, *, layers: int, first_layer: int, stage: int,
                       last: bool, num_microbatches: int) -> tuple[float, float]:
    """(activations, logits buffer) of one stage at its peak."""
    shape = inputs.shape
    tokens = layout.micro_batch * inputs.seq_len
    per_microbatch, one_layer_full = _per_microbatch(
        inputs, layers=layers, first_layer=first_layer, tp=layout.tp, sp=layout.sp, recompute=layout.recompute,
        micro_batch=layout.micro_batch)
    held = per_microbatch * in_flight_microbatches(layout, num_microbatches, stage=stage)
    if not last:
        return held + one_layer_full, 0.0
    head = head_activation_bytes(shape, tokens=tokens, act_bytes=inputs.act_bytes, tp=layout.tp,
                                 fused=inputs.fused_kernels)
    # Transient during the loss's backward: the logits in the compute dtype and their fp32 gradient.
    logits = tokens * shape.vocab_size / layout.tp * (inputs.act_bytes + LOGIT_TRANSIENT_BYTES)
    return held + head + one_layer_full, logits


def _candidate_stages(layers: list[int]) -> list[int]:
    """Stages that can be the heaviest: the first, the first full-size one, the last."""
    full = layers.index(max(layers))
    return sorted({0, full, len(layers) - 1})


def memory_per_gpu(inputs: PlanInputs, layout: Layout, *, num_microbatches: int) -> MemoryBreakdown:
    """Memory on the heaviest GPU for a layout (see the module docstring for every convention)."""
    layers = stage_layers(inputs.shape.n_layers, layout.pp)
    best: MemoryBreakdown | None = None
    for stage in _candidate_stages(layers):
        mem = stage_memory(inputs, layout, stage=stage, num_microbatches=num_microbatches)
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best


def stage_memory(inputs: PlanInputs, layout: Layout, *, stage: int, num_microbatches: int) -> MemoryBreakdown:
    """Memory on a GPU of pipeline stage `stage` (its first chunk under interleaving)."""
    shape = inputs.shape
    layers = stage_layers(shape.n_layers, layout.pp)
    first_layer = sum(layers[:stage])
    last = stage == layout.pp - 1
    sp = stage_params(shape, layout, layers=layers[stage], first=stage == 0, last=last, first_layer=first_layer)
    params, grads, optimizer, gather = _states(inputs, layout, sp, num_microbatches=num_microbatches)
    activations, logits = _stage_activations(inputs, layout, layers=layers[stage], first_layer=first_layer,
                                             stage=stage, last=last, num_microbatches=num_microbatches)
    buffers = inputs.framework_reserve_bytes + logits + gather
    if not gather and layout.dp > 1:
        buffers += DDP_BUCKET_BYTES
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer, activations=activations,
                           buffers=buffers, capacity=inputs.memory_bytes, stage=stage)
