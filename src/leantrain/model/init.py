"""Weight initialisation by parameter name: the same values whatever the layout, with no full model anywhere.

Every parameter gets its own random stream, seeded from `(training.seed, parameter name)`: the value of
element (i, j) of `layers.3.attention.wq.weight` does not depend on which rank holds it, on the order in
which parameters are initialised, or on how the model is split (FSDP shard, tensor-parallel slice,
pipeline stage, expert-parallel slice). Each parameter is generated in blocks of whole rows, each block
from its own stream; a rank generates only the blocks its shard overlaps and keeps its slice (no
communication), so the transient cost is one block (≤ 64 MiB), never a whole parameter.

The rules (torchtitan's Llama init): embeddings normal(0, 0.02); q/k/v (MLA's latent and up projections
too), w1/w3, router and expert up projections truncated normal(0, 0.02) (cut at ±2, torch's default); the
output projections of each block
(`attention.wo`, `w2`) 0.02/√(2·n_layers), which keeps the residual stream's variance flat with depth (GPT-2);
the untied head 1/√d cut at ±3/√d; norm gains 1; biases 0. Buffers: RoPE tables computed, MoE bias and counts zero.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from leantrain.model.layers import INIT_STD, ModelArgs, rope_tables

Fill = Callable[[torch.Tensor, torch.Generator], None]


def _normal(tensor: torch.Tensor, generator: torch.Generator, *, std: float) -> None:
    nn.init.normal_(tensor, std=std, generator=generator)


def _trunc_normal(tensor: torch.Tensor, generator: torch.Generator, *, std: float, cutoff: float = 2.0) -> None:
    """Normal(0, std) cut at ±cutoff by inverse-CDF sampling (uniform → erfinv), one pass with no host sync.

    torch 2.13's `nn.init.trunc_normal_` rejection-samples and reads `mask.any()` on the host in a loop: a
    device-to-host sync per parameter on CUDA, and a loop a fake-tensor rehearsal cannot run.
    """
    bound = math.erf(cutoff / std / math.sqrt(2.0))  # 2·Φ(cutoff/std) − 1: the uniform range that maps inside
    tensor.uniform_(-bound, bound, generator=generator)
    tensor.erfinv_().mul_(std * math.sqrt(2.0)).clamp_(min=-cutoff, max=cutoff)


def _ones(tensor: torch.Tensor, generator: torch.Generator) -> None:
    del generator  # deterministic
    nn.init.ones_(tensor)


def _zeros(tensor: torch.Tensor, generator: torch.Generator) -> None:
    del generator  # deterministic
    nn.init.zeros_(tensor)


def init_rule(name: str, args: ModelArgs) -> Fill:
    """How the parameter called `name` (single-process name, e.g. `layers.0.feed_forward.experts.w2`) is filled."""
    shape = args.shape
    out_std = INIT_STD / math.sqrt(2 * shape.n_layers)
    if name.endswith("norm.weight"):
        return _ones
    if name.endswith(".bias"):  # projection biases (Qwen2-style q/k/v) start at zero
        return _zeros
    if name == "tok_embeddings.weight":
        return partial(_normal, std=INIT_STD)
    if name == "output.weight":
        return partial(_trunc_normal, std=1 / math.sqrt(shape.d_model), cutoff=3 / math.sqrt(shape.d_model))
    if name.endswith(("attention.wo.weight", ".w2.weight", "experts.w2")):
        return partial(_trunc_normal, std=out_std)
    if name.endswith(("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "router.gate.weight",
                      "attention.wq_a.weight", "attention.wq_b.weight", "attention.wkv_a.weight",
                      "attention.wkv_b.weight",
                      ".w1.weight", ".w3.weight", "experts.w1", "experts.w3")):
        return partial(_trunc_normal, std=INIT_STD)
    raise KeyError(f"no init rule for parameter {name!r}: add one to leantrain.model.init.init_rule")


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter's stream, stable across processes, Python versions and layouts."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


BLOCK_ELEMENTS = 1 << 24  # one generation block: 64 MiB of fp32 at most (a row is never split)


def row_block(shape: tuple[int, ...]) -> int:
    """Rows of dim 0 in one generation block of a parameter of global `shape` (depends on the shape alone)."""
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(inner, 1))


def block_seed(seed: int, block: int) -> int:
    """The stream of one block of rows: block 0 keeps the parameter's own seed."""
    return seed if block == 0 else param_seed(seed, f"block{block}")


