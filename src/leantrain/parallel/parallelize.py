"""The single entry point: `parallelize(model, dims, spec)` applies the layout to a meta-device model.

Order (torchtitan's): pipeline split → tensor parallel → expert parallel → FSDP, all on the meta device,
so no rank ever holds the unsplit model. The result, `ParallelModel`, is what the trainer drives:
materialise and initialise it, step it (`forward_backward`), finish the gradients, clip, step the
optimizer over `parameters()`. See docs/parallel.md for the call sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Replicate

from leantrain.dtypes import DTYPES
from leantrain.model.init import init_buffers, init_parameters
from leantrain.model.layers import ModelArgs
from leantrain.model.moe import MoE
from leantrain.model.transformer import Transformer
from leantrain.parallel.dims import EXPERT_TP_AXIS, LayoutMesh, ParallelDims
from leantrain.parallel.expert import apply_expert_parallel, apply_expert_tensor_parallel, apply_expert_token_split
from leantrain.parallel.fsdp import ExpertSharding, apply_fsdp, uses_bf16_compute
from leantrain.parallel.pipeline import (
    StageGroup,
    StageIO,
    StageModule,
    broadcast_loss,
    build_schedule,
    build_stage_modules,
    pipeline_aux_loss,
    run_schedule,
    token_loss_fn,
)
from leantrain.parallel.tensor import apply_tensor_parallel, maybe_loss_parallel
from leantrain.spec.schema import JobSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ContextFactory = Callable[[], contextlib.AbstractContextManager[object]]
# Fills the allocated (sharded) parameters of a ParallelModel in place, e.g. from a checkpoint or safetensors.
WeightsLoader = Callable[["ParallelModel"], None]
# Called after each micro-batch's backward with its index (tests measure gradient memory there).
MicroBatchHook = Callable[[int], None]


@dataclass
class ParallelModel:
    """The parallelised model on this rank: one module, or this rank's pipeline stages and their schedule.

    With one process (`mesh` is None) it wraps the plain model and every method is the single-process
    computation with no communication, so the trainer has one code path for every layout.
    """

    dims: ParallelDims
    mesh: LayoutMesh | None
    parts: list[nn.Module]
    device: torch.device
    args: ModelArgs
    schedule: _PipelineSchedule | None = None
    stages: list[PipelineStage] = field(default_factory=list)
    loss_parallel: bool = False
    # Under FSDP mixed precision the parameters are gathered in bf16: no autocast needed around forward.
    fsdp_mixed_precision: bool = False
    param_dtype: torch.dtype = torch.float32
    cpu_offload: bool = False
    fsdp: bool = False  # the parts are wrapped by FSDP2 (fully_shard)
    # Reduce(-scatter) gradients after every micro-batch (sharded gradients only) or once after the last.
    grad_sync: str = "every_micro_batch"
    # The loss the pipeline schedule calls (set by forward_backward/evaluate; the schedule is built once).
    active_loss_fn: LossFn = token_loss_fn
    # Mean MoE auxiliary loss of the last forward_backward (None for a dense model or without aux_loss balance).
    last_aux_loss: torch.Tensor | None = None

    @property
    def model(self) -> nn.Module:
        """The single module when there is no pipeline (the trainer's `model`)."""
        if self.schedule is not None:
            raise RuntimeError("a pipelined model has stages, not one module: use forward_backward")
        return self.parts[0]

    @property
    def module(self) -> nn.Module:
        """One module with the single-process parameter names (checkpoints, counting, inspection): the model,
        or under pipeline parallelism this rank's stages seen as one (`StageGroup`)."""
        if self.schedule is None:
            return self.parts[0]
        if not hasattr(self, "_stage_group"):
            self._stage_group = StageGroup([p for p in self.parts if isinstance(p, StageModule)])
        return self._stage_group

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: the data sampler's rank (TP/PP peers share batches)."""
        return 0 if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def is_first_stage(self) -> bool:
        return self.schedule is None or any(s.is_first for s in self.stages)

    @property
    def is_last_stage(self) -> bool:
        return self.schedule is None or any(s.is_last for s in self.stages)

    @property
    def eval_batch_multiple(self) -> int:
        """`evaluate` takes a multiple of this many micro-batches (the schedule's count under PP, else 1)."""
        return 1 if self.schedule is None else self.schedule._n_microbatches

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def initialize(self, *, seed: int, load: WeightsLoader | None = None) -> None:
        """Allocate this rank's shards (`to_empty`) and fill them: buffers always, then parameters from `load`
        when given, else the layout-independent init (`leantrain.model.init`).

        Nothing here holds more than this rank's shards plus one parameter being generated: the same values as
        one process whatever the layout, with no full model on any rank. Under CPU offload the shards are
        allocated in host memory (FSDP2 moves each unit to the device when it gathers it).
        """
        param_device = torch.device("cpu") if self.cpu_offload else self.device
        for part in self.parts:
            part.to_empty(device=param_device)
            init_buffers(part, args=self.args, device=self.device)
        if load is not None:
            load(self)
            return
        for part in self.parts:
            init_parameters(part, args=self.args, seed=seed)

    def forward_backward(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, loss_fn: LossFn = token_loss_fn,
        autocast: ContextFactory = contextlib.nullcontext, after_micro_batch: MicroBatchHook | None = None,
    ) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (inputs, targets); returns the mean loss on every rank.

        Gradients end up as the gradient of the mean micro-batch loss (plus the MoE auxiliary loss when the
        model has one, also under PP where each stage adds its own; its mean is kept in `last_aux_loss`).
        `loss_fn(logits, targets)` returns a micro-batch's mean loss; `autocast` is entered around each forward
        (around the whole schedule under PP). Call `finish_gradients` afterwards.
        """
        self.last_aux_loss = None
        if self.schedule is not None:
            inputs, targets = self._whole_batch(micro_batches)
            self.active_loss_fn = loss_fn
            stages = [p for p in self.parts if isinstance(p, StageModule)]
            for stage in stages:
                stage.aux_loss_sum = None
            with autocast(), maybe_loss_parallel(self.loss_parallel):  # the last stage's loss, vocab-sharded
                loss = run_schedule(self.schedule, inputs=inputs, targets=targets,
                                    is_first=self.is_first_stage, is_last=self.is_last_stage)
            assert self.mesh is not None
            if self.args.moe is not None and self.args.balance == "aux_loss":
                self.last_aux_loss = pipeline_aux_loss(stages, pp_mesh=self.mesh["pp"], device=self.device,
                                                       num_microbatches=len(micro_batches))
            return broadcast_loss(loss, pp_mesh=self.mesh["pp"], device=self.device)
        model = self.model
        total = torch.zeros((), device=self.device)
        aux_total: torch.Tensor | None = None
        for index, (inputs, targets) in enumerate(micro_batches):
            if isinstance(model, FSDPModule) and self.grad_sync == "last_micro_batch":
                # Unsharded gradients are kept until the last micro-batch: one reduce-scatter, more memory.
                model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            with autocast():
                logits = model(inputs.to(self.device))
            with maybe_loss_parallel(self.loss_parallel):
                loss = loss_fn(logits, targets.to(self.device))
                aux = model.auxiliary_loss() if hasattr(model, "auxiliary_loss") else None
                added = aux
                if aux is not None and isinstance(loss, DTensor):  # loss parallel: a replicated DTensor scalar
                    added = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
                ((loss if added is None else loss + added) / len(micro_batches)).backward()
            total += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
            if aux is not None:
                aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
            if after_micro_batch is not None:
                after_micro_batch(index)
        if aux_total is not None:
            self.last_aux_loss = aux_total / len(micro_batches)
        return total / len(micro_batches)

    @torch.no_grad()
    def evaluate(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, loss_fn: LossFn,
        autocast: ContextFactory = contextlib.nullcontext,
    ) -> None:
        """Forward only over `micro_batches` (a multiple of `eval_batch_multiple`), calling `loss_fn` on each
        micro-batch's logits where they exist (every rank, or the last pipeline stage); the caller's
        `loss_fn` collects what it needs."""
        if self.schedule is not None:
            size = self.eval_batch_multiple
            self.active_loss_fn = loss_fn
            for start in range(0, len(micro_batches), size):
                inputs, targets = self._whole_batch(micro_batches[start:start + size])
                with autocast():
                    if self.is_first_stage and self.is_last_stage:
                        self.schedule.eval(inputs, target=targets)
                    elif self.is_first_stage:
                        self.schedule.eval(inputs)
                    elif self.is_last_stage:
                        self.schedule.eval(target=targets)
                    else:
                        self.schedule.eval()
            return
        for inputs, targets in micro_batches:
            with autocast():
                logits = self.model(inputs.to(self.device))
            with maybe_loss_parallel(self.loss_parallel):
                loss_fn(logits, targets.to(self.device))

    def _whole_batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.cat([inp for inp, _ in micro_batches]).to(self.device)
        targets = torch.cat([tgt for _, tgt in micro_batches]).to(self.device)
        return inputs, targets

    def _schedule_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.active_loss_fn(logits, targets)

    def finish_gradients(self) -> None:
        """Reductions FSDP does not do after backward: none today (routed experts have their own FSDP unit, whose
        reduce-scatter averages them); kept as the one place a new kind of parallelism would add its own."""

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all gradients, whatever their sharding (a plain fp32 scalar, equal on every rank)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        by_layout: dict[object, list[torch.Tensor]] = {}
        for grad in grads:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            by_layout.setdefault(key, []).append(grad)
        if self.dims.pp == 1 and list(by_layout) == [None]:  # plain tensors: exactly torch's clip_grad_norm_ norm
            return torch.nn.utils.get_total_norm(by_layout[None], norm_type=2.0, foreach=True)
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        for key, group in by_layout.items():
            mesh, placements = key if key is not None else (None, ())  # type: ignore[misc]
            if mesh is None or EXPERT_TP_AXIS not in (mesh.mesh_dim_names or ()):
                norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
                norm = norm.full_tensor() if key is not None else norm  # type: ignore[union-attr]
                squares += norm.float().to(self.device) ** 2
                continue
            # The experts under EP × TP: DTensor would flatten their (dp_mod_ep_tp, ep) mesh, whose axes are out of
            # the world mesh's order, and torch refuses that. The local shards' squares, summed over each axis the
            # gradients are split on.
            local = [g.to_local() for g in group]  # type: ignore[union-attr]
            part = torch.nn.utils.get_total_norm(local, norm_type=2.0, foreach=True).float().to(self.device) ** 2
            for axis, placement in enumerate(placements):
                if not placement.is_replicate() and mesh.size(axis) > 1:  # Shard, and FSDP's _StridedShard
                    dist.all_reduce(part, group=mesh.get_group(axis))
            squares += part
        if self.dims.pp > 1:  # each pipeline rank holds other layers: add their squares
            assert self.mesh is not None
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        return squares.sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so the global norm is at most `max_norm`; returns the norm before clipping.

        As torch's clip_grad_norm_: the factor min(1, max_norm / (norm + 1e-6)) is applied with foreach
        kernels and without reading it on the host; DTensor gradients are scaled through their local shards.
        """
        norm = self.grad_norm()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in self.parameters():
            if param.grad is not None:
                local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                by_kind.setdefault((local.device, local.dtype), []).append(local)
        with torch.no_grad():
            for (device, _), group in by_kind.items():
                torch._foreach_mul_(group, coef.to(device))
        return norm

    def update_moe_balance(self, *, bias_update_rate: float) -> torch.Tensor | None:
        """After the optimizer step: every MoE layer's counts summed over the data-parallel ranks (not the world:
        TP peers count the same tokens, pipeline stages hold other layers), the aux-free bias moved; returns the
        counts (this rank's MoE layers × experts) or None for a dense model."""
        layers = [m for part in self.parts for m in part.modules() if isinstance(m, MoE)]
        if not layers:
            return None
        group = None if self.mesh is None else self.mesh["dp"].get_group()
        return torch.stack([m.update_balance(bias_update_rate=bias_update_rate, group=group) for m in layers])

    def mean_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank metric over the data-parallel ranks (in place and returned)."""
        if self.mesh is not None and self.dims.dp > 1:
            dist.all_reduce(tensor, group=self.mesh["dp"].get_group())
            tensor /= self.dims.dp
        return tensor

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a per-rank tensor over the data-parallel ranks (in place and returned; a device collective)."""
        if self.mesh is not None and self.dims.dp > 1:
            dist.all_reduce(tensor, group=self.mesh["dp"].get_group())
        return tensor

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a metric tensor over every rank (in place and returned)."""
        if self.mesh is not None:
            dist.all_reduce(tensor)
        return tensor


def parallelize(
    model: Transformer, dims: ParallelDims, spec: JobSpec, *, mesh: LayoutMesh | None, device: torch.device,
    num_microbatches: int = 1,
) -> ParallelModel:
    """Apply the layout in `dims` to `model` (on the meta device); returns this rank's parts.

    `num_microbatches` is the gradient-accumulation count; under pipeline parallelism the schedule runs
    that many micro-batches per step. `mesh` None means one process: the model is returned as it is.
    The parameters are cast to the master dtype here (before sharding, on the meta device); nothing is
    allocated until `ParallelModel.initialize`.
    """
    par = spec.parallelism
    param_dtype = DTYPES[spec.precision.master_weights]
    for param in model.parameters():
        if param.dtype != param_dtype:
            param.data = param.data.to(param_dtype)
    if mesh is None:
        if dims.world_size != 1 or dims.fsdp_single_rank:
            raise ValueError(f"parallelize: the layout {dims.describe()} needs a mesh")
        return ParallelModel(dims=dims, mesh=None, parts=[model], device=device, args=model.args,
                             param_dtype=param_dtype, grad_sync=par.grad_sync)
    if dims.pp > 1:
        pp_rank = mesh["pp"].get_local_rank()
        stage_modules = build_stage_modules(model, pp_rank=pp_rank, pp=dims.pp, virtual_stages=par.virtual_stages)
        parts: list[nn.Module] = [module for _, module in stage_modules]
    else:
        stage_modules, parts = [], [model]
    loss_parallel = par.loss_parallel and dims.tp > 1
    # Tensor parallelism leaves norms (and tied embeddings) plain tensors. Without
    # data parallelism FSDP2 still wraps the parts, over a 1-rank mesh (no sharding, no resharding), so that
    # every parameter is a DTensor: foreach/fused optimizers cannot mix DTensors and plain tensors. One rank
    # with `fsdp_single_rank` is wrapped the same way, at the spec's zero_stage (fsdp_enabled is true for it).
    use_fsdp = dims.wraps_in_fsdp
    zero_stage = par.zero_stage if dims.fsdp_enabled else 2
    for part in parts:
        if dims.tp > 1:
            apply_tensor_parallel(part, tp_mesh=mesh["tp"], sequence_parallel=par.sequence_parallel,
                                  loss_parallel_enabled=loss_parallel, seq_len=spec.data.seq_len,
                                  tied_embeddings=model.args.shape.tie_embeddings)
        experts = None
        if dims.tp > 1 and dims.ep == 1 and model.args.moe is not None:
            apply_expert_tensor_parallel(part, tp_mesh=mesh["tp"])
        if dims.ep > 1:
            apply_expert_parallel(part, ep_mesh=mesh["ep"])
            if dims.tp > 1:  # each TP rank sends its share of the tokens; the experts' FSDP sums over TP too
                apply_expert_token_split(part, tp_mesh=mesh["tp"])
            assert model.args.moe is not None
            experts = ExpertSharding(mesh=mesh[dims.expert_fsdp_axis], ep=dims.ep,
                                     num_experts=model.args.moe.num_experts, grad_divide_factor=dims.dp)
        if use_fsdp:
            apply_fsdp(part, dp_mesh=mesh.data_parallel_mesh(), precision=spec.precision, zero_stage=zero_stage,
                       cpu_offload=par.cpu_offload, experts=experts)
    result = ParallelModel(
        dims=dims, mesh=mesh, parts=parts, device=device, args=model.args, loss_parallel=loss_parallel,
        fsdp_mixed_precision=use_fsdp and uses_bf16_compute(spec.precision), param_dtype=param_dtype,
        cpu_offload=par.cpu_offload and use_fsdp, grad_sync=par.grad_sync, fsdp=use_fsdp,
    )
    if dims.pp > 1:
        bf16_matmuls = result.fsdp_mixed_precision or param_dtype == torch.bfloat16 or (
            spec.precision.compute in ("bf16", "fp8"))
        shape = model.args.shape
        io = StageIO(
            micro_batch=spec.training.micro_batch, seq_len=spec.data.seq_len,
            local_seq_len=spec.data.seq_len // dims.tp if par.sequence_parallel and dims.tp > 1 else spec.data.seq_len,
            d_model=shape.d_model, vocab_size=shape.vocab_size,
            hidden_dtype=torch.bfloat16 if result.fsdp_mixed_precision else param_dtype,
            logits_dtype=torch.bfloat16 if bf16_matmuls else param_dtype)
        result.stages, result.schedule = build_schedule(
            [(i, m) for (i, _), m in zip(stage_modules, parts, strict=True)], pp_mesh=mesh["pp"],
            schedule=par.pipeline_schedule, num_microbatches=num_microbatches, device=device,
            loss_fn=result._schedule_loss, stage_io=io,
        )
    return result
