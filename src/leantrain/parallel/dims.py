"""Parallel degrees and the device mesh: one object that checks a layout against the world size and owns the mesh.

Axes, outermost first: pp × dp_replicate × dp_shard × tp. Expert parallelism borrows ranks from dp_shard
(dp_shard = dp_shard_mod_ep × ep), as torchtitan does, so experts are split over ep and the rest of the
model is sharded over the whole dp_shard axis. TP is innermost, so TP groups are consecutive ranks and stay
inside a node when tp ≤ GPUs per node.

The data-parallel degree fills what tp × pp leave of the world size (dp = world / (tp × pp)); this is what
lets `--nproc`, `--nnodes MIN:MAX` (elastic) and the scaling sweep change the world size without editing
the spec. tp, pp, ep and the HSDP replica count are fixed by the spec and must divide.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from leantrain.errors import UserInputError
from leantrain.spec.rules import wraps_in_fsdp
from leantrain.spec.schema import JobSpec, ParallelismSpec
from leantrain.spec.shapes import ModelShape, resolve_shape

MESH_AXES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
EXPERT_TP_AXIS = "dp_mod_ep_tp"  # the experts' FSDP mesh under EP × TP (`ParallelDims.expert_fsdp_axis`)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each axis; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    world_size: int
    notes: tuple[str, ...] = field(default=(), compare=False)
    # One rank wrapped in FSDP2 anyway (parallelism.fsdp_single_rank): a 1-rank mesh, FSDP2's own cost measured.
    fsdp_single_rank: bool = False

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas × shards): the ranks that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        """The part of dp_shard that expert parallelism does not use (the experts' FSDP degree, × tp under TP)."""
        return self.dp_shard // self.ep

    @property
    def expert_fsdp_axis(self) -> str:
        """The mesh axis the routed experts' FSDP shards over: the ranks holding the same experts (`dp_mod_ep`), and
        under tensor parallelism also their TP peers, which send the experts other tokens (`parallel.expert`)."""
        return EXPERT_TP_AXIS if self.ep > 1 and self.tp > 1 else "dp_mod_ep"

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: several data-parallel ranks, or one rank by request (`fsdp_single_rank`)."""
        return self.dp > 1 or self.fsdp_single_rank

    @property
    def wraps_in_fsdp(self) -> bool:
        """FSDP2 wraps the model's parts: `fsdp_enabled`, or tensor parallelism (spec/rules.py `wraps_in_fsdp`)."""
        return wraps_in_fsdp(dp=self.dp, tp=self.tp, fsdp_single_rank=self.fsdp_single_rank)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.tp)

    def describe(self) -> str:
        return (
            f"pp {self.pp} × dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard} (ep {self.ep}) "
            f"× tp {self.tp} = {self.world_size}{' (FSDP2 on one rank)' if self.fsdp_single_rank else ''}"
        )

    @classmethod
    def from_spec(
        cls,
        par: ParallelismSpec,
        *,
        world_size: int,
        shape: ModelShape | None = None,
        gpus_per_node: int | None = None,
    ) -> ParallelDims:
        """Check the spec's layout against `world_size` (and the model shape when given); raise naming the axis."""
        if world_size < 1:
            raise UserInputError(f"world size must be at least 1, got {world_size}")
        tp, pp, ep = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel
        for name, degree in (("tensor_parallel", tp), ("pipeline_parallel", pp)):
            if world_size % degree:
                raise UserInputError(
                    f"parallelism.{name} ({degree}) does not divide the world size ({world_size} ranks); "
                    f"choose a {name} that divides {world_size}"
                )
        if world_size % (tp * pp):
            raise UserInputError(
                f"parallelism: tensor_parallel × pipeline_parallel = {tp} × {pp} = {tp * pp} does not divide "
                f"the world size ({world_size} ranks)"
            )
        dp = world_size // (tp * pp)
        notes: list[str] = []
        if dp != par.data_parallel:
            notes.append(
                f"parallelism.data_parallel is {par.data_parallel} in the spec; {world_size} ranks with "
                f"tp {tp} × pp {pp} give data_parallel {dp}"
            )
        replicate = dp if par.zero_stage == 0 else par.data_parallel_replicate
        if dp % replicate:
            raise UserInputError(
                f"parallelism.data_parallel_replicate ({replicate}) does not divide data_parallel ({dp} = "
                f"{world_size} ranks / (tp {tp} × pp {pp}))"
            )
        shard = dp // replicate
        if ep > 1 and shard % ep:
            hint = " (zero_stage 0 replicates every rank; use zero_stage ≥ 1)" if par.zero_stage == 0 else ""
            raise UserInputError(
                f"parallelism.expert_parallel ({ep}) must divide the sharded data-parallel degree ({shard} = "
                f"data_parallel {dp} / data_parallel_replicate {replicate}){hint}"
            )
        if shape is not None:
            _check_shape(par, shape=shape)
        if gpus_per_node is not None and tp > gpus_per_node:
            notes.append(
                f"parallelism.tensor_parallel ({tp}) spans nodes (hardware.gpus_per_node {gpus_per_node}): "
                "its all-reduces per layer will run over the slower inter-node network"
            )
        dims = cls(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, ep=ep, world_size=world_size,
                   notes=tuple(notes))
        assert math.prod(dims.mesh_shape) == world_size
        return dims

    def build_mesh(self, device_type: str) -> LayoutMesh:
        """The world mesh with every axis (size-1 axes included, so names are stable) plus flattened views.

        Flattened names: `dp_shard` (dp_shard_mod_ep × ep: FSDP of dense weights), `dp` (all data-parallel
        ranks: batches and loss), `dp_mod_ep` (replicate × dp_shard_mod_ep: ranks holding the same experts) and,
        with ep and tp > 1, `dp_mod_ep_tp` (those and their TP peers: the experts' FSDP mesh).
        Needs an initialised default process group (real or fake).
        """
        # The mesh's rank tables are real tensors, also under `leantrain rehearse`'s FakeTensorMode (a no-op else).
        with unset_fake_temporarily():
            world = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_AXES)
            flattened = {
                "dp_shard": world["dp_shard_mod_ep", "ep"]._flatten("dp_shard"),
                "dp": world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp"),
                "dp_mod_ep": world["dp_replicate", "dp_shard_mod_ep"]._flatten("dp_mod_ep"),
            }
            if self.expert_fsdp_axis == EXPERT_TP_AXIS:
                flattened[EXPERT_TP_AXIS] = world["dp_replicate", "dp_shard_mod_ep", "tp"]._flatten(EXPERT_TP_AXIS)
            if self.dp_replicate > 1:
                with warnings.catch_warnings():  # slicing a flattened axis is what HSDP needs; torch warns about it
                    warnings.simplefilter("ignore", UserWarning)
                    flattened["hsdp"] = world["dp_replicate", "dp_shard"]
        return LayoutMesh(world=world, flattened=flattened)


