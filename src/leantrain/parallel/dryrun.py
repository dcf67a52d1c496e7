"""`leantrain launch SPEC --dry-run`: build the full N-rank layout on one machine, with no communication.

Each rank's layout is built in turn in this process on a fake process group (`torch.testing`'s FakeStore
and the `fake` backend: collectives return at once) with the model on the meta device, so an 8B model
on 64 ranks costs no memory. What each rank would hold is read from the local shards' shapes:
parameters (master dtype), gradients (same dtype: FSDP2 keeps sharded gradients in the parameter dtype)
and AdamW's two moments (optimizer_state dtype; 8bit ≈ 1 byte). The heaviest rank is compared with the
planner's memory model for the same layout (`plan.memory.memory_per_gpu`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from leantrain.errors import UserInputError
from leantrain.model.transformer import Transformer, model_args_from_spec
from leantrain.parallel.dims import ParallelDims, resolve_parallelism
from leantrain.parallel.parallelize import parallelize
from leantrain.spec.schema import JobSpec
from leantrain.spec.shapes import resolve_shape

BYTES = {"fp32": 4, "bf16": 2, "8bit": 1}
ALL_RANKS_UP_TO = 64  # above this, one rank per (pp, tp) position is built and the rest are alike


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds, in bytes (device memory unless offloaded)."""

    rank: int
    num_params: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass
class DryRunReport:
    dims: ParallelDims
    ranks: list[RankBytes]
    plan: dict[str, float] = field(default_factory=dict)  # the planner's params/grads/optimizer per GPU
    notes: list[str] = field(default_factory=list)

    @property
    def heaviest(self) -> RankBytes:
        return max(self.ranks, key=lambda r: r.total_bytes)

    def total_params(self, *, full_model_params: int) -> float:
        """Parameters held across ranks ÷ the model's: 1.0 for pure sharding, tp/pp-replication shows above."""
        return sum(r.num_params for r in self.ranks) / full_model_params

    def to_json(self) -> dict[str, object]:
        heavy = self.heaviest
        return {
            "layout": self.dims.describe(),
            "world_size": self.dims.world_size,
            "ranks": [r.__dict__ | {"total_bytes": r.total_bytes} for r in self.ranks],
            "heaviest_rank": heavy.rank,
            "plan": self.plan,
            "notes": self.notes,
        }


@contextlib.contextmanager
def fake_process_group(*, rank: int, world_size: int) -> Iterator[None]:
    """A process group that does no communication (rank `rank` of `world_size`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserInputError("a fake process group is started here: run this outside torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # the code inside may have ended it (the trainer's close does)
            dist.destroy_process_group()


def ranks_to_build(dims: ParallelDims) -> list[int]:
    """All ranks for small jobs; for large ones, the first data-parallel rank of every (pp, tp) position."""
    if dims.world_size <= ALL_RANKS_UP_TO:
        return list(range(dims.world_size))
    per_pp = dims.world_size // dims.pp
    return [p * per_pp + t for p in range(dims.pp) for t in range(dims.tp)]


def rank_bytes(spec: JobSpec, dims: ParallelDims, *, rank: int, num_microbatches: int) -> RankBytes:
    """Build rank `rank`'s layout on the meta device under a fake process group; count what it holds."""
    args = model_args_from_spec(spec.model, max_seq_len=spec.data.seq_len)
    with fake_process_group(rank=rank, world_size=dims.world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(args)
        pm = parallelize(model, dims, spec, mesh=mesh, device=torch.device("cpu"), num_microbatches=num_microbatches)
        num = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in pm.parameters())
    prec = spec.precision
    param_bytes = BYTES[prec.master_weights]
    return RankBytes(rank=rank, num_params=num, params_bytes=num * param_bytes, grads_bytes=num * param_bytes,
                     optimizer_bytes=num * 2 * BYTES[prec.optimizer_state])


def dry_run(spec: JobSpec, *, world_size: int) -> DryRunReport:
    """Every rank's parameter/gradient/optimizer bytes for `spec` on `world_size` ranks, and the plan's numbers."""
    if dist.is_initialized():
        raise RuntimeError("dry_run builds its own fake process groups; call it outside a distributed job")
    par = resolve_parallelism(spec, world_size=world_size)
    dims = ParallelDims.from_spec(par, world_size=world_size, shape=resolve_shape(spec.model),
                                  gpus_per_node=spec.hardware.gpus_per_node)
    spec = spec.model_copy(update={"parallelism": par})
    per_dp = spec.training.micro_batch * spec.data.seq_len * dims.dp
    num_microbatches = max(1, spec.training.global_batch_tokens // per_dp)
    ranks = [rank_bytes(spec, dims, rank=r, num_microbatches=num_microbatches) for r in ranks_to_build(dims)]
    report = DryRunReport(dims=dims, ranks=ranks, notes=list(dims.notes))
    report.plan = planned_bytes(spec, dims, num_microbatches=num_microbatches)
    if par.cpu_offload:
        report.notes.append("parallelism.cpu_offload: these bytes live in host memory, not on the device")
    return report


def planned_bytes(spec: JobSpec, dims: ParallelDims, *, num_microbatches: int) -> dict[str, float]:
    """The planner's params/grads/optimizer bytes per GPU for this very layout (empty if the planner is absent)."""
    try:
        from leantrain.plan.inputs import plan_inputs
        from leantrain.plan.layout import layout_from_spec
        from leantrain.plan.memory import memory_per_gpu
    except ImportError:
        return {}
    layout = layout_from_spec(spec.parallelism, spec.training, num_gpus=dims.world_size)
    memory = memory_per_gpu(plan_inputs(spec), layout, num_microbatches=num_microbatches)
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
            "total": memory.params + memory.grads + memory.optimizer}
