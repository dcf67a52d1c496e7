"""Building blocks shared by the dense and mixture-of-experts blocks: the model arguments, RMSNorm, the SwiGLU
MLP, the RoPE tables and the init constants. transformer.py, moe.py and init.py import from here, never from
each other's modules in both directions (transformer → moe, init → layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.model.rope import attention_factor, inv_frequencies
from leantrain.spec.shapes import ModelShape, ResolvedMoE

INIT_STD = 0.02


@dataclass(frozen=True)
class ModelArgs:
    """Everything the model needs: the planner's shape plus RoPE/norm constants and MoE routing."""

    shape: ModelShape
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    router: Literal["softmax", "sigmoid"] = "softmax"
    balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # Hugging Face rope_scaling as sorted pairs
    # Routing refinements (DeepSeek-V2/V3; model.moe's fields of the same names): group-limited selection,
    # the weights' scale, and whether the top-k weights are renormalised (None: when top_k > 1).
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["max", "top2"] = "top2"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool | None = None
    rope_interleave: bool = True  # MLA's RoPE on interleaved pairs (DeepSeek's layout) or rotate-half

    @property
    def moe(self) -> ResolvedMoE | None:
        return self.shape.moe


def rope_tables(
    *, head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None,
    scaling: tuple[tuple[str, Any], ...] | None = None,
) -> torch.Tensor:
    """cos/sin tables for rotate-half RoPE (scaled as a Hugging Face rope_scaling says), (2, max_seq_len, head_dim)."""
    inv_freq = inv_frequencies(head_dim=head_dim, theta=theta, scaling=scaling, device=device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (seq, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim)
    return torch.stack([angles.cos(), angles.sin()]) * attention_factor(scaling)  # YaRN scales cos/sin


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as Llama and Hugging Face do), cast back to the input dtype."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FeedForward(nn.Module):
    """The dense MLP: SwiGLU w2(silu(w1 x) * w3 x) (Llama), or with `mlp` "gelu" w2(gelu(w1 x)) (GPT, MPT,
    Falcon; tanh-free GeLU) or "squared_relu" w2(relu(w1 x)²) (Nemotron-4, Primer). The two-matrix variants have
    no w3 (tensor parallelism's plan for w3 then matches nothing and is skipped)."""

    def __init__(self, *, d_model: int, hidden: int, mlp: str = "swiglu") -> None:
        super().__init__()
        if mlp not in ("swiglu", "gelu", "squared_relu"):
            raise ValueError(f"model.mlp {mlp!r}: use swiglu, gelu or squared_relu")
        self.mlp = mlp
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        if mlp == "swiglu":
            self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp == "gelu":
            return self.w2(F.gelu(self.w1(x)))
        if self.mlp == "squared_relu":
            return self.w2(torch.square(F.relu(self.w1(x))))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