@dataclass(frozen=True)
class LayoutMesh:
    """The world mesh and its flattened views, looked up by axis name (`mesh["tp"]`, `mesh["dp"]`, `mesh["hsdp"]`)."""

    world: DeviceMesh
    flattened: dict[str, DeviceMesh]

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.flattened[name] if name in self.flattened else self.world[name]

    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards dense weights over: 2-D (replicate, shard) for HSDP, else the shard axis."""
        return self.flattened.get("hsdp", self.flattened["dp_shard"])


def resolve_parallelism(spec: JobSpec, *, world_size: int) -> ParallelismSpec:
    """The parallelism to run: the spec's own, or with `layout: auto` the planner's chosen layout."""
    par = spec.parallelism
    if par.layout != "auto":
        return par
    from leantrain.plan.planner import make_plan

    layout = make_plan(spec)["layout"]
    planned = layout["dp"] * layout["tp"] * layout["pp"]
    if planned != world_size:
        raise UserInputError(
            f"parallelism.layout: auto: the plan's layout ({layout['dp']} × {layout['tp']} × {layout['pp']} = "
            f"{planned} GPUs) does not match the {world_size} ranks launched; launch {planned} ranks, set "
            "budget.num_gpus, or use layout: spec"
        )
    return par.model_copy(update={
        "data_parallel": layout["dp"], "tensor_parallel": layout["tp"], "pipeline_parallel": layout["pp"],
        "expert_parallel": layout.get("ep", 1), "zero_stage": layout.get("zero", par.zero_stage),
        "data_parallel_replicate": layout.get("dp_replicate", 1),
        "pipeline_schedule": layout.get("schedule", par.pipeline_schedule),
        "virtual_stages": layout.get("virtual_stages", 1),
    })


def layout_for_run(spec: JobSpec, *, world_size: int) -> tuple[ParallelismSpec, ParallelDims]:
    """The parallelism and checked degrees this process group runs (what the trainer calls).

    One process runs every axis at 1 (the spec's tp/pp/ep apply under torchrun; a note says so), as the plain
    model or, with `parallelism.fsdp_single_rank` and a process group, wrapped in FSDP2 over a 1-rank mesh;
    several resolve `layout: auto` and check the spec's degrees against the world size, naming a bad axis.
    """
    par = spec.parallelism
    if world_size == 1:
        kept = {"tensor_parallel": par.tensor_parallel, "pipeline_parallel": par.pipeline_parallel,
                "expert_parallel": par.expert_parallel}
        collapsed = {name: degree for name, degree in kept.items() if degree > 1}
        notes = (
            f"one process: parallelism {', '.join(f'{k} {v}' for k, v in collapsed.items())} run at 1 "
            "(they apply under `leantrain launch --nproc N` / torchrun)",
        ) if collapsed else ()
        single_rank = par.fsdp_single_rank and dist.is_available() and dist.is_initialized()
        if par.fsdp_single_rank and not single_rank:
            notes += ("parallelism.fsdp_single_rank: no process group here, so the plain model runs "
                      "(`leantrain train|launch --nproc 1` start one)",)
        return par, single_process_dims(notes, fsdp_single_rank=single_rank)
    par = resolve_parallelism(spec, world_size=world_size)
    dims = ParallelDims.from_spec(par, world_size=world_size, shape=resolve_shape(spec.model),
                                  gpus_per_node=spec.hardware.gpus_per_node)
    return par, dims


def single_process_dims(notes: tuple[str, ...] = (), *, fsdp_single_rank: bool = False) -> ParallelDims:
    """The one-process layout: every degree 1 (`fsdp_single_rank`: still wrapped in FSDP2, over a 1-rank mesh)."""
    return ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, world_size=1, notes=notes,
                        fsdp_single_rank=fsdp_single_rank)


def _check_shape(par: ParallelismSpec, *, shape: ModelShape) -> None:
    """Shape rules that depend on the degrees (the schema checks them too; --set may bypass neither)."""
    tp = par.tensor_parallel
    for name, size in (("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads), ("ffn_hidden", shape.ffn_hidden)):
        if size % tp:
            raise UserInputError(f"parallelism.tensor_parallel ({tp}) must divide model.{name} ({size})")
    chunks = par.pipeline_parallel * par.virtual_stages
    if chunks > shape.n_layers:
        raise UserInputError(
            f"parallelism.pipeline_parallel × virtual_stages ({chunks}) exceeds model.n_layers ({shape.n_layers})"
        )
    if par.pipeline_parallel > 1 and shape.tie_embeddings:
        raise UserInputError(
            "parallelism.pipeline_parallel > 1 needs model.tie_embeddings: false (the first and last stages "
            "would share the embedding)"
        )
    if par.expert_parallel > 1:
        if shape.moe is None:
            raise UserInputError("parallelism.expert_parallel > 1 needs model.architecture: moe")
        if shape.moe.num_experts % par.expert_parallel:
            raise UserInputError(
                f"parallelism.expert_parallel ({par.expert_parallel}) must divide model.moe.num_experts "
                f"({shape.moe.num_experts})"
            )
