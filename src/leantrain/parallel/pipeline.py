"""Pipeline parallelism: the model split by layers into stages, run by a torch.distributed.pipelining schedule.

Stages: `pp × virtual_stages` chunks of consecutive layers, sizes as equal as possible (earlier stages get
the remainder). The first stage also holds the embedding, the last the final norm and output head. Stage i
lives on pipeline rank i mod pp (the interleaved layout; with one chunk per rank it is just rank i).
Each stage keeps the full model's attribute and layer names (`layers.7.attention.wq` stays that), so
checkpoints are the same whatever the split.

Micro-batches are the gradient-accumulation micro-batches: the schedule takes the step's whole batch and
cuts it into `num_microbatches` pieces; gradients are averaged over them (the schedule scales them). The
loss exists only on the last stage: `broadcast_loss` sends it to every rank for logging.
The MoE auxiliary loss never travels between stages: each stage attaches its own layers' weighted aux loss to
its output with an identity whose backward gives the aux loss the gradient 1 (`_AttachAuxLoss`, the idea of
Megatron's MoEAuxLossAutoScaler), so backward through the stage adds d(aux)/dθ to its layers exactly as
one process does with `(loss + aux) / n`: the schedule divides every gradient by the micro-batch count. The
stages' detached aux sums are added over the pipeline group for logging (`aux_loss_sum`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from leantrain.errors import UserInputError
from leantrain.model.transformer import Transformer
from leantrain.spec.shapes import chunk_layers

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `output`; backward hands `aux_loss` the gradient 1, so it joins the stage's backward."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


class StageModule(nn.Module):
    """A run of consecutive layers (+ the embedding on the first stage, norm and head on the last)."""

    def __init__(self, model: Transformer, *, layer_ids: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.aux_loss_coef = model.args.aux_loss_coef
        # Sum of this stage's weighted MoE aux losses over the step's micro-batches (detached, for logging).
        self.aux_loss_sum: torch.Tensor | None = None
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({i: model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (batch, seq) on the first stage, else hidden states (batch, seq, d_model)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope)
        aux = self._collect_moe_stats()
        if self.norm is not None:
            assert self.output is not None  # tied embeddings are refused under pipeline parallelism
            h = self.output(self.norm(h))  # (batch, seq, vocab)
        if aux is not None and torch.is_grad_enabled():
            self.aux_loss_sum = aux.detach() if self.aux_loss_sum is None else self.aux_loss_sum + aux.detach()
            h = _AttachAuxLoss.apply(h, aux)
        return h

    def _collect_moe_stats(self) -> torch.Tensor | None:
        """As `Transformer._collect_moe_stats`, for this stage's MoE layers: counts added, the weighted aux loss
        of this stage's layers returned (None without MoE aux losses)."""
        aux_losses = []
        for layer in self.layers.values():
            if not getattr(layer, "is_moe", False):
                continue
            moe = layer.feed_forward
            if self.training and moe.last_counts is not None:
                moe.tokens_per_expert += moe.last_counts
            if moe.last_aux_loss is not None:
                aux_losses.append(moe.last_aux_loss)
            moe.last_counts, moe.last_aux_loss = None, None
        return torch.stack(aux_losses).sum() * self.aux_loss_coef if aux_losses else None


class StageGroup(nn.Module):
    """This rank's pipeline stages seen as one module with the full model's names (for checkpoints).

    It holds the stages' own submodules (embedding, layers, norm, head), not the stages, so
    `state_dict()` keys are `layers.5.attention.wq.weight` as in one process, whatever the split or the
    number of virtual stages. FSDP2's state-dict hooks sit on the modules that own the parameters, so they
    run through this view too. It has no forward: the schedule runs the stages.
    """

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(stage, name) is not None:
                    setattr(self, name, getattr(stage, name))
            for layer_id, layer in stage.layers.items():
                self.layers[layer_id] = layer


def split_layers(num_layers: int, num_chunks: int) -> list[list[int]]:
    """Consecutive layer indices per chunk, as equal as possible, the first and last chunks one layer shorter
    when the chunks do not divide the layers (`leantrain.spec.shapes.chunk_layers`, which the planner prices)."""
    if num_chunks > num_layers:
        raise UserInputError(f"pipeline: {num_chunks} stages for {num_layers} layers; each stage needs a layer")
    chunks, start = [], 0
    for size in chunk_layers(num_layers, num_chunks):
        chunks.append(list(range(start, start + size)))
        start += size
    return chunks


def build_stage_modules(
    model: Transformer, *, pp_rank: int, pp: int, virtual_stages: int
) -> list[tuple[int, StageModule]]:
    """(stage index, module) for the stages of this pipeline rank: indices pp_rank, pp_rank + pp, ..."""
    if model.output is None:
        raise UserInputError("parallelism.pipeline_parallel > 1 needs model.tie_embeddings: false")
    num_chunks = pp * virtual_stages
    chunks = split_layers(len(model.layers), num_chunks)
    stages = []
    for index in range(pp_rank, num_chunks, pp):
        ids = [str(i) for i in chunks[index]]
        stages.append((index, StageModule(model, layer_ids=ids, first=index == 0, last=index == num_chunks - 1)))
    return stages


