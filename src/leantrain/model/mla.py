"""Multi-head latent attention (MLA), DeepSeek-V2 §2.1 (arXiv 2405.04434) and DeepSeek-V3 §2.1 (2412.19437).

Queries go through a low-rank latent (`wq_a` → RMSNorm `q_norm` → `wq_b`; or one full-rank `wq` when
`q_lora_rank` is 0). Keys and values share one latent of `kv_lora_rank` made by `wkv_a`, which also emits
a single `qk_rope_head_dim` key that every head shares (the decoupled RoPE key); `kv_norm` → `wkv_b` expands
the latent into each head's non-RoPE key and its value. Each head's query and key are
[nope (qk_nope_head_dim) | rope (qk_rope_head_dim)], its value v_head_dim; the core is SDPA with the
1/√(qk_head_dim) scale, times mscale(factor, mscale_all_dim)² under YaRN, as transformers' DeepseekV2/V3.

Names follow torchtitan's deepseek_v3 model (wq / wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo);
`leantrain.model.hf` maps them to Hugging Face's (q_proj / q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). The latent norms use ε = 1e-6 whatever the model's
norm epsilon, as DeepSeek's reference code and transformers construct them (`RMSNorm(q_lora_rank)`).

RoPE rotates interleaved pairs (x0, x1), (x2, x3), … by one frequency each, DeepSeek's layout (transformers'
`apply_rotary_emb` on complex pairs for V2, `apply_rotary_pos_emb_interleave` for V3); a V3 config with
`rope_interleave: false` uses rotate-half. Under tensor parallelism `wq`/`wq_b` and `wkv_b` are split by
heads (column-wise) and `wo` row-wise, while the latents (`wq_a`, `wkv_a` and their norms) are computed
whole on every rank (torchtitan's plan): head counts below come from the projections' outputs. The latents'
gradients arrive whole through the column-wise inputs' backward all-reduce; the shared RoPE key's goes
through `shared_rope_key`, which the plan turns into an all-reduce of its gradient.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from leantrain.model.layers import ModelArgs, RMSNorm
from leantrain.model.rope import rotate_half, rotate_interleaved, softmax_scale_factor

LATENT_NORM_EPS = 1e-6  # DeepSeek's RMSNorm default, used for q_norm and kv_norm


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; forward(x (batch, seq, d_model), rope tables) -> (batch, seq, d_model)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        shape = args.shape
        mla = shape.mla
        assert mla is not None
        d, heads = shape.d_model, shape.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        self.qk_dim = mla.qk_head_dim
        self.interleaved = args.rope_interleave
        # SDPA's default 1/√(qk_head_dim), times DeepSeek's mscale² under YaRN (as its attention code does).
        self.scale = mla.qk_head_dim ** -0.5 * softmax_scale_factor(args.rope_scaling)
        if mla.q_lora_rank:
            self.wq_a = nn.Linear(d, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(d, heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, d, bias=False)
        # The RoPE key every head shares passes through here: under tensor parallelism a rank's heads give only
        # part of its gradient, and the TP plan makes this identity all-reduce that gradient (Megatron's "f").
        self.shared_rope_key = nn.Identity()
        self.recompute_core = False  # selective recompute: redo only the attention core in backward

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        rotate = rotate_interleaved if self.interleaved else rotate_half
        q = self._query(x).view(batch, seq_len, -1, self.qk_dim).transpose(1, 2)  # (b, h, s, nope + rope)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = self.shared_rope_key(rotate(k_rope.unsqueeze(1), rope))  # (b, 1, s, rope): shared by every head
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq_len, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (b, h, s, nope), (b, h, s, v)
        q = torch.cat([q_nope, rotate(q_rope, rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        core = partial(_causal_sdpa, scale=self.scale)
        out = checkpoint(core, q, k, v, use_reentrant=False) if self.recompute_core else core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
