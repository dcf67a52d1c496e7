"""The single entry point: `parallelize(model, dims, spec)` applies the layout to a meta-device model.

Order (torchtitan's): pipeline split → tensor parallel → expert parallel → FSDP, all on the meta device,
so no rank ever holds the unsplit model. The result, `ParallelModel`, is what the trainer drives:
materialise and initialise it, step it (`forward_backward`), finish the gradients, clip, step the
optimizer over `parameters()`. See docs/parallel.md for the call sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Replicate

from leantrain.model.transformer import Transformer
from leantrain.parallel.dims import LayoutMesh, ParallelDims
from leantrain.parallel.expert import apply_expert_parallel, finish_expert_grads
from leantrain.parallel.fsdp import apply_fsdp
from leantrain.parallel.pipeline import (
    broadcast_loss,
    build_schedule,
    build_stage_modules,
    run_schedule,
    token_loss_fn,
)
from leantrain.parallel.tensor import apply_tensor_parallel, maybe_loss_parallel
from leantrain.spec.schema import JobSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ParallelModel:
    """The parallelised model on this rank: one module, or this rank's pipeline stages and their schedule."""

    dims: ParallelDims
    mesh: LayoutMesh
    parts: list[nn.Module]
    device: torch.device
    schedule: _PipelineSchedule | None = None
    stages: list[PipelineStage] = field(default_factory=list)
    loss_parallel: bool = False
    # Under FSDP mixed precision the parameters are gathered in bf16: no autocast needed around forward.
    fsdp_mixed_precision: bool = False

    @property
    def model(self) -> nn.Module:
        """The single module when there is no pipeline (the trainer's `model`)."""
        if self.schedule is not None:
            raise RuntimeError("a pipelined model has stages, not one module: use forward_backward")
        return self.parts[0]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: the data sampler's rank (TP/PP peers share batches)."""
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def is_first_stage(self) -> bool:
        return self.schedule is None or any(s.is_first for s in self.stages)

    @property
    def is_last_stage(self) -> bool:
        return self.schedule is None or any(s.is_last for s in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    def materialize(self, *, full_model: Transformer) -> None:
        """Allocate on the device and copy this rank's slice of every weight and buffer from `full_model`.

        `full_model` is the single-process model built with the same seed (`build_model` on the CPU), so a
        layout starts from exactly the weights one process would: the equivalence guarantee. It costs the
        full model in host memory once per rank; for models too big for that, use `init_weights`.
        """
        full = dict(full_model.named_parameters()) | dict(full_model.named_buffers())
        for part in self.parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                for name, tensor in list(part.named_parameters()) + list(part.named_buffers()):
                    _copy_slice(tensor, full[name].to(self.device))

    def init_weights(self, *, seed: int) -> None:
        """Allocate and initialise in place with the model's own init (no full copy; the values then depend on
        the layout's random streams, as in torchtitan). Only for an unpipelined model."""
        self.model.to_empty(device=self.device)
        torch.manual_seed(seed)
        self.model.init_weights(buffer_device=self.device)  # type: ignore[operator]

    def forward_backward(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, loss_fn: LossFn = token_loss_fn
    ) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (inputs, targets); returns the mean loss on every rank.

        Gradients end up as the gradient of the mean micro-batch loss (plus the MoE auxiliary loss when the
        model has one and there is no pipeline). Call `finish_gradients` afterwards.
        """
        if self.schedule is not None:
            inputs = torch.cat([inp for inp, _ in micro_batches]).to(self.device)
            targets = torch.cat([tgt for _, tgt in micro_batches]).to(self.device)
            loss = run_schedule(self.schedule, inputs=inputs, targets=targets,
                                is_first=self.is_first_stage, is_last=self.is_last_stage)
            return broadcast_loss(loss, pp_mesh=self.mesh["pp"], device=self.device)
        model = self.model
        total = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            if isinstance(model, FSDPModule):  # reduce gradients once, after the last micro-batch
                model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            logits = model(inputs.to(self.device))
            with maybe_loss_parallel(self.loss_parallel):
                loss = loss_fn(logits, targets.to(self.device))
                aux = model.auxiliary_loss() if hasattr(model, "auxiliary_loss") else None
                ((loss if aux is None else loss + aux) / len(micro_batches)).backward()
            total += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        return total / len(micro_batches)

    def finish_gradients(self) -> None:
        """Reductions FSDP does not do: expert gradients (mean over data parallelism)."""
        if self.dims.ep > 1:
            finish_expert_grads(self.parts, dp_mod_ep_mesh=self.mesh["dp_mod_ep"], dp_degree=self.dims.dp)

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all gradients, whatever their sharding (a plain fp32 scalar, equal on every rank)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        by_layout: dict[object, list[torch.Tensor]] = {}
        for grad in grads:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            by_layout.setdefault(key, []).append(grad)
        for key, group in by_layout.items():
            norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
            if key is not None:
                norm = norm.full_tensor()  # type: ignore[union-attr]
            squares += norm.float() ** 2
        if self.dims.pp > 1:  # each pipeline rank holds other layers: add their squares
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        return squares.sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so the global norm is at most `max_norm`; returns the norm before clipping."""
        norm = self.grad_norm()
        coef = float(max_norm / (norm + 1e-6))
        if coef < 1.0 and math.isfinite(coef):
            with torch.no_grad():
                for param in self.parameters():
                    if param.grad is not None:
                        param.grad.mul_(coef)
        return norm


def _copy_slice(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into `target` (a DTensor shard or a plain tensor); no communication."""
    if isinstance(target, DTensor):
        mesh = target.device_mesh
        replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        local = replicated.redistribute(mesh, target.placements).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def parallelize(
    model: Transformer, dims: ParallelDims, spec: JobSpec, *, mesh: LayoutMesh, device: torch.device,
    num_microbatches: int = 1,
) -> ParallelModel:
    """Apply the layout in `dims` to `model` (on the meta device); returns this rank's parts.

    `num_microbatches` is the gradient-accumulation count; under pipeline parallelism the schedule runs
    that many micro-batches per step.
    """
    par = spec.parallelism
    if dims.pp > 1:
        pp_rank = mesh["pp"].get_local_rank()
        stage_modules = build_stage_modules(model, pp_rank=pp_rank, pp=dims.pp, virtual_stages=par.virtual_stages)
        parts: list[nn.Module] = [module for _, module in stage_modules]
    else:
        stage_modules, parts = [], [model]
    loss_parallel = par.loss_parallel and dims.tp > 1 and dims.pp == 1
    for part in parts:
        if dims.tp > 1:
            apply_tensor_parallel(part, tp_mesh=mesh["tp"], sequence_parallel=par.sequence_parallel,
                                  loss_parallel_enabled=loss_parallel, seq_len=spec.data.seq_len)
        expert_params = apply_expert_parallel(part, ep_mesh=mesh["ep"]) if dims.ep > 1 else []
        if dims.fsdp_enabled:
            apply_fsdp(part, dp_mesh=mesh.data_parallel_mesh(), precision=spec.precision, zero_stage=par.zero_stage,
                       cpu_offload=par.cpu_offload, ignored_params=expert_params)
    result = ParallelModel(
        dims=dims, mesh=mesh, parts=parts, device=device, loss_parallel=loss_parallel,
        fsdp_mixed_precision=dims.fsdp_enabled and spec.precision.compute == "bf16",
    )
    if dims.pp > 1:
        result.stages, result.schedule = build_schedule(
            [(i, m) for (i, _), m in zip(stage_modules, parts, strict=True)], pp_mesh=mesh["pp"],
            schedule=par.pipeline_schedule, num_microbatches=num_microbatches, device=device,
        )
    return result