def token_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (the schedule averages over micro-batches)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class StageIO:
    """What flows between stages: tokens into the first, hidden states between, logits out of the last.

    Hidden states are this rank's local tensor (the sequence split over TP ranks under sequence parallelism) in
    the dtype the blocks compute in: bf16 when FSDP gathers bf16 weights, else the master dtype (under autocast
    the residual stream stays fp32). Logits are bf16 whenever matmuls run in bf16.
    """

    micro_batch: int
    seq_len: int
    local_seq_len: int
    d_model: int
    vocab_size: int
    hidden_dtype: torch.dtype
    logits_dtype: torch.dtype

    def args(self, index: int, num_stages: int) -> dict[str, torch.Tensor]:
        meta = torch.device("meta")
        # requires_grad: torch sets up the backward sends and receives for the tensors that carry gradients
        hidden = torch.empty(self.micro_batch, self.local_seq_len, self.d_model, dtype=self.hidden_dtype,
                             device=meta, requires_grad=True)
        tokens = torch.empty(self.micro_batch, self.seq_len, dtype=torch.long, device=meta)
        logits = torch.empty(self.micro_batch, self.seq_len, self.vocab_size, dtype=self.logits_dtype, device=meta,
                             requires_grad=True)
        return {"input_args": tokens if index == 0 else hidden,
                "output_args": logits if index == num_stages - 1 else hidden}


def build_schedule(
    stage_modules: list[tuple[int, nn.Module]],
    *,
    pp_mesh: DeviceMesh,
    schedule: str,
    num_microbatches: int,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_fn,
    stage_io: StageIO | None = None,
) -> tuple[list[PipelineStage], _PipelineSchedule]:
    """PipelineStage objects for this rank's modules and the schedule that runs them.

    `stage_io` gives each stage its input and output as meta tensors (static mode): no stage waits for its
    neighbour's shapes at the first step (torch's dynamic inference is a chain of P2P calls along the pipeline).
    """
    pp = pp_mesh.size()
    num_stages = pp * len(stage_modules)
    if schedule != "interleaved_1f1b" and len(stage_modules) != 1:
        raise UserInputError("parallelism.virtual_stages > 1 needs pipeline_schedule: interleaved_1f1b")
    if num_microbatches < pp:
        raise UserInputError(
            f"pipeline_parallel {pp} needs at least {pp} micro-batches per step (gradient accumulation gives "
            f"{num_microbatches}): raise training.global_batch_tokens or lower training.micro_batch"
        )
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, index, num_stages, device, group=group,
                            **(stage_io.args(index, num_stages) if stage_io is not None else {}))
              for index, module in stage_modules]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved_1f1b":
        return stages, cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)
    return stages, cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn)


def run_schedule(
    schedule: _PipelineSchedule, *, inputs: torch.Tensor, targets: torch.Tensor, is_first: bool, is_last: bool
) -> torch.Tensor | None:
    """One forward/backward over the whole step batch; the mean micro-batch loss on the last stage, else None.

    `return_outputs=False`: by default torch's schedules keep every micro-batch's output on the last stage to
    return them merged, i.e. the logits of the whole step (DeepSeek-V3: 120 × 4,096 × 129,280 fp32, 250 GB);
    the rehearsal showed the last stage's memory growing with the micro-batch count. Only the losses are used."""
    losses: list[torch.Tensor] = []
    if is_first and is_last:
        schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
    elif is_first:
        schedule.step(inputs, return_outputs=False)
    elif is_last:
        schedule.step(target=targets, losses=losses, return_outputs=False)
    else:
        schedule.step(return_outputs=False)
    # under loss parallelism each micro-batch's loss is a replicated DTensor scalar: its local value is the loss
    losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
    return torch.stack(losses).mean().detach() if losses else None


def broadcast_loss(loss: torch.Tensor | None, *, pp_mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """The last stage's loss on every pipeline rank (for logging; it takes no part in backward)."""
    value = loss.clone() if loss is not None else torch.zeros((), device=device)
    group = pp_mesh.get_group()
    dist.broadcast(value, src=dist.get_global_rank(group, pp_mesh.size() - 1), group=group)
    return value


def pipeline_aux_loss(
    stages: list[StageModule], *, pp_mesh: DeviceMesh, device: torch.device, num_microbatches: int
) -> torch.Tensor:
    """The step's mean weighted MoE aux loss over all stages (every stage's layers), on every pipeline rank."""
    total = torch.zeros((), device=device)
    for stage in stages:
        if stage.aux_loss_sum is not None:
            total += stage.aux_loss_sum.to(device)
    dist.all_reduce(total, group=pp_mesh.get_group())
    return total / num_microbatches
