"""Expert parallelism: each MoE layer's experts are split over the `ep` axis; tokens travel by all-to-all.

The MoE layer sorts its (token, expert) assignments by expert before calling `experts(x_sorted, expert_ids,
counts)`, so the rows bound for one rank are contiguous (rank r owns experts [r·E/ep, (r+1)·E/ep)). Dispatch:
1. exchange per-expert counts (all-to-all of E numbers) so every rank knows how many rows it receives;
2. all-to-all the rows (autograd-aware: backward sends the gradients back the same way);
3. regroup the received rows by local expert and run the local experts' batched matmuls;
4. undo the regrouping and all-to-all the outputs back (combine). The caller un-sorts and weights them.

Expert weights become DTensors sharded on dim 0 over the ep mesh (so checkpoints see the global tensor);
`parallel.fsdp` then shards them further over the ranks holding the same experts (dp_mod_ep) with a
`fully_shard` of their own, which also reduces their gradients.

Under tensor parallelism as well (ep > 1 and tp > 1), the TP ranks of an ep group hold the same experts and
route the same tokens (the router is replicated), so each would dispatch, compute and combine every token
again: tp times the all-to-all bytes and the expert FLOPs. `apply_expert_token_split` gives each TP rank
its 1/tp of the layer's tokens instead (torch.chunk's split of the token rows, with the routing every rank
computed on all of them, as torchtitan's `ReordererSequenceParallel`): it dispatches only those, and the
outputs are all-gathered over TP (backward: each rank's rows of the gradient; the rows' input and routing-
weight gradients are all-gathered, so the replicated router and the layers below get the same gradient on
every TP rank). Each TP rank's expert gradients then hold only its tokens' rows, so the experts' FSDP mesh
is dp_mod_ep × tp: the reduce-scatter sums them, and the experts' states are sharded tp times finer too.

Under full activation checkpointing the block's forward runs again in backward, and routing is deterministic,
so the recompute routes the same counts: it takes the first forward's split sizes (and received counts) instead
of exchanging the counts and reading them on the host again (one host sync per MoE layer and micro-batch, not
two). torchtitan reaches the same end in its op-level selective AC (`torchtitan/distributed/
activation_checkpoint.py`: the dispatch's `all_to_all_single` outputs and device-to-host copies are always saved,
so a recompute neither communicates nor syncs); its full AC re-runs `_token_dispatch` (`distributed/
expert_parallel.py`) with its sync. Here the checkpoint call is a plain one, so each experts module keeps its
dispatches' splits in forward order and its recomputes take them in that order (backward follows forward per
stage module in plain accumulation, GPipe, 1F1B and interleaved 1F1B). The recompute checks what it takes:
the row count on the host, the routed counts on the device (`torch._assert_async`, no sync), so a recompute
in another order fails instead of sending rows by another micro-batch's splits. Only a forward under grad in
a checkpointed region (saved-tensor hooks active) keeps an entry, and its autograd graph holds it (a hook on the
MoE output's grad_fn), so a graph dropped without a backward takes its entries along; no recompute, selective
recompute (the dispatch is outside the recomputed attention core) and no-grad forwards keep nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from leantrain.errors import UserInputError


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The GroupedExperts of every MoE layer of `model` (a Transformer or a pipeline stage)."""
    return [moe.experts for moe in _moe_modules(model)]


