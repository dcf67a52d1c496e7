"""Mixture-of-experts layer: top-k router, dropless grouped experts, shared experts, load balancing.

Dispatch is dropless: every (token, expert) assignment is computed. Assignments are sorted by expert and
run as three grouped GEMMs (`torch._grouped_mm` over the sorted rows, with the per-expert offsets on the
device): no Python loop over tokens or experts, no padding, and no host sync — every shape in the forward is
static ((tokens × top_k, d_model) whatever the routing), so `torch.compile` traces a block in one graph
without recompiling when the load moves. Where the grouped GEMM has no kernel (CUDA before sm90 or not in
bf16; fp32 under torch.compile) a padded (experts, max_load, d_model) batched matmul is used instead; it
reads `max_load` on the host (one sync per MoE layer and a dynamic shape — the documented fallback). Under
expert parallelism the all-to-all's split sizes are read on the host (`parallel.expert`), as every
all-to-all-v needs.

Balancing (chosen by `model.moe.balance`):
- aux_loss: Switch/GShard auxiliary loss E · Σ_i f_i · P_i (f_i: share of assignments to expert i,
  P_i: mean router probability of i), Fedus et al. 2021, eq. 4; weighted by `aux_loss_coef`.
- aux_free: DeepSeek-V3's bias (Liu et al. 2024, §2.1.2): a per-expert bias added to the scores for
  *selection only*; after each optimizer step it moves by `bias_update_rate` towards the under-loaded
  experts (b_i += rate · sign(mean_load − load_i)).
Per-expert token counts are kept in a buffer between optimizer steps for the update and for logging.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from leantrain.model.layers import FeedForward

if TYPE_CHECKING:
    from leantrain.model.layers import ModelArgs
    from leantrain.parallel.expert import TokenSplit


class Router(nn.Module):
    """Scores each token against every expert and picks the top k (within its best groups when n_group > 1)."""

    def __init__(
        self, *, d_model: int, num_experts: int, top_k: int, score: str, n_group: int = 1, topk_group: int = 1,
        group_score: str = "top2", scale: float = 1.0, norm_topk_prob: bool | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.top_k, self.score = top_k, score
        self.n_group, self.topk_group, self.group_score, self.scale = n_group, topk_group, group_score, scale
        # Top-1 keeps the raw probability by default so the router still gets a gradient.
        self.norm_topk_prob = top_k > 1 if norm_topk_prob is None else norm_topk_prob

    def forward(
        self, x: torch.Tensor, *, selection_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, d_model) -> probs (tokens, experts) fp32, top indices and weights (tokens, k)."""
        logits = self.gate(x).float()  # (tokens, experts)
        probs = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        selection = probs if selection_bias is None else probs + selection_bias
        if self.n_group > 1:
            selection = self._limit_to_groups(selection)
        top_idx = selection.topk(self.top_k, dim=-1).indices  # (tokens, k)
        top_weights = probs.gather(-1, top_idx)
        if self.norm_topk_prob:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return probs, top_idx, top_weights * self.scale if self.scale != 1.0 else top_weights

    def _limit_to_groups(self, selection: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V2 §2.1.2 device-limited, V3 §2.1.2 node-limited): rank the n_group
        groups of experts by their best score (V2, "max") or their two best (V3, "top2"), keep the topk_group
        best groups and mask the rest out of the selection. All on the device, static shapes."""
        tokens, experts = selection.shape
        grouped = selection.view(tokens, self.n_group, experts // self.n_group)
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
        return grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(tokens, experts)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked weights and run as batched matmuls."""

    def __init__(self, *, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, hidden))

    def forward(self, x_sorted: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted (assignments, d_model) grouped by expert; expert_ids (assignments,) ascending."""
        # Under expert parallelism the weights are DTensors split over experts: compute with this rank's experts.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        dtype = torch.get_autocast_dtype(x_sorted.device.type) if torch.is_autocast_enabled(
            x_sorted.device.type) else x_sorted.dtype
        if grouped_mm_supported(x_sorted.device, dtype):
            offsets = torch.cumsum(counts, 0).to(torch.int32)  # (experts,) end row of each expert's group
            x = x_sorted.to(dtype)
            hidden = F.silu(_grouped(x, w1.to(dtype), offsets)) * _grouped(x, w3.to(dtype), offsets)
            return _grouped(hidden, w2.to(dtype), offsets)  # (assignments, d_model)
        return self._padded(x_sorted, expert_ids, counts, w1=w1, w2=w2, w3=w3)

    @staticmethod
    def _padded(
        x_sorted: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor, *, w1: torch.Tensor,
        w2: torch.Tensor, w3: torch.Tensor,
    ) -> torch.Tensor:
        """The fallback: experts' rows zero-padded to the largest group, three batched matmuls (a host sync)."""
        num_experts = w1.shape[0]
        starts = torch.cumsum(counts, 0) - counts  # first row of each expert's group
        slot = torch.arange(x_sorted.shape[0], device=x_sorted.device) - starts[expert_ids]
        max_load = int(counts.max().item()) if x_sorted.shape[0] else 0
        padded = x_sorted.new_zeros(num_experts, max_load, x_sorted.shape[1])  # (experts, max_load, d_model)
        padded[expert_ids, slot] = x_sorted
        hidden = F.silu(torch.bmm(padded, w1.to(x_sorted.dtype))) * torch.bmm(padded, w3.to(x_sorted.dtype))
        out = torch.bmm(hidden, w2.to(x_sorted.dtype))  # (experts, max_load, d_model)
        return out[expert_ids, slot]


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Does `torch._grouped_mm` have a kernel here? CPU (fp32 eager, or bf16); CUDA sm90+ in bf16.

    torch.compile's shape rules for the op accept bf16 only, so a compiled fp32 model takes the padded path.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return device.type == "cuda" and grouped_mm_on_gpu(_cuda_capability(device), dtype)


def grouped_mm_on_gpu(capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """A GPU of this compute capability (as torch reports it) runs `torch._grouped_mm` in `dtype`: sm90+, bf16.
    `leantrain rehearse` asks this with the spec's accelerator (golive/rehearse_swaps.py `accelerator_kernels`)."""
    return dtype == torch.bfloat16 and capability >= (9, 0)


@functools.lru_cache(maxsize=16)
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward needs one)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


class _SumIntoTokens(torch.autograd.Function):
    """Rows (tokens × k, d) added into their tokens' rows (`index_add_` into zeros of (tokens, d), in the rows'
    dtype); the backward hands each row its token's gradient, so only the index is kept. torch's own `index_add_`
    also saves its whole source, for the source's shape (`expand_as(source)` in its derivative): a (tokens × k,
    d_model) tensor per MoE layer and micro-batch that the backward never reads, 448 MiB at DeepSeek-V3's widths
    (top-8, d 7,168) and 4,096 tokens (`leantrain rehearse` of examples/deepseek-v3.yaml with `selective`
    recompute, 2026-12-07: 19 GiB of rank 128's 141 GiB of activations)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor, tokens: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        return rows.new_zeros((tokens, rows.shape[-1])).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (sorted by expert, group ends at `offsets`) times their expert's weight (experts, in, out)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight, offs=offsets))


class MoE(nn.Module):
    """Router + routed experts (+ shared experts), with load-balancing state."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        moe = args.moe
        assert moe is not None
        d_model = args.shape.d_model
        self.num_experts, self.top_k, self.balance = moe.num_experts, moe.top_k, args.balance
        self.router = Router(d_model=d_model, num_experts=moe.num_experts, top_k=moe.top_k, score=args.router,
                             n_group=args.n_group, topk_group=args.topk_group, group_score=args.group_score,
                             scale=args.routed_scaling_factor, norm_topk_prob=args.norm_topk_prob)
        self.experts = GroupedExperts(num_experts=moe.num_experts, d_model=d_model, hidden=moe.expert_hidden)
        # All shared experts see every token, so they are one SwiGLU of num_shared × expert_hidden.
        self.shared_experts = (
            FeedForward(d_model=d_model, hidden=moe.num_shared_experts * moe.expert_hidden)
            if moe.num_shared_experts
            else None
        )
        # The selection bias is state (checkpointed), not a parameter: no gradient moves it.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        # Assignments per expert since the last balance update (model-level forward adds to it).
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)
        self.last_counts: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        # Under expert × tensor parallelism (`parallel.expert.apply_expert_token_split`): each TP rank sends its
        # share of the tokens to the experts, not all of them. None: this rank's experts see every token.
        self.token_split: TokenSplit | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        flat = x.reshape(batch * seq_len, d_model)  # (tokens, d_model)
        bias = self.expert_bias if self.balance == "aux_free" else None
        probs, top_idx, top_weights = self.router(flat, selection_bias=bias)
        assigned = top_idx.reshape(-1)  # (tokens × k,)
        counts = self._expert_counts(assigned)
        # Kept, not accumulated, here: a recomputed forward (activation checkpointing) would count twice.
        self.last_counts = counts.detach()
        if self.balance == "aux_loss":
            share = counts.float() / assigned.numel()
            mean_prob = (probs / probs.sum(dim=-1, keepdim=True)).mean(dim=0)
            self.last_aux_loss = self.num_experts * (share * mean_prob).sum()
        split = self.token_split
        if split is None:
            out = self._routed(flat, top_idx, top_weights, counts)
        else:  # this TP rank's share of the tokens; the same routing (computed on every token) picks their experts
            local_idx = split.local(top_idx)
            local_counts = self._expert_counts(local_idx.reshape(-1))
            out = split.gather(self._routed(split.local(flat), local_idx, split.local(top_weights), local_counts),
                               tokens=flat.shape[0])
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(batch, seq_len, d_model)

    def _expert_counts(self, assigned: torch.Tensor) -> torch.Tensor:
        """Assignments per expert (int64, one per expert) of a flat list of expert ids."""
        # A scatter-add, not bincount: bincount's output size depends on the data (a graph break under compile).
        return torch.zeros(self.num_experts, dtype=torch.long, device=assigned.device).index_add_(
            0, assigned, torch.ones_like(assigned))

    def _routed(self, flat: torch.Tensor, top_idx: torch.Tensor, top_weights: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted outputs summed per token: (tokens, d_model) for `flat`'s tokens."""
        assigned = top_idx.reshape(-1)
        order = assigned.argsort(stable=True)
        token_idx = order // self.top_k
        out_sorted = self.experts(flat[token_idx], assigned[order], counts)  # (tokens × k, d_model)
        out_sorted = out_sorted * top_weights.reshape(-1)[order].unsqueeze(-1).to(out_sorted.dtype)
        # Under autocast the experts' output is bf16 while `flat` is fp32: accumulate in the experts' dtype.
        return _SumIntoTokens.apply(out_sorted, token_idx, flat.shape[0])

    @torch.no_grad()
    def update_balance(
        self, *, bias_update_rate: float, group: torch.distributed.ProcessGroup | None = None
    ) -> torch.Tensor:
        """End of an optimizer step: sum the counts over the data-parallel ranks, move the aux-free bias, return
        and reset counts.

        `group` is the data-parallel group (`ParallelModel.update_moe_balance` passes it): tensor-parallel peers
        route the same tokens and pipeline stages hold other layers, so a sum over the whole world would count
        tokens twice, or hang when stages differ. None (plain data parallel) sums over the default group.
        """
        counts = self.tokens_per_expert.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=group)
        if self.balance == "aux_free":  # no move before any token was routed; decided on the device (no sync)
            routed = (counts.sum() > 0).to(self.expert_bias.dtype)
            self.expert_bias += bias_update_rate * torch.sign(counts.mean() - counts) * routed
        self.tokens_per_expert.zero_()
        return counts