def fill_parameter(param: torch.Tensor, fill: Fill, *, seed: int) -> None:
    """Fill `param` (a plain tensor or this rank's DTensor shard) with `fill`, rank-locally and in blocks.

    The global tensor is cut into blocks of whole rows along dim 0 (`row_block`), each drawn from its own
    stream (`block_seed`), in fp32 and cast on copy: a bf16 master holds the fp32 values rounded, and every
    layout holds the same numbers. A rank generates only the blocks its shard overlaps (where its shard lies
    comes from the DTensor's placements, as DCP computes it), so the transient cost is one block, never the
    whole parameter: a 256-expert w1 (15 GB in fp32) is never materialised anywhere. A shard split along a
    later dim (tensor-parallel row-wise, expert FSDP on dim 1) still walks every block of its rows, one at a time.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    shape = tuple(param.shape)
    if isinstance(param, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    else:
        local_shape, offset = shape, (0,) * len(shape)
    if local.numel() == 0:
        return
    device = _generation_device(param, local)
    if not shape:  # a scalar parameter: one block of one element
        value = torch.empty(1, dtype=torch.float32, device=device)
        fill(value, torch.Generator(device=device).manual_seed(seed))
        local.copy_(value[0])
        return
    rows = row_block(shape)
    start, stop = offset[0], offset[0] + local_shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:], strict=True))
    for block in range(start // rows, -(-stop // rows)):
        first, last = block * rows, min((block + 1) * rows, shape[0])
        values = torch.empty((last - first, *shape[1:]), dtype=torch.float32, device=device)
        fill(values, torch.Generator(device=device).manual_seed(block_seed(seed, block)))
        lo, hi = max(first, start), min(last, stop)
        local[lo - start:hi - start].copy_(values[(slice(lo - first, hi - first), *inner)])


def _generation_device(param: torch.Tensor, local: torch.Tensor) -> torch.device:
    """Where the values are generated: the mesh's device (so a CPU-offloaded shard of a GPU run gets the GPU
    run's values, and the slice is cut where DTensor expects it), else the tensor's own."""
    if not isinstance(param, DTensor) or param.device_mesh.device_type == local.device.type:
        return local.device
    mesh_type = param.device_mesh.device_type
    index = torch.cuda.current_device() if mesh_type == "cuda" else None
    return torch.device(mesh_type, index)


@torch.no_grad()
def init_parameters(module: nn.Module, *, args: ModelArgs, seed: int) -> None:
    """Initialise every parameter of `module` (a Transformer, a pipeline stage, a sharded model) by name."""
    for name, param in module.named_parameters():
        fill_parameter(param, init_rule(name, args), seed=param_seed(seed, name))


@torch.no_grad()
def init_buffers(module: nn.Module, *, args: ModelArgs, device: torch.device) -> None:
    """Fill the non-learned state on `device`: RoPE tables (computed), MoE selection bias and counts (zero)."""
    for owner in module.modules():
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if name == "rope":
                owner.register_buffer(name, rope_tables(
                    head_dim=args.shape.rope_dim, max_seq_len=args.max_seq_len, theta=args.rope_theta,
                    device=device, scaling=args.rope_scaling), persistent=False)
            elif name in ("expert_bias", "tokens_per_expert"):
                persistent = name not in owner._non_persistent_buffers_set
                owner.register_buffer(name, torch.zeros(buffer.shape, device=device), persistent=persistent)
