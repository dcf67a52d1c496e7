"""FSDP2 (`fully_shard`): each transformer block is one communication unit, the root holds the rest.

- ZeRO level from `parallelism.zero_stage`: 3 re-shards parameters after forward (all-gather again in
  backward); 1 and 2 keep them gathered between forward and backward (FSDP2 always shards gradients and
  optimizer states, so 1 and 2 are the same layout here); 0 replicates (DDP: the dims put every
  data-parallel rank on the replicate axis).
- HSDP: a 2-D data mesh (dp_replicate, dp_shard): shards within a group, all-reduce across groups.
- Mixed precision from `precision`: compute bf16 with fp32 master weights → parameters all-gathered and
  used in bf16, gradients reduced in `grad_reduce`'s dtype (fp32 by default).
- CPU offload keeps parameters, gradients and optimizer states in host memory; `pin_memory` only on CUDA
  (on a CPU-only build pinned memory needs an accelerator and fails).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from leantrain.dtypes import DTYPES
from leantrain.spec.schema import PrecisionSpec


def uses_bf16_compute(precision: PrecisionSpec) -> bool:
    """bf16 (or fp8, whose non-float8 layers run in bf16) compute over fp32 master weights."""
    return precision.compute in ("bf16", "fp8") and precision.master_weights == "fp32"


def mixed_precision_policy(precision: PrecisionSpec) -> MixedPrecisionPolicy:
    """bf16 (or fp8) compute over fp32 masters → gather in bf16, reduce in grad_reduce's dtype; otherwise no casts.

    Under fp8 the float8 Linear layers all-gather their weights in float8 (torchao's FSDP2 float8 all-gather);
    everything else (embeddings, norms, attention core, the head) gathers and computes in bf16.
    """
    if uses_bf16_compute(precision):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[precision.grad_reduce])
    if precision.grad_reduce == "fp32" and precision.master_weights == "bf16":
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(*, enabled: bool, device_type: str) -> OffloadPolicy:
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_fsdp(
    module: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    precision: PrecisionSpec,
    zero_stage: int,
    cpu_offload: bool,
    ignored_params: Iterable[nn.Parameter] = (),
) -> nn.Module:
    """fully_shard every block of `module.layers`, then the root (embeddings, final norm, head).

    `ignored_params` (expert weights under expert parallelism) stay out of FSDP: they are already split.
    """
    ignored = set(ignored_params)
    common = {
        "mesh": dp_mesh,
        "mp_policy": mixed_precision_policy(precision),
        "offload_policy": offload_policy(enabled=cpu_offload, device_type=dp_mesh.device_type),
    }
    reshard = zero_stage == 3
    blocks = list(module.layers.values())  # type: ignore[union-attr]
    for index, block in enumerate(blocks):
        block_ignored = {p for p in block.parameters() if p in ignored}
        # The last block's parameters are needed again at once by backward: keeping them saves one all-gather.
        fully_shard(
            block, reshard_after_forward=reshard and index < len(blocks) - 1,
            ignored_params=block_ignored or None, **common,
        )
    fully_shard(module, reshard_after_forward=reshard, ignored_params=ignored or None, **common)
    return module


def held_gradient_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of gradient this rank holds now: the sharded `.grad`s plus any unsharded gradients FSDP2 keeps
    between micro-batches when gradient sync is off (read from its parameter groups; FSDP2 internals)."""
    total, seen = 0, set()
    for module in modules:
        for param in module.parameters():
            grad = param.grad
            if grad is not None and id(param) not in seen:
                seen.add(id(param))
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                total += local.numel() * local.element_size()
        for sub in module.modules():
            if not isinstance(sub, FSDPModule):
                continue
            for group in sub._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    total += _unsharded_grad_bytes(fsdp_param)
    return total


def _unsharded_grad_bytes(fsdp_param: object) -> int:
    grads = [getattr(fsdp_param, "unsharded_accumulated_grad", None)]
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if unsharded is not None:
        grads.append(unsharded.grad)
    return sum(g.numel() * g.element_size() for g in grads if g is not None)
