"""FSDP2 (`fully_shard`): each transformer block is one communication unit, the root holds the rest.

- ZeRO level from `parallelism.zero_stage`: 3 re-shards parameters after forward (all-gather again in
  backward); 1 and 2 keep them gathered between forward and backward (FSDP2 always shards gradients and
  optimizer states, so 1 and 2 are the same layout here); 0 replicates (DDP: the dims put every
  data-parallel rank on the replicate axis).
- HSDP: a 2-D data mesh (dp_replicate, dp_shard): shards within a group, all-reduce across groups.
- Mixed precision from `precision`: compute bf16 with fp32 master weights → parameters all-gathered and
  used in bf16, gradients reduced in `grad_reduce`'s dtype (fp32 by default).
- Routed experts under expert parallelism (already DTensors split over `ep`) get a `fully_shard` of their own
  over the ranks that hold the same experts (`dp_mod_ep`; under TP also their TP peers, `dp_mod_ep_tp`, whose
  gradients hold other tokens' rows: parallel/expert.py), as torchtitan does (torchtitan/models/llama4/
  infra/parallelize.py, `apply_fsdp`): their fp32 masters, gradients and Adam states are sharded like every
  other weight, gathered in bf16, and their gradients reduce-scattered (summed over the ranks' rows, divided
  by the whole data-parallel degree). When dp_mod_ep × ep exceeds the expert count the shards split dim 1
  (the model width) rather than the few local experts (torchtitan's rule).
- CPU offload keeps parameters, gradients and optimizer states in host memory; `pin_memory` only on CUDA
  (on a CPU-only build pinned memory needs an accelerator and fails).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

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
    experts: ExpertSharding | None = None,
) -> nn.Module:
    """fully_shard every block of `module.layers`, then the root (embeddings, final norm, head).

    `experts` (under expert parallelism): each MoE block's routed experts are wrapped first, on their own mesh.
    """
    common = {
        "mp_policy": mixed_precision_policy(precision),
        "offload_policy": offload_policy(enabled=cpu_offload, device_type=dp_mesh.device_type),
    }
    reshard = zero_stage == 3
    blocks = list(module.layers.values())  # type: ignore[union-attr]
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keeping them saves one all-gather.
        block_reshard = reshard and index < len(blocks) - 1
        routed = getattr(block.feed_forward, "experts", None) if getattr(block, "is_moe", False) else None
        if experts is not None and routed is not None:
            experts.wrap(routed, reshard_after_forward=block_reshard, **common)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=block_reshard, **common)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, **common)
    return module


class ExpertSharding:
    """How routed experts are sharded by FSDP: over `mesh` (dp_mod_ep), gradients divided by `grad_divide_factor`
    (the data-parallel degree: each rank's expert gradient already holds the rows of its whole ep group)."""

    def __init__(self, *, mesh: DeviceMesh, ep: int, num_experts: int, grad_divide_factor: int) -> None:
        self.mesh, self.grad_divide_factor = mesh, grad_divide_factor
        self.shard_dim = 1 if mesh.size() * ep > num_experts else 0

    def wrap(self, experts: nn.Module, *, reshard_after_forward: bool, **common: object) -> None:
        dim = self.shard_dim
        fully_shard(experts, mesh=self.mesh, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=lambda _param: Shard(dim), **common)  # type: ignore[arg-type]
        experts.set_gradient_divide_factor(float(self.grad_divide_factor))  # type: ignore[operator]
        # gloo has no PREMUL_SUM: sum, then divide. Not on a 1-rank mesh: there torch 2.13 divides once in its
        # copy-out and once more after it when sums are forced (the gradient would be divided by factor²).
        if self.mesh.size() > 1 and dist.get_backend(self.mesh.get_group()) == "gloo":
            experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


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
