"""FLOPs per training token: the one function the planner and the trainer's MFU metric both use.

Conventions (documented in docs/plan.md):
- A multiply-add is 2 FLOPs; training is forward + backward = 3 × forward.
- Matmul term: 6 × the parameters a token multiplies by: every non-embedding weight it touches
  (for MoE, top-k routed + shared experts + router, not all experts) plus the output projection
  (vocab × d_model, counted even when tied). The input embedding is a lookup, not a matmul.
  GQA shows up through the smaller k/v projections; SwiGLU through its three matrices.
- Attention term: 12 × n_layers × (n_heads × head_dim) × seq_len per token (QKᵀ and A·V, forward
  2 × 2 × seq × d_attn, ×3 for training), as in PaLM's MFU definition (Chowdhery et al. 2022, App. B) and
  torchtitan. With `causal_halving` only the unmasked half is counted (6 × L × d_attn × seq), the
  convention of FlashAttention's benchmarks and Megatron-LM's `num_floating_point_operations`.
- Hardware FLOPs add recompute: full recompute repeats the whole forward (+ matmul/3 + attention/3);
  selective recompute (Korthikanti et al. 2022) repeats only the attention core (+ attention/3); torchtitan's
  selective-op policy repeats the matmuls whose outputs it drops (wk, wo, w3 of each dense layer).
- The rule-of-thumb estimate C ≈ 6·N·D (N parameters, D tokens) uses the nominal parameter count:
  `seed_total_flops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from leantrain.spec.shapes import ModelShape

Recompute = Literal["none", "selective", "op", "full"]


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs for one token, split into the matmul and attention-score parts."""

    matmul: float
    attention: float
    op_recompute: float = 0.0  # forward FLOPs torchtitan's selective-op policy repeats (wk, wo, w3 per layer)
    head_forward: float = 0.0  # the output projection's forward, outside every block's checkpoint
    down_forward: float = 0.0  # the blocks' last matmul, forward: dense down projections, MoE shared experts'

    @property
    def model(self) -> float:
        """Model FLOPs per token (what MFU counts)."""
        return self.matmul + self.attention

    def hardware(self, recompute: Recompute, *, early_stop: bool = False) -> float:
        """FLOPs the hardware executes per token, including recomputation. Full recompute repeats the blocks'
        forward, not the output projection's (no stack checkpoints it; Megatron's count, Narayanan et al. 2021
        eq. 3, gives its V term three passes). `early_stop`: torch's non-reentrant checkpoint ends the recompute
        once the tensors the backward needs are rebuilt, which is before a block's last matmul runs (its input
        is saved as the matmul starts; its output feeds only an add, which saves nothing): a dense block's down
        projection, an MoE block's shared experts' (`down_forward`)."""
        if recompute == "full":
            repeat = self.model / 3 - self.head_forward - (self.down_forward if early_stop else 0.0)
            return self.model + repeat
        if recompute == "selective":
            return self.model + self.attention / 3
        if recompute == "op":
            return self.model + self.op_recompute
        return self.model

    def hardware_attention(self, recompute: Recompute) -> float:
        """The attention-core part of `hardware`: full and selective recompute repeat its forward."""
        return self.attention * (4 / 3 if recompute in ("full", "selective") else 1.0)


def matmul_params(shape: ModelShape) -> int:
    """Weights one token is multiplied by: active non-embedding weights + the output projection."""
    norms = 2 * shape.d_model * shape.n_layers + shape.d_model
    return shape.non_embedding_params(active=True) - norms + shape.vocab_size * shape.d_model


def flops_per_token(shape: ModelShape, *, seq_len: int, causal_halving: bool = False) -> FlopsPerToken:
    """Training FLOPs per token for a model shape at a sequence length."""
    qk, av = shape.attention_core_widths  # QKᵀ and A·V widths (MLA: they differ)
    attention_dim = (qk + av) / 2
    attention = 12.0 * shape.n_layers * attention_dim * seq_len
    if causal_halving:
        attention /= 2
    d = shape.d_model
    op_recompute = 2.0 * shape.n_layers * (d * shape.kv_dim + shape.q_dim * d)
    op_recompute += 2.0 * shape.num_dense_layers * d * shape.ffn_hidden
    # the block's last matmul, which an early-stopping recompute skips: a dense block's down projection, and in an
    # MoE block the shared experts' (model/moe.py adds them after the routed experts, whose weighted combine
    # saves their output, so the routed down projection does run again)
    down = shape.num_dense_layers * d * shape.ffn_hidden
    if shape.moe is not None:
        down += shape.num_moe_layers * d * shape.moe.num_shared_experts * shape.moe.expert_hidden
    return FlopsPerToken(matmul=6.0 * matmul_params(shape), attention=attention, op_recompute=op_recompute,
                         head_forward=2.0 * shape.vocab_size * d, down_forward=2.0 * down)


def seed_total_flops(*, nominal_params: float, tokens: float) -> float:
    """The rule-of-thumb training compute C ≈ 6·N·D (N nominal parameters, D tokens)."""
    return 6.0 * nominal_params * tokens
