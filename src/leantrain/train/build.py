"""Steps 2–4 of the trainer's setup: the model on the meta device → parallelize → allocate shards → init or load.

    build_parallel_model(spec, dims=..., precision=..., runtime=..., num_microbatches=..., load=None)

1. `Transformer(args)` under `torch.device("meta")`: shapes only, no memory; the fp8 swap (torchao
   Float8Linear), the recompute mode and per-block `torch.compile` are applied here.
2. `parallelize`: pipeline split, tensor parallel, expert parallel, FSDP2, all still on meta; parameters
   cast to the master dtype.
3. `ParallelModel.initialize`: `to_empty` allocates this rank's shards only; buffers are computed; then
   the parameters are filled by `load(parallel)` when a loader is given, else by the layout-independent init
   (`leantrain.model.init`: each parameter's values depend on the seed and its name only).

A weights loader (a Hugging Face safetensors reader, a DCP checkpoint reader) is any callable
`load(parallel: ParallelModel) -> None` that fills the allocated parameters in place: iterate
`parallel.module.named_parameters()` (single-process names, `layers.0.attention.wq.weight`); a sharded
parameter is a DTensor whose `to_local()` is this rank's slice (`param.device_mesh`, `param.placements`, and
`torch.distributed.tensor._utils.compute_local_shape_and_global_offset` say which slice), so the loader
reads only those rows from disk. No rank ever holds more than its shards plus what the loader reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leantrain.dtypes import DTYPES
from leantrain.model.layers import ModelArgs
from leantrain.model.transformer import Transformer, model_args_from_spec
from leantrain.parallel import parallelize
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.parallelize import ParallelModel
from leantrain.parallel.tensor import colwise_linears
from leantrain.spec.schema import JobSpec
from leantrain.train.finetune import prepare_model
from leantrain.train.precision import PrecisionPolicy, apply_precision
from leantrain.train.runtime import Runtime

WeightsLoader = Callable[[ParallelModel], None]


@dataclass
class BuiltModel:
    """What the build produced: the parallel model on this rank and the numbers the `model_ready` event reports."""

    parallel: ParallelModel
    model_args: ModelArgs
    param_bytes_total: int  # every parameter of the whole model once, in the master dtype


def meta_model(spec: JobSpec, *, precision: PrecisionPolicy, fsdp: bool = False, fsdp_shards: int = 1,
               tp: int = 1) -> Transformer:
    """The whole model on the meta device with precision, recompute and compile applied (no memory).

    `fsdp`: the model will be wrapped by FSDP2 over `fsdp_shards` ranks (after `tp`), so float8 layers
    all-gather their weights in float8 (those with a row for every rank: `precision.fills_every_shard`).
    """
    args = model_args_from_spec(spec.model, max_seq_len=spec.data.seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    colwise = colwise_linears(model) if tp > 1 else None  # rows TP splits: the rest keep every row per FSDP shard
    apply_precision(model, precision, cast=False, fsdp_float8_all_gather=fsdp, fsdp_shards=fsdp_shards, tp=tp,
                    tp_colwise=colwise)
    prepare_model(model, spec)  # LoRA/QLoRA: adapters on the targets, the base frozen (train/finetune.py)
    model.set_recompute(spec.training.activation_checkpointing)
    if spec.training.compile:
        model.compile_blocks()
    return model


def build_parallel_model(
    spec: JobSpec, *, dims: ParallelDims, precision: PrecisionPolicy, runtime: Runtime, num_microbatches: int,
    load: WeightsLoader | None = None,
) -> BuiltModel:
    """Build on meta, parallelize, allocate this rank's shards and initialise them (or `load` them)."""
    # A mesh for several ranks, or for one rank wrapped in FSDP2 (parallelism.fsdp_single_rank, a 1-rank group).
    meshed = runtime.distributed or dims.fsdp_single_rank
    fsdp = meshed and dims.wraps_in_fsdp  # as parallelize decides
    model = meta_model(spec, precision=precision, fsdp=fsdp, fsdp_shards=dims.dp_shard, tp=dims.tp)
    itemsize = DTYPES[spec.precision.master_weights].itemsize
    param_bytes_total = sum(p.numel() for p in model.parameters()) * itemsize
    mesh = dims.build_mesh(runtime.device.type) if meshed else None
    parallel = parallelize(model, dims, spec, mesh=mesh, device=runtime.device, num_microbatches=num_microbatches)
    parallel.initialize(seed=spec.training.seed, load=load)
    return BuiltModel(parallel=parallel, model_args=model.args, param_bytes_total=param_bytes_total)
