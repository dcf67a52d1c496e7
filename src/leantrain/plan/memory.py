"""Memory per GPU: parameters, gradients, optimizer states, activations and buffers for one layout.

Conventions (docs/plan.md has the derivations; activation terms in plan/activations.py):
- Every pipeline stage that can be the heaviest is evaluated (the first, the first full-size one and the
  last: stages differ in layers, embedding/loss and in-flight micro-batches) and the largest total reported.
- As the trainer's FSDP2 holds them (parallel/fsdp.py): at every ZeRO level ≥ 1 the stage's parameters (in
  the master dtype: the sharded fp32 parameter is the master copy), their gradients and both Adam moments are
  divided by the shard degree (dp / dp_replicate); FSDP2 always shards gradients and optimizer states, so
  ZeRO-1 and -2 are the same layout. ZeRO-0 replicates all three. Routed experts are split over ep and
  sharded over shard / ep (their own FSDP mesh, as torchtitan). "Optimizer" is the two Adam moments (plus a
  master copy only where the parameters themselves are 16-bit).
- The compute-dtype copy exists only while gathered, a buffer: at ZeRO-3 per unit (resharded after forward:
  two units in flight + one unit's unsharded gradient), at ZeRO-1/2 the whole stage (kept gathered from the
  forward to the backward), with or without a pipeline (the trainer reshards at ZeRO-3 under a pipeline too).
- DualPipe (planning only) holds a stage of each direction: two copies of the stage's weights and gradients
  (deepseek-ai/DualPipe: "Parameter 2×"; one optimizer state serves both copies) and p + 1 micro-batches.
- `parallelism.grad_sync: last_micro_batch` with accumulation keeps every parameter's unsharded gradient
  between micro-batches; `every_micro_batch` holds only the shard.
- Fine-tuning (plan/finetune.py): LoRA/QLoRA freeze the base (no gradients or optimizer states for it; QLoRA
  holds its Linear weights in NF4) and train adapters with their own states.
- Buffers: the loss backward's fp32 gradients of the logits (last stage; the larger of them and full
  recompute's rebuilt block), DDP gradient buckets, FSDP gathers (at ZeRO-3 on the last stage the last block,
  kept gathered for the backward), torch's pipeline receive buffers (one per micro-batch, chunk and direction),
  and a framework reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from leantrain.plan.activations import (
    LOGIT_SAVED_BYTES,
    SP_GATHERED_PLANNED,
    activation_terms,
    backward_chunks_at_peak,
    float8_tp_saved_bytes,
    head_activation_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
    stage_layers,
)
from leantrain.plan.finetune import (
    adapter_activation_bytes,
    adapter_params,
    frozen_base_bytes,
    frozen_base_counted,
    frozen_head_bytes,
    frozen_weight_bytes,
    reference_copies,
)
from leantrain.plan.inputs import PlanInputs
from leantrain.plan.layout import Layout
from leantrain.spec.rules import float8_gathered_params
from leantrain.spec.shapes import ModelShape, chunk_layers

DDP_BUCKET_BYTES = 2 * 25 * 2**20  # two 25 MiB gradient buckets in flight (DDP's default bucket_cap_mb)
# The loss's backward, per logit (a buffer; measured by `leantrain rehearse` and, for the vocabulary-parallel
# loss, by a 2-rank gloo run with real tensors: docs/plan.md). Whole vocabulary on the rank (no loss
# parallelism): aten's fp32 NLL gradient is the input of the fp32 log-softmax gradient, both live at once (then
# the compute-dtype cast, 2-4 B, after the first is freed). Vocabulary-parallel (torch's loss_parallel,
# torch/distributed/tensor/parallel/loss.py `_nll_loss_and_log_softmax_backward`): one fused backward computes
# `(zeros_like(x) + exp(x)) * grad` on the rank's vocabulary slice, three fp32 tensors of it live at once.
LOGIT_TRANSIENT_BYTES = 8.0
LOSS_PARALLEL_TRANSIENT_BYTES = 12.0  # per logit of the rank's vocabulary slice
# The trainer's step keeps the compute-dtype logits referenced until the backward has run (the loss upcasts a
# copy: train/step_metrics.py), so they are live at the peak beside the fp32 log-probabilities: measured by
# `leantrain rehearse` (bench/plan_vs_rehearsal.py: exactly 2 bytes per logit in bf16). torchtitan frees them
# before the backward (`del pred`); the plan counts what this trainer holds.
KEEPS_COMPUTE_LOGITS = True
# A pipeline stage under FSDP keeps its stage gathered and its unsharded gradients through the step (torch's
# pipelining turns resharding after backward and gradient sync off for every micro-batch: `_states`), as the
# trainer does (rehearsed: bench/plan_vs_rehearsal.py). A switch so that the calibration can be compared
# without it (tests/test_plan_calibration.py, docs/plan.md).
PIPELINE_HOLDS_UNSHARDED = True
# torch's PipelineStage allocates, once and for the whole run, a receive buffer per micro-batch for each
# non-first chunk's input and for each non-last chunk's output gradient (pipelining/stage.py
# `_setup_forward_recv_info`, `_setup_backward_recv_info`): m hidden-sized tensors per chunk and direction.
# Measured with real tensors on 2 gloo ranks (Schedule1F1B: after a step exactly m output-sized tensors live on
# the first stage, held by its gradient receive buffers) and by `leantrain rehearse` (the pipelines' peaks).
PIPELINE_RECV_BUFFERS = True


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
    reserve: float = 0.0  # the framework reserve inside `buffers` (CUDA context, NCCL, allocator slack)

    @property
    def temp(self) -> float:
        """Buffers the step allocates (gathered weights, logits' gradient, buckets): `buffers` less the reserve,
        what `leantrain rehearse` reports as temp."""
        return self.buffers - self.reserve

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
                "activations": self.activations, "buffers": self.buffers, "temp": self.temp,
                "reserve": self.reserve, "total": self.total}


@dataclass(frozen=True)
class StageParams:
    dense: float  # parameters sharded like dense weights (per tp rank)
    experts: float  # routed-expert parameters per tp and ep rank (the share their FSDP shards)
    largest_unit: float  # the largest FSDP unit (a block or an embedding table)
    last_block: float = 0.0  # the stage's last block (FSDP keeps it gathered from its forward to its backward)
    root_unit: float = 0.0  # the root unit: the stage's embedding/output tables and final norm (parallel/fsdp.py)
    # a rank's gathered experts ÷ `experts`: tp where the TP peers each hold the ep rank's experts whole (under EP:
    # each sends them its share of the tokens, parallel/expert.py) and FSDP shards them over the peers too
    expert_gather: int = 1
    # the stage's Linear weights (attention, dense MLP, shared experts: not the tables, norms, router or routed
    # experts) and their share of its largest unit and of its last block: FSDP2 gathers them in float8 under fp8
    linear: float = 0.0
    unit_linear_share: float = 0.0
    block_linear_share: float = 0.0

    @property
    def gathered(self) -> float:
        """The stage's parameters as a rank holds them gathered."""
        return self.dense + self.experts * self.expert_gather

    def sharded(self, layout: Layout) -> float:
        """The stage's parameters a rank keeps as its shard: dense ones over the shard group (`state_shard`: 1 at
        ZeRO-0), experts over theirs (÷ ep)."""
        shard = layout.state_shard
        return self.dense / shard + self.experts / max(1, shard // layout.ep)


def gather_bytes(inputs: PlanInputs, layout: Layout, count: float, linear: float) -> float:
    """Bytes of `count` gathered parameters of which `linear` are Linear weights: those are 1 byte under fp8 with
    FSDP2 (torchao's float8 all-gather, train/precision.py; `leantrain rehearse` of an 8B-wide stage at FSDP 8,
    ZeRO-2: fp8 temp 0.81 GiB under bf16's, the stage's Linear weights at 1 byte), the rest the compute dtype."""
    fp8 = inputs.compute_dtype == "fp8" and inputs.trains_base and (layout.dp > 1 or layout.tp > 1)
    return count * inputs.weight_bytes - (linear * (inputs.weight_bytes - 1.0) if fp8 else 0.0)


def stage_params(shape: ModelShape, layout: Layout, *, layers: int, first: bool, last: bool,
                 first_layer: int = 0) -> StageParams:
    """Parameters on one pipeline stage of `layers` blocks starting at block `first_layer`."""
    return _stage_params(shape, layout.tp, layout.ep, layout.pp > 1, layers, first, last, first_layer,
                         layout.experts_split_over_tp, layout.dp_shard)


@lru_cache(maxsize=8192)
def _stage_params(shape: ModelShape, tp: int, ep: int, pipelined: bool, layers: int, first: bool, last: bool,
                  first_layer: int, experts_split: bool, shards: int) -> StageParams:
    dense_in_stage = max(0, min(layers, shape.num_dense_layers - first_layer))
    moe_layers = layers - dense_in_stage if shape.moe is not None else 0
    dense_layers = layers - moe_layers
    attn_and_norms = shape.attention_params() / tp + 2 * shape.d_model
    dense_layer = attn_and_norms + shape.dense_mlp_params() / tp
    dense_linear = min(dense_layer, float8_gathered_params(shape, tp=tp, shards=shards, moe_layer=False))
    dense = dense_layers * dense_layer
    linear = dense_layers * dense_linear
    experts = 0.0
    largest_unit, unit_linear = (dense_layer, dense_linear) if dense_layers else (0.0, 0.0)
    gather = 1 if experts_split else tp
    block, block_linear = dense_layer, dense_linear
    if moe_layers and shape.moe is not None:
        m = shape.moe
        per_expert = 3 * shape.d_model * m.expert_hidden
        shared = m.num_shared_experts * per_expert / tp
        non_routed = attn_and_norms + shape.d_model * m.num_experts + shared
        routed = m.num_experts * per_expert / (ep * tp)
        dense += moe_layers * non_routed
        experts = moe_layers * routed
        block = non_routed + routed * gather
        block_linear = min(non_routed, float8_gathered_params(shape, tp=tp, shards=shards, moe_layer=True))
        linear += moe_layers * block_linear
        if block > largest_unit:
            largest_unit, unit_linear = block, block_linear
    table = shape.vocab_size * shape.d_model / tp
    tables = (first + (last and not shape.tie_embeddings)) if pipelined else (2 - shape.tie_embeddings)
    dense += tables * table + (shape.d_model if last else 0)
    if tables and table > largest_unit:
        largest_unit, unit_linear = table, 0.0
    return StageParams(dense=dense, experts=experts, largest_unit=largest_unit,
                       last_block=block if layers else 0.0, root_unit=tables * table + (shape.d_model if last else 0),
                       expert_gather=gather, linear=linear, unit_linear_share=unit_linear / max(largest_unit, 1.0),
                       block_linear_share=block_linear / max(block, 1.0))


def _states(inputs: PlanInputs, layout: Layout, sp: StageParams, *, num_microbatches: int
            ) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, gathered) bytes of a stage's parameters, as the trainer's FSDP2 holds them
    (parallel/fsdp.py): at every ZeRO level ≥ 1 the parameter (in the master dtype: it is the master copy),
    its gradient and both Adam moments are sharded over the data-parallel shard group (experts over theirs);
    ZeRO-0 replicates them. The compute-dtype copy exists only while gathered (`gathered`, a temporary): per
    unit at ZeRO-3 (resharded after forward), the whole stage at ZeRO-1/2 (kept from forward to backward)."""
    shard = layout.state_shard
    local = sp.sharded(layout)
    unsharded = sp.gathered
    if not inputs.trains_base:  # LoRA/QLoRA: frozen base + trained adapters, sharded like the base
        share = local / max(unsharded, 1.0)  # FSDP2 shards all three at every level ≥ 1
        return _adapter_states(inputs, layout, sp, shares=(share, share, share))
    master_is_param = inputs.master_bytes > 0
    params = local * (inputs.master_bytes if master_is_param else inputs.weight_bytes)
    casts = master_is_param or shard > 1  # a gathered (or cast) compute copy exists during the step
    gather = 0.0
    unit = gather_bytes(inputs, layout, sp.largest_unit, sp.largest_unit * sp.unit_linear_share)
    stage = gather_bytes(inputs, layout, unsharded, sp.linear)
    if casts:  # ZeRO-3: two units in flight (one computing, one prefetched) + one unit's full gradient; ZeRO-1/2:
        # the stage stays gathered from its forward to its backward
        gather = 2 * unit + sp.largest_unit * inputs.grad_bytes if layout.zero >= 3 else stage
    keeps_full_grads = inputs.grad_sync == "last_micro_batch" and num_microbatches > 1
    # Counted at the peak even with one micro-batch a step, whose loss backward comes before any gradient exists
    # (the rehearsal's live tensors have none there): the allocator's reserved peak keeps the last step's
    # gradient blocks (torchtitan's 8 → 128 FSDP ranks free 15.4 GiB, 14.0 planned so, 10.5 without; docs/plan.md).
    grads = (unsharded if keeps_full_grads else local) * inputs.grad_bytes
    if layout.pp > 1 and shard > 1 and PIPELINE_HOLDS_UNSHARDED:
        # torch's pipelining (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`) runs every
        # micro-batch's backward with FSDP's set_reshard_after_backward(False) and
        # set_requires_gradient_sync(False), and reduce-scatters once after the last (`perform_reduce_grad`):
        # through the step a stage holds its whole stage gathered (compute dtype), each parameter's unsharded
        # gradient accumulated in the reduce dtype (FSDP2 upcasts it to reduce_dtype when it does not sync),
        # and the gradient of the unit in its backward in the compute dtype before that upcast. The sharded
        # gradients exist only after the step's peak (they are counted in `grads`), hence the subtraction.
        # Measured by `leantrain rehearse` on the grid's PP rows (bench/plan_vs_rehearsal.py).
        gather = stage + unsharded * inputs.grad_bytes + unit - local * inputs.grad_bytes
    opt_per_param = (0.0 if master_is_param else inputs.master_bytes) + 2 * inputs.moment_bytes
    optimizer = local * opt_per_param
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
                    micro_batch: int, autocast: bool = False, experts_whole_rows: bool = False) -> tuple[float, float]:
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
                                 linear_bytes=inputs.linear_input_bytes, autocast=autocast)
        kw = {"tokens": tokens, "tp": tp, "sp": sp, "act_bytes": inputs.act_bytes, "d_model": shape.d_model,
              "experts_whole_rows": experts_whole_rows}
        per_microbatch += count * layer_activation_bytes(terms, recompute=recompute, **kw)  # type: ignore[arg-type]
        per_microbatch -= count * tokens * frozen_base_bytes(inputs, recompute=recompute, moe_layer=is_moe)
        if inputs.compute_dtype == "fp8" and not inputs.fused_kernels and inputs.trains_base:
            per_microbatch -= count * tokens * float8_tp_saved_bytes(shape, tp=tp, sp=sp, recompute=recompute,
                                                                     act_bytes=inputs.act_bytes, moe_layer=is_moe)
        if recompute == "full":  # backward rebuilds one layer's full activations at a time
            one_layer_full = max(one_layer_full, layer_activation_bytes(terms, recompute="none", **kw))
    if inputs.lora_rank:  # adapters inside a fully recomputed block are rebuilt with it, one layer at a time
        adapters = adapter_activation_bytes(inputs, tokens=tokens, tp=tp)
        if recompute == "full":
            one_layer_full += adapters
        else:
            per_microbatch += layers * adapters
        if first_layer == 0 and layers and frozen_base_counted(inputs, recompute) and (
                {"wq", "wk", "wv"} & set(inputs.lora_targets)):
            # the model's first norm reads the embedding's output, which needs no gradient when the embedding
            # is frozen: it keeps nothing (its fp32 input copy and per-token rstd). (Without a query, key or
            # value adapter the first block's attention keeps nothing at all: not counted, the plan stays above.)
            per_microbatch -= tokens * (4.0 * shape.d_model + 4.0)
    return per_microbatch, one_layer_full


def _stage_activations(inputs: PlanInputs, layout: Layout, *, layers: int, first_layer: int, stage: int,
                       last: bool, num_microbatches: int) -> tuple[float, float]:
    """(activations saved by the forward, temporaries of the backward) of one stage at its peak: the logits'
    transients on the last stage, and under full recompute the one block rebuilt during its backward (tensors
    the backward allocates: `leantrain rehearse` counts them as temp, not as activations)."""
    shape = inputs.shape
    tokens = layout.micro_batch * inputs.seq_len
    autocast = inputs.autocast_casts(layout)
    per_microbatch, one_layer_full = _per_microbatch(
        inputs, layers=layers, first_layer=first_layer, tp=layout.tp, sp=layout.sp, recompute=layout.recompute,
        micro_batch=layout.micro_batch, autocast=autocast, experts_whole_rows=layout.experts_split_over_tp)
    in_flight = in_flight_microbatches(layout, num_microbatches, stage=stage)
    held = per_microbatch * in_flight
    if layout.pp > 1 and not inputs.fused_kernels:
        # torch's PipelineStage keeps each chunk's output (the hidden states sent on) until that chunk's backward,
        # one per chunk forward in flight but the model's last chunk's (the loss): `leantrain rehearse`, PP4 stage 0,
        # 4 × 64 MiB. Megatron frees a sent output (`deallocate_output_tensor`): the fused kernel set keeps none.
        v = layout.virtual_stages
        outputs = in_flight * v - (in_flight if last else 0.0)
        held += outputs * tokens * inputs.act_bytes * shape.d_model / (layout.tp if layout.sp else 1)
    if not last:
        return held, one_layer_full
    logit_count, vocab_tp = _rank_logits(inputs, layout)
    sp_tp = layout.tp if layout.sp and SP_GATHERED_PLANNED else 1  # the final norm's share: with the term below
    if autocast:  # the output projection's own cast of the final norm's fp32 output
        held += tokens * inputs.act_bytes * shape.d_model
    if inputs.fused_loss:  # the final norm, the compute-dtype logits the kernel keeps, its fp32 per-token lse
        head = head_activation_bytes(shape, tokens=tokens, act_bytes=inputs.act_bytes, tp=vocab_tp,
                                     fused=inputs.fused_kernels, sp_tp=sp_tp) - logit_count * LOGIT_SAVED_BYTES
        return held + head + logit_count * inputs.act_bytes + 4.0 * tokens, one_layer_full
    head = head_activation_bytes(shape, tokens=tokens, act_bytes=inputs.act_bytes, tp=vocab_tp,
                                 fused=inputs.fused_kernels, sp_tp=sp_tp)
    head -= frozen_head_bytes(inputs, tokens=tokens, recompute=layout.recompute)
    if KEEPS_COMPUTE_LOGITS:
        head += logit_count * inputs.act_bytes
    # Transient during the loss's backward (see LOGIT_TRANSIENT_BYTES): of the rank's vocabulary slice under
    # the vocabulary-parallel loss, of the whole vocabulary otherwise. Full recompute rebuilds its first block
    # only after the loss's backward has freed these: the larger of the two is live at the peak (`leantrain
    # rehearse`, torchtitan's 70B layout: temp 22.7 GiB, the loss's 23.5 alone; their sum 33.3 was planned).
    per_logit = LOSS_PARALLEL_TRANSIENT_BYTES if vocab_tp > 1 else LOGIT_TRANSIENT_BYTES
    return held + head, max(logit_count * per_logit, one_layer_full)


def _rank_logits(inputs: PlanInputs, layout: Layout) -> tuple[float, int]:
    """(logits of one micro-batch on a rank, the tp degree that splits the vocabulary): the vocabulary-parallel loss
    (`parallelism.loss_parallel`, with or without a pipeline) keeps 1/tp of them per rank; otherwise every TP rank
    holds the whole vocabulary's."""
    vocab_tp = layout.tp if inputs.loss_parallel else 1
    return layout.micro_batch * inputs.seq_len * inputs.shape.vocab_size / vocab_tp, vocab_tp


def _root_reduce_moment(inputs: PlanInputs, layout: Layout, sp: StageParams, *, last: bool, shard: int,
                        num_microbatches: int) -> tuple[float, float] | None:
    """(activations, temporaries) when the root unit's gradients are reduce-scattered, the backward's last act
    (without a pipeline; None where it does not apply): FSDP2 has resharded the root's weights and holds its
    unsharded gradients in the compute dtype beside their copy in the reduce dtype, the reduce-scatter's input, while
    the step still references the compute-dtype logits (`KEEPS_COMPUTE_LOGITS`). With a large vocabulary and short
    sequences this, not the loss's backward, is the step's peak: `leantrain rehearse` of the 8B-wide grid rows at
    sequence 2,048 (bench/plan_vs_rehearsal.py "fsdp8 zero3 seq2k"). The reduce-scatter's output is the root's
    sharded gradient, counted in `grads`, when nothing was accumulated before it (one micro-batch, or gradients
    synced at the last only); after an earlier micro-batch's it is a second tensor until it is added (rehearsed:
    0.49 GiB more on those rows with several micro-batches than with one). `shard`: the FSDP shard group's size."""
    if layout.pp > 1 or shard <= 1 or not inputs.trains_base or sp.root_unit <= 0:
        return None
    temp = sp.root_unit * (inputs.weight_bytes + inputs.grad_bytes)
    accumulated = num_microbatches > 1 and inputs.grad_sync == "every_micro_batch"
    temp -= 0.0 if accumulated else sp.root_unit / shard * inputs.grad_bytes  # the output is the gradient itself
    if inputs.shape.tie_embeddings:
        # The shared table: one more gradient in the compute dtype (the head's and the lookup's), and the first
        # block's reduce-scatter input still live (fp32). Rehearsed on two widths (d 256 and 4,096, 2 layers,
        # FSDP 8): the table × (2 + 2 + 4) B + a block × 4 B to 1 % (tests/test_rehearse_memory.py).
        temp += (sp.root_unit - inputs.shape.d_model) * inputs.weight_bytes + sp.last_block * inputs.grad_bytes
    logits = 0.0
    if last and KEEPS_COMPUTE_LOGITS and not inputs.fused_loss:
        logits = _rank_logits(inputs, layout)[0] * inputs.act_bytes
    return logits, temp


def untouched_resharded_params(shape: ModelShape, layout: Layout, *, stage: int, touched: int) -> float:
    """Parameters (per TP rank) of rank `stage`'s interleaved chunks whose backward has not started at its peak
    (all but the last max(touched, 1): the backwards start from chunk v − 1, `backward_chunks_at_peak`) that
    ZeRO-3 reshards after their forward: each chunk's parameters less its last block, embedding included."""
    p, v = layout.pp, layout.virtual_stages
    chunks = chunk_layers(shape.n_layers, p * v)
    total = 0.0
    for local in range(v - max(touched, 1)):
        index = local * p + stage
        sp = stage_params(shape, layout, layers=chunks[index], first=index == 0, last=index == p * v - 1,
                          first_layer=sum(chunks[:index]))
        total += sp.gathered - sp.last_block
    return total


def recv_buffer_bytes(inputs: PlanInputs, layout: Layout, *, stage: int, num_microbatches: int) -> float:
    """The per-micro-batch receive buffers torch's PipelineStage keeps on a rank (PIPELINE_RECV_BUFFERS): of its
    v chunks every one but the model's first receives an input and every one but the model's last an output
    gradient, m of each, the size of a chunk's output (sequence-sharded under SP, as the output it sends)."""
    if layout.pp == 1 or not PIPELINE_RECV_BUFFERS:
        return 0.0
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    directions = 2 * v - (stage == 0) - (stage == layout.pp - 1)
    tokens = layout.micro_batch * inputs.seq_len
    return directions * num_microbatches * tokens * inputs.shape.d_model * inputs.act_bytes / (
        layout.tp if layout.sp else 1)


def rope_table_bytes(inputs: PlanInputs) -> float:
    """The RoPE cos/sin tables every model part keeps as an fp32 buffer (model/transformer.py), unsharded."""
    return 2 * inputs.seq_len * inputs.shape.head_dim * 4.0


def candidate_stages(layers: list[int]) -> list[int]:
    """Stages that can be the heaviest: the first, the first full-size one, the last."""
    full = layers.index(max(layers))
    return sorted({0, full, len(layers) - 1})


def memory_per_gpu(inputs: PlanInputs, layout: Layout, *, num_microbatches: int) -> MemoryBreakdown:
    """Memory on the heaviest GPU for a layout (see the module docstring for every convention)."""
    layers = stage_layers(inputs.shape.n_layers, layout.pp, layout.virtual_stages)
    best: MemoryBreakdown | None = None
    for stage in candidate_stages(layers):
        mem = stage_memory(inputs, layout, stage=stage, num_microbatches=num_microbatches)
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best


def stage_memory(inputs: PlanInputs, layout: Layout, *, stage: int, num_microbatches: int) -> MemoryBreakdown:
    """Memory on a GPU of pipeline stage `stage` (its first chunk under interleaving)."""
    shape = inputs.shape
    layers = stage_layers(shape.n_layers, layout.pp, layout.virtual_stages)
    first_layer = sum(layers[:stage])
    last = stage == layout.pp - 1
    sp = stage_params(shape, layout, layers=layers[stage], first=stage == 0, last=last, first_layer=first_layer)
    params, grads, optimizer, gather = _states(inputs, layout, sp, num_microbatches=num_microbatches)
    params += rope_table_bytes(inputs)
    activations, transient = _stage_activations(inputs, layout, layers=layers[stage], first_layer=first_layer,
                                                stage=stage, last=last, num_microbatches=num_microbatches)
    touched = backward_chunks_at_peak(layout, num_microbatches, stage=stage)
    shard = layout.state_shard
    if PIPELINE_HOLDS_UNSHARDED and shard > 1 and touched is not None and touched < layout.virtual_stages:
        # FSDP reshards each unit after its forward, and torch's pipelining gathers the stage and makes its
        # unsharded gradients chunk by chunk, at each chunk's first backward (`_states`): at the activation peak
        # only the chunks whose backward has started hold them (`backward_chunks_at_peak`; the sharded
        # gradients, counted in `grads`, do not exist yet). When every chunk forward runs before the first
        # backward (the 405B example's first stages: 16 micro-batches × 7 chunks in the warm-up), the peak is the
        # warm-up's end or the first chunk backward, which also frees one micro-batch-chunk of activations.
        # `leantrain rehearse`: PP2 × v2 with 2 micro-batches, the 405B example's stages (bench/RESULTS.md).
        held = gather + grads
        if touched == 0:
            chunk_activations = activations / (layout.virtual_stages * num_microbatches)
            gather = max(0.0, held / layout.virtual_stages - chunk_activations - grads)
        else:
            gather = max(0.0, held * touched / layout.virtual_stages - grads)
        if layout.zero <= 2 and inputs.trains_base:
            # ZeRO-1/2 do not reshard after forward (parallel/fsdp.py), so the chunks whose backward has not
            # started still hold what ZeRO-3 frees after their forward: each chunk's compute-dtype copy but its
            # last block (kept gathered at every level). `leantrain rehearse`, PP2 × v2 with 2 micro-batches:
            # ZeRO-2's peak holds exactly the first chunk's embedding more than ZeRO-3's (bench/RESULTS.md).
            untouched = untouched_resharded_params(shape, layout, stage=stage, touched=touched)
            gather += gather_bytes(inputs, layout, untouched, untouched * sp.block_linear_share)
    if last and layout.zero >= 3 and gather:
        # The last stage peaks in the loss's backward: FSDP has resharded every unit after its forward (the
        # root too) except the last block, which parallel/fsdp.py keeps gathered for the backward that follows
        # at once (its compute-dtype copy; its gradient does not exist yet). Measured by `leantrain rehearse`.
        last_gather = gather_bytes(inputs, layout, sp.last_block, sp.last_block * sp.block_linear_share)
        if layout.pp > 1 and PIPELINE_HOLDS_UNSHARDED and shard > 1 and num_microbatches > 1 and inputs.trains_base:
            # From the second micro-batch on, that loss backward runs while the unsharded gradients the pipeline
            # keeps (`_states`) exist for the chunks whose backward has started: the whole stage under 1F1B, the
            # model's last chunk under interleaving (`backward_chunks_at_peak`). With the logits split over the
            # vocabulary (loss parallelism under a pipeline, since 2026-12-06) this, not the loss, sets the last
            # stage's peak: `leantrain rehearse` of torchtitan's 405B layout (FSDP 8 × TP 8 × PP 8, 8 micro-batches
            # of 4): last-stage temp 28.1 GiB rehearsed, 7.6 planned without these gradients (1F1B).
            share = 1.0 if touched is None else max(touched, 1) / layout.virtual_stages
            last_gather += max(0.0, sp.gathered * inputs.grad_bytes * share - grads)
        gather = last_gather
    root = _root_reduce_moment(inputs, layout, sp, last=last, shard=shard, num_microbatches=num_microbatches)
    if root is not None and sum(root) > activations + transient + gather:
        activations, transient, gather = root[0], root[1], 0.0
    buffers = inputs.framework_reserve_bytes + transient + gather + recv_buffer_bytes(inputs, layout, stage=stage,
                                                                                       num_microbatches=num_microbatches)
    if layout.zero == 0 and layout.dp > 1:
        buffers += DDP_BUCKET_BYTES
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer, activations=activations,
                           buffers=buffers, capacity=inputs.memory_bytes, stage=stage,
                           reserve=inputs.framework_reserve_bytes)

