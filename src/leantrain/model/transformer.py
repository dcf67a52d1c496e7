"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention through SDPA, tied or untied embeddings;
with `model.mla` DeepSeek's multi-head latent attention (`leantrain.model.mla`) takes the attention's place.

The model is built on the meta device and materialised by `init_weights` (see `build_model`), so a
parallelize step can shard it before any memory is allocated; `leantrain.model.init` gives each parameter
values that depend only on the seed and its name, so a sharded model initialises its shards in place.
Layer names follow torchtitan's Llama
(`tok_embeddings`, `layers.N.attention.wq`, `feed_forward.w1` ...); `leantrain.model.hf` maps them to and
from Hugging Face's names. RoPE uses the rotate-half layout, as Hugging Face does, so weights copy over
without permuting q/k.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from leantrain.model.init import init_buffers, init_parameters
from leantrain.model.layers import FeedForward, ModelArgs, RMSNorm, rope_tables  # noqa: F401 (re-exported)
from leantrain.model.mla import LatentAttention
from leantrain.model.moe import MoE
from leantrain.model.rope import rotate_half
from leantrain.spec.hf_config import HFModelConfig, read_hf_config
from leantrain.spec.schema import ModelSpec
from leantrain.spec.shapes import ModelShape, resolve_shape

Recompute = Literal["none", "selective", "op", "full"]