def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts over `ep_mesh` in place (`parallel.fsdp` then shards them over dp_mod_ep)."""
    for moe in _moe_modules(model):
        experts = moe.experts
        experts._ep_kept = deque()  # weak references to _KeptSplits, in forward order
        experts._ep_pending = None  # this forward's entry until the MoE output's graph holds it
        distribute_module(experts, ep_mesh, partition_fn=_shard_experts, input_fn=_dispatch, output_fn=_combine)
        moe.register_forward_hook(_hold_kept_splits)


def _moe_modules(model: nn.Module) -> list[nn.Module]:
    return [block.feed_forward for block in model.layers.values() if getattr(block, "is_moe", False)]  # type: ignore[union-attr]


def kept_splits(model: nn.Module) -> int:
    """Dispatches of `model` whose split sizes are kept for a recompute still to come (0 between steps)."""
    return sum(len(getattr(experts, "_ep_kept", ())) for experts in expert_modules(model))


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each stacked expert weight by its rank's slice, wrapped as a DTensor (no communication)."""
    if module is not None and not isinstance(module, nn.Module):
        return
    for param_name, param in list(module.named_parameters(recurse=False)):
        ep, rank = mesh.size(), mesh.get_local_rank()
        local = param.detach().chunk(ep, dim=0)[rank]
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _dispatch(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    """(x_sorted, expert_ids, counts) for all experts → the rows this rank's experts must process."""
    x_sorted, _expert_ids, counts = inputs
    ep = mesh.size()
    num_local = counts.shape[0] // ep
    group = mesh.get_group()
    if _is_recompute():
        kept = _take_kept_splits(module, counts=counts, num_rows=x_sorted.shape[0])
        recv_counts, send_splits, recv_splits = kept.recv_counts, kept.send_splits, kept.recv_splits
    else:
        # recv_counts[s, j]: rows rank s sends to this rank's j-th expert.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(ep, num_local)
        send_splits, recv_splits = host_splits(counts.view(ep, num_local), recv_counts, num_rows=x_sorted.shape[0])
        if _may_be_recomputed():
            _keep_splits(module, _KeptSplits(counts=counts.detach(), recv_counts=recv_counts,
                                             send_splits=send_splits, recv_splits=recv_splits))
    received = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)  # (rows_in, d_model)
    local_ids = torch.arange(num_local, device=counts.device).repeat(ep)
    # (rows_in,), by source rank then expert; the size is known, so no second read of the counts
    local_ids = local_ids.repeat_interleave(recv_counts.flatten(), output_size=sum(recv_splits))
    order = local_ids.argsort(stable=True)
    module._ep_state = (order, send_splits, recv_splits, group)  # read by _combine
    return received[order], local_ids[order], recv_counts.sum(dim=0)


@dataclass
class _KeptSplits:
    """One dispatch's answers, for the recompute of the same forward (two E-long vectors and two ep-long lists)."""

    counts: torch.Tensor  # (experts,) rows this rank routed to each expert: the recompute is checked against it
    recv_counts: torch.Tensor  # (ep, local experts) rows each rank sends to this rank's experts
    send_splits: list[int]
    recv_splits: list[int]


def _is_recompute() -> bool:
    """A forward run by the autograd engine with grad on: activation checkpointing's recompute (torch.utils.
    checkpoint runs it from a saved tensor's unpack hook, inside the backward's graph task)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _may_be_recomputed() -> bool:
    """A forward under grad whose saved tensors go through saved-tensor hooks: torch.utils.checkpoint's (full
    recompute puts the dispatch in such a region; selective recompute and none do not)."""
    return torch.is_grad_enabled() and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def _keep_splits(module: nn.Module, kept: _KeptSplits) -> None:
    queue: deque[weakref.ref[_KeptSplits]] = module._ep_kept

    def forget(ref: weakref.ref[_KeptSplits]) -> None:  # the graph holding the entry is gone
        with contextlib.suppress(ValueError):  # not there when its recompute took it
            queue.remove(ref)

    queue.append(weakref.ref(kept, forget))
    module._ep_pending = kept


def _hold_kept_splits(moe: nn.Module, args: Any, output: torch.Tensor) -> None:
    """Forward hook of the MoE layer: its output's autograd graph holds this forward's kept splits, so they live
    while a backward (and the recompute in it) can still come, and no longer. Without a graph there is no backward
    through this layer: the entry is dropped."""
    experts = moe.experts
    kept, experts._ep_pending = experts._ep_pending, None
    if kept is not None and isinstance(output, torch.Tensor) and output.grad_fn is not None:
        output.grad_fn.register_prehook(lambda grad_outputs, kept=kept: None)


def _take_kept_splits(module: nn.Module, *, counts: torch.Tensor, num_rows: int) -> _KeptSplits:
    """The oldest kept splits of this experts module, checked against the recompute's routing."""
    queue: deque[weakref.ref[_KeptSplits]] = module._ep_kept
    kept = queue.popleft()() if queue else None
    if kept is None:
        raise RuntimeError("expert parallelism: a recomputed MoE forward found no split sizes kept by its first "
                           "forward (a recompute without a forward under grad, or a second backward of the same "
                           "graph); the recompute reuses the first forward's all-to-all splits")
    if sum(kept.send_splits) != num_rows:
        raise RuntimeError(f"expert parallelism: a recomputed MoE forward routes {num_rows} rows, the oldest kept "
                           f"forward routed {sum(kept.send_splits)}: backward must follow forward order per stage")
    # On the device (no host sync): another micro-batch's splits would send rows to the wrong ranks.
    torch._assert_async((counts == kept.counts).all(), "expert parallelism: a recomputed MoE forward routed other "
                        "counts than the oldest kept forward: backward must follow forward order per stage")
    return kept


def host_splits(send_counts: torch.Tensor, recv_counts: torch.Tensor, *, num_rows: int) -> tuple[list[int], list[int]]:
    """Rows this rank sends to and receives from each EP rank ((ep, local experts) counts), read on the host in one
    transfer: a dropless all-to-all needs its split sizes on the host (one sync per MoE layer and micro-batch, as
    torchtitan's token dispatch). `num_rows` (rows sent in all) is what `leantrain rehearse` splits evenly."""
    del num_rows
    send, recv = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
    return [int(n) for n in send], [int(n) for n in recv]


def _combine(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Outputs of the local experts → back to the ranks (and rows) the tokens came from."""
    order, send_splits, recv_splits, group = module._ep_state
    module._ep_state = None
    unsorted = torch.empty_like(output)
    unsorted[order] = output
    return all_to_all_single_autograd(unsorted, send_splits, recv_splits, group)


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight (the whole tensor when not expert-parallel)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class TokenSplit:
    """One TP rank's share of an MoE layer's tokens: torch.chunk's split of the rows (uneven when tp does not
    divide them) over `mesh`. `local` takes this rank's rows of a tensor every TP rank holds whole (backward: the
    rows' gradients all-gathered, the same on every rank); `gather` puts every rank's rows together (backward:
    this rank's rows of a gradient every rank holds whole)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        replicated = DTensor.from_local(whole, self.mesh, [Replicate()], run_check=False)
        return replicated.redistribute(self.mesh, [Shard(0)]).to_local()

    def gather(self, rows: torch.Tensor, *, tokens: int) -> torch.Tensor:
        shape = torch.Size((tokens, *rows.shape[1:]))
        sharded = DTensor.from_local(rows, self.mesh, [Shard(0)], run_check=False, shape=shape,
                                     stride=make_contiguous_strides_for(shape))
        return sharded.redistribute(self.mesh, [Replicate()]).to_local()


def apply_expert_token_split(model: nn.Module, *, tp_mesh: DeviceMesh) -> None:
    """Under expert and tensor parallelism: each TP rank dispatches its 1/tp of every MoE layer's tokens."""
    for moe in _moe_modules(model):
        moe.token_split = TokenSplit(tp_mesh)


def apply_expert_tensor_parallel(model: nn.Module, *, tp_mesh: DeviceMesh) -> None:
    """Without expert parallelism, under TP: each expert's SwiGLU split over `tp_mesh` as Megatron splits an MLP
    (w1/w3 column-wise on the hidden dim, w2 row-wise), as torchtitan's TensorParallel style for experts does.
    Each TP rank then computes 1/tp of every expert instead of every expert whole; the routed rows are the
    same on all TP ranks (the router is replicated), the output's partial sums are all-reduced."""
    tp = tp_mesh.size()
    for experts in expert_modules(model):
        hidden = experts.w1.shape[2]
        if hidden % tp:
            raise UserInputError(f"model.moe.expert_hidden ({hidden}) must be divisible by parallelism.tensor_parallel "
                                 f"({tp}) when expert_parallel is 1")
        distribute_module(experts, tp_mesh, partition_fn=_shard_expert_hidden, input_fn=_tp_input,
                          output_fn=_tp_output)


def _shard_expert_hidden(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if module is not None and not isinstance(module, nn.Module):
        return
    rank, tp = mesh.get_local_rank(), mesh.size()
    for param_name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
        param = getattr(module, param_name, None)
        if param is None:
            return
        local = param.detach().chunk(tp, dim=dim)[rank].contiguous()
        module.register_parameter(param_name, nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(dim)], run_check=False), requires_grad=param.requires_grad))


def _tp_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    """The rows are the same on every TP rank; their gradient is a partial sum, all-reduced in backward."""
    x_sorted, expert_ids, counts = inputs
    return _CopyToTP.apply(x_sorted, mesh.get_group()), expert_ids, counts


def _tp_output(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Each rank's partial sum over its hidden slice → the sum, on every TP rank (one all-reduce)."""
    return _ReduceFromTP.apply(output, mesh.get_group())


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None