class Attention(nn.Module):
    """Grouped-query causal self-attention; the core is SDPA (flash/efficient kernels where available)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        bias = shape.qkv_bias  # Qwen2 has q/k/v biases
        self.wq = nn.Linear(shape.d_model, shape.n_heads * shape.head_dim, bias=bias)
        self.wk = nn.Linear(shape.d_model, shape.kv_dim, bias=bias)
        self.wv = nn.Linear(shape.d_model, shape.kv_dim, bias=bias)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.d_model, bias=False)
        self.recompute_core = False  # selective recompute: redo only the attention core in backward

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape  # (batch, seq, d_model)
        # Head counts come from the projections' outputs (-1): under tensor parallelism a rank holds n_heads / tp.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # (b, h, s, hd)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = rotate_half(q, rope), rotate_half(k, rope)
        out = checkpoint(_causal_sdpa, q, k, v, use_reentrant=False) if self.recompute_core else _causal_sdpa(q, k, v)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)
        return self.wo(out)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _op_saved_ops() -> frozenset[object]:
    """The ops whose outputs op-level recompute keeps besides every second matmul: the attention kernels (their
    outputs and log-sum-exp are what the backward needs, and redoing them is the dearest part of a block) and
    sequence parallelism's reduce-scatters, as torchtitan's list (SP's all-gathers and plain TP's all-reduces run
    again in the recompute). What exists in this torch build."""
    aten, names = torch.ops.aten, ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _op_policy_context() -> tuple[object, object]:
    """Op-level selective recompute, torchtitan's policy (`torchtitan/distributed/activation_checkpoint.py`, op
    SAC): of a block's matmuls in call order (wq, wk, wv, wo, w1, w3, w2) the 1st, 3rd, 5th and 7th outputs are
    kept and the others recomputed; the attention kernel's outputs and reduce-scatters are kept; norms, RoPE and
    the activation function are recomputed. torch replays the forward's decisions in the recompute (it stores
    them per op and call index); the counts are kept apart by `is_recompute` for a torch that asks the policy
    again. The planner's `recompute: op` counts exactly these (plan/activations.py `op_saved`; `plan.trace`: 1.0002
    of the traced bytes on a tiny model)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {False: 0, True: 0}
    saved = _op_saved_ops()

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op in _MATMULS:
            recompute = bool(getattr(ctx, "is_recompute", False))
            counts[recompute] += 1
            keep = counts[recompute] % 2 == 1
        else:
            keep = op in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is dense or mixture-of-experts."""

    def __init__(self, args: ModelArgs, *, layer_id: int) -> None:
        super().__init__()
        shape = args.shape
        self.attention: nn.Module = Attention(shape) if shape.mla is None else LatentAttention(args)
        self.attention_norm = RMSNorm(shape.d_model, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(shape.d_model, eps=args.norm_eps)
        self.is_moe = shape.moe is not None and layer_id >= shape.moe.first_dense_layers
        if self.is_moe:
            self.feed_forward: nn.Module = MoE(args)
        else:
            self.feed_forward = FeedForward(d_model=shape.d_model, hidden=shape.ffn_hidden, mlp=shape.mlp)
        self.recompute_full = False
        self.recompute_op = False  # op-level selective recompute (`_op_policy_context`)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.recompute_full:
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        if self.recompute_op:
            return checkpoint(self._forward, x, rope, use_reentrant=False, context_fn=_op_policy_context)
        return self._forward(x, rope)

    def _forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. forward(tokens (batch, seq)) -> logits (batch, seq, vocab)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        shape = args.shape
        self.args = args
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.d_model)
        # A ModuleDict keyed by the global layer index keeps names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, layer_id=i) for i in range(shape.n_layers)})
        self.norm = RMSNorm(shape.d_model, eps=args.norm_eps)
        # Tied embeddings reuse tok_embeddings.weight in forward: no second parameter to keep tied.
        self.output = None if shape.tie_embeddings else nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        self.register_buffer("rope", torch.empty(2, args.max_seq_len, shape.rope_dim), persistent=False)
        self._aux_loss: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (batch, seq, d_model)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h)
        self._collect_moe_stats()
        # Calling the output module (not F.linear on its weight) lets tensor parallelism's hooks on it run.
        if self.output is not None:
            return self.output(h)  # (batch, seq, vocab)
        return F.linear(h, self.tok_embeddings.weight)

    def _collect_moe_stats(self) -> None:
        """After the forward (not inside a block, which recompute may rerun): add counts, sum aux losses. Counts
        come from training forwards only: not evaluation, nor a no-grad pass in train mode (LoRA DPO's reference
        pass, the policy with its adapters off), whose tokens would add to the balance statistics."""
        aux_losses = []
        for moe in self.moe_layers():
            if self.training and torch.is_grad_enabled() and moe.last_counts is not None:
                moe.tokens_per_expert += moe.last_counts
            if moe.last_aux_loss is not None:
                aux_losses.append(moe.last_aux_loss)
            moe.last_counts, moe.last_aux_loss = None, None
        self._aux_loss = torch.stack(aux_losses).sum() * self.args.aux_loss_coef if aux_losses else None

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The weighted MoE balance loss of the last forward, to add to the training loss (None when dense)."""
        return self._aux_loss

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter and buffer after `to_empty` (leantrain.model.init: by name, layout-independent)."""
        init_parameters(self, args=self.args, seed=seed)
        init_buffers(self, args=self.args, device=buffer_device or self.tok_embeddings.weight.device)

    def set_recompute(self, mode: Recompute) -> None:
        """Activation checkpointing: none; selective (attention core only); op (every second matmul and the
        attention kernel kept, the rest of each block recomputed: `_op_policy_context`); full (every block)."""
        for layer in self.layers.values():
            layer.recompute_full = mode == "full"
            layer.recompute_op = mode == "op"
            layer.attention.recompute_core = mode == "selective"

    def compile_blocks(self) -> None:
        """torch.compile each block in place (names and state_dict keys stay the same)."""
        for layer in self.layers.values():
            layer.compile()

    def moe_layers(self) -> list[MoE]:
        return [layer.feed_forward for layer in self.layers.values() if layer.is_moe]  # type: ignore[misc]


def model_args_from_spec(model: ModelSpec, *, max_seq_len: int) -> ModelArgs:
    """ModelArgs from the spec's model section, with the planner's resolved shape (one source of truth)."""
    moe = model.moe
    if model.init_from is not None:  # the checkpoint's config.json decides RoPE, the norm epsilon and routing
        return args_from_config(read_hf_config(model.init_from), shape=resolve_shape(model), max_seq_len=max_seq_len)
    return ModelArgs(
        shape=resolve_shape(model),
        rope_theta=model.rope_theta,
        norm_eps=model.norm_eps,
        max_seq_len=max_seq_len,
        router=moe.router if moe else "softmax",
        balance=moe.balance if moe else "none",
        aux_loss_coef=moe.aux_loss_coef if moe else 0.0,
        bias_update_rate=moe.bias_update_rate if moe else 0.0,
        n_group=moe.n_group if moe else 1,
        topk_group=moe.topk_group if moe else 1,
        routed_scaling_factor=moe.routed_scaling_factor if moe else 1.0,
        norm_topk_prob=moe.norm_topk_prob if moe else None,
    )


def args_from_config(config: HFModelConfig, *, shape: ModelShape, max_seq_len: int) -> ModelArgs:
    """ModelArgs for a model loaded from a Hugging Face config.json: its RoPE, epsilon and routing; no balancing
    (a DeepSeek-V3 checkpoint's selection bias is loaded and used, and stays fixed)."""
    experts = config.moe
    routing = {} if experts is None else {
        "router": experts.router, "balance": "aux_free" if experts.selection_bias else "none",
        "n_group": experts.n_group, "topk_group": experts.topk_group, "group_score": experts.group_score,
        "routed_scaling_factor": experts.routed_scaling_factor, "norm_topk_prob": experts.norm_topk_prob,
    }
    return ModelArgs(shape=shape, rope_theta=config.rope_theta, norm_eps=config.norm_eps, max_seq_len=max_seq_len,
                     aux_loss_coef=0.0, bias_update_rate=0.0, rope_scaling=config.rope_scaling,
                     rope_interleave=config.mla.rope_interleave if config.mla else True,
                     **{"balance": "none", **routing})


def build_model(args: ModelArgs, *, device: torch.device, seed: int | None = None) -> Transformer:
    """Build on meta (no memory), materialise on `device`, then initialise from `seed` (0 when not given)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed or 0, buffer_device=device)
    return model


def num_params(model: nn.Module) -> int:
    """Parameters counted once each (tied weights once), to compare with ModelShape.total_params()."""
    return sum(p.numel() for p in model.parameters())
