"""Model shapes: `size_billion` → a documented Llama-like shape, and exact parameter counts.

The rule for a nominal size (used when the spec gives `size_billion` without an explicit shape):
- head dimension 128, so n_heads = d_model / 128; n_kv_heads = gcd(n_heads, 8) (grouped-query
  attention with 8 KV heads, as Llama 3, when the head count allows);
- SwiGLU hidden = 1.3 × 8/3 × d_model rounded up to a multiple of 1024 (Llama 3's rule; 14336 at d=4096);
- vocabulary 128,256 (Llama 3) unless the spec gives one; untied embeddings unless the spec ties them;
- depth and width are searched together: d_model about 128 × n_layers, a multiple of 1024 from
  d_model 4096 up (so n_heads is a multiple of 8 and any tp ≤ 8 divides it) and of 256 below,
  (Llama 3 8B: 4096 = 128 × 32), choosing the pair whose *total* parameter count is closest to the target.
This reproduces Llama 3 8B exactly for size_billion: 8.03. For MoE the same search counts all experts
(total parameters), with experts of hidden size ffn_hidden / top_k unless `moe.expert_hidden` is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from leantrain.spec.hf_config import SHAPE_FIELDS, HFConfigError, read_hf_config, shape_conflicts
from leantrain.spec.model_schema import MLASpec, ModelSpec, MoESpec

HEAD_DIM = 128
DEFAULT_VOCAB = 128256
DEFAULT_KV_HEADS = 8
FFN_MULTIPLIER = 1.3
FFN_MULTIPLE_OF = 1024
ASPECT = 128  # d_model per layer
WIDE_FROM = 4096  # from this width up, d_model is a multiple of WIDE_STEP
WIDE_STEP = 1024  # n_heads a multiple of 8, so any tp ≤ 8 divides the heads
NARROW_STEP = 256


@dataclass(frozen=True)
class ResolvedMoE:
    num_experts: int
    top_k: int
    num_shared_experts: int
    expert_hidden: int
    first_dense_layers: int


@dataclass(frozen=True)
class ResolvedMLA:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelShape:
    """A fully explicit model shape with its parameter counts."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tie_embeddings: bool
    moe: ResolvedMoE | None
    nominal_params: float  # size_billion × 1e9 when given, else the exact total
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    mla: ResolvedMLA | None = None  # DeepSeek's multi-head latent attention (model/mla.py)
    mlp: str = "swiglu"  # dense MLP: swiglu (w1, w2, w3) | gelu | squared_relu (w1, w2)
    attn_head_dim: int = 0  # width of one head where it is not d_model / n_heads (model.head_dim); 0: d / n

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output and the output projection's input (MHA/GQA)."""
        return self.n_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: the head for MHA/GQA, MLA's decoupled qk_rope_head_dim."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.n_layers - self.moe.first_dense_layers

    @property
    def num_dense_layers(self) -> int:
        return self.n_layers - self.num_moe_layers

    @property
    def attention_widths(self) -> tuple[int, int, int]:
        """Widths of the per-token q, k and v tensors attention works on (all heads): d, kv, kv for MHA/GQA;
        heads × (nope + rope), heads × (nope + rope), heads × v_head_dim for MLA."""
        if self.mla is None:
            return self.q_dim, self.kv_dim, self.kv_dim
        qk, v = self.attention_core_widths
        return qk, qk, v

    @property
    def attention_core_widths(self) -> tuple[int, int]:
        """(QKᵀ width, A·V width) over all query heads: n_heads × head_dim twice for MHA/GQA (each query head
        works with its group's key and value); n_heads × (nope + rope) and n_heads × v_head_dim for MLA."""
        if self.mla is None:
            return self.n_heads * self.head_dim, self.n_heads * self.head_dim
        return self.n_heads * self.mla.qk_head_dim, self.n_heads * self.mla.v_head_dim

    def attention_params(self) -> int:
        """q, k, v, o projections of one layer (with q/k/v biases where the shape has them). MLA: the query
        down/up projections (or a full-rank one), the joint KV down projection with the shared RoPE key, the
        K/V up projections, their two norms and the output projection (DeepSeek-V2 §2.1)."""
        d = self.d_model
        if self.mla is not None:
            m, heads = self.mla, self.n_heads
            q = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim if m.q_lora_rank \
                else d * heads * m.qk_head_dim
            kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
                + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + heads * m.v_head_dim * d
        biases = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return 2 * d * self.q_dim + 2 * d * self.kv_dim + biases

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the dense MLP: SwiGLU's gate, up and down; GeLU's and squared ReLU's up and down."""
        return 3 if self.mlp == "swiglu" else 2

    def dense_mlp_params(self) -> int:
        return self.mlp_matrices * self.d_model * self.ffn_hidden

    def block_linears(self, *, moe_layer: bool) -> list[tuple[int, int, str | None]]:
        """One block's Linear weights as (out_features, in_features, how tensor parallelism splits them: "col" by
        rows, "row" by columns, None not at all), as the model builds them (model/transformer.py, mla.py,
        layers.py, moe.py): the attention projections and the MLP, a dense one or an MoE layer's shared experts
        (one SwiGLU of num_shared × expert_hidden); not the router's gate nor the routed experts (no Linears)."""
        d = self.d_model
        if self.mla is not None:
            m, heads = self.mla, self.n_heads
            q = [(m.q_lora_rank, d, None), (heads * m.qk_head_dim, m.q_lora_rank, "col")] if m.q_lora_rank \
                else [(heads * m.qk_head_dim, d, "col")]
            attention = [*q, (m.kv_lora_rank + m.qk_rope_head_dim, d, None),
                         (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "col"),
                         (d, heads * m.v_head_dim, "row")]
        else:
            attention = [(self.q_dim, d, "col"), (self.kv_dim, d, "col"), (self.kv_dim, d, "col"),
                         (d, self.q_dim, "row")]
        if moe_layer and self.moe is not None:
            hidden, gates = self.moe.num_shared_experts * self.moe.expert_hidden, 2
        else:
            hidden, gates = self.ffn_hidden, self.mlp_matrices - 1
        mlp = [(hidden, d, "col")] * gates + [(d, hidden, "row")] if hidden else []
        return attention + mlp

    def moe_layer_params(self, *, active: bool) -> int:
        """One MoE layer's router + experts (all, or the top-k + shared a token uses)."""
        assert self.moe is not None
        m = self.moe
        per_expert = 3 * self.d_model * m.expert_hidden
        routed = m.top_k if active else m.num_experts
        return self.d_model * m.num_experts + (routed + m.num_shared_experts) * per_expert

    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

    def layer_params(self, *, moe_layer: bool, active: bool = False) -> int:
        norms = 2 * self.d_model
        mlp = self.moe_layer_params(active=active) if moe_layer else self.dense_mlp_params()
        return self.attention_params() + mlp + norms

    def non_embedding_params(self, *, active: bool = False) -> int:
        dense = self.num_dense_layers * self.layer_params(moe_layer=False)
        moe = self.num_moe_layers * self.layer_params(moe_layer=True, active=active) if self.moe else 0
        return dense + moe + self.d_model  # + final norm

    def total_params(self) -> int:
        return self.non_embedding_params() + self.embedding_params()

    def active_params(self) -> int:
        """Parameters one token touches: top-k routed and shared experts, not all experts."""
        return self.non_embedding_params(active=True) + self.embedding_params()


def chunk_layers(n_layers: int, chunks: int) -> list[int]:
    """Layers per pipeline chunk (chunk i runs on pipeline rank i mod pp), the one split the trainer runs, the
    rehearsal extends and the planner prices. When the chunks do not divide the layers, the missing layers come
    off the first and the last chunk first (they also hold the embedding and the loss), then off their
    neighbours, alternating: Llama 3 took one layer each off its first and last stage (the Llama 3 Herd of
    Models report, arXiv 2407.21783, §3.3.2), and torchtitan's stage split counts the embedding and the output
    as a layer each for the same reason."""
    if chunks > n_layers:
        raise ValueError(f"{chunks} pipeline chunks for {n_layers} layers")
    base = math.ceil(n_layers / chunks)
    layers = [base] * chunks
    order = [i for pair in zip(range(chunks), reversed(range(chunks)), strict=True) for i in pair]
    for i in range(base * chunks - n_layers):
        layers[order[i]] -= 1
    return layers


def stage_layer_counts(n_layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Layers per pipeline rank: the sum of its chunks (`chunk_layers` over pp × virtual_stages chunks)."""
    chunks = chunk_layers(n_layers, pp * virtual_stages)
    return [sum(chunks[stage::pp]) for stage in range(pp)]


def llama_ffn_hidden(d_model: int) -> int:
    raw = int(FFN_MULTIPLIER * int(8 * d_model / 3))
    return FFN_MULTIPLE_OF * math.ceil(raw / FFN_MULTIPLE_OF)


def _kv_heads_for(n_heads: int) -> int:
    return math.gcd(n_heads, DEFAULT_KV_HEADS)


def _resolve_moe(moe: MoESpec | None, *, ffn_hidden: int) -> ResolvedMoE | None:
    if moe is None:
        return None
    hidden = moe.expert_hidden or max(1, ffn_hidden // moe.top_k)
    return ResolvedMoE(moe.num_experts, moe.top_k, moe.num_shared_experts, hidden, moe.first_dense_layers)


def _resolve_mla(mla: MLASpec | None) -> ResolvedMLA | None:
    if mla is None:
        return None
    return ResolvedMLA(mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)


def _shape_from(model: ModelSpec, *, n_layers: int, d_model: int, nominal: float | None) -> ModelShape:
    n_heads = model.n_heads or max(1, d_model // HEAD_DIM)
    ffn = model.ffn_hidden or (llama_ffn_hidden(d_model) if model.mlp == "swiglu" else 4 * d_model)
    shape = ModelShape(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=model.n_kv_heads or _kv_heads_for(n_heads),
        ffn_hidden=ffn,
        vocab_size=model.vocab_size or DEFAULT_VOCAB,
        tie_embeddings=model.tie_embeddings,
        moe=_resolve_moe(model.moe, ffn_hidden=ffn),
        nominal_params=0.0,
        mla=_resolve_mla(model.mla),
        mlp=model.mlp,
        attn_head_dim=model.head_dim if model.head_dim and model.head_dim * n_heads != d_model else 0,
    )
    total = float(shape.total_params())
    return _with_nominal(shape, nominal if nominal is not None else total)


def _with_nominal(shape: ModelShape, nominal: float) -> ModelShape:
    return ModelShape(**{**shape.__dict__, "nominal_params": nominal})


def _search_shape(model: ModelSpec, target: float) -> ModelShape:
    best: tuple[float, ModelShape] | None = None
    # Non-embedding params ≈ 12.7·d²·L at d = 128·L: start the depth search around that estimate.
    guess = max(1, round((target / (12.7 * ASPECT**2)) ** (1 / 3)))
    depths = [model.n_layers] if model.n_layers else range(max(1, guess // 3), 2 * guess + 3)
    for n_layers in depths:
        centre = ASPECT * n_layers
        low = max(NARROW_STEP, centre // 2 // NARROW_STEP * NARROW_STEP)
        widths = [model.d_model] if model.d_model else [
            d for d in range(low, 2 * centre + 1, NARROW_STEP) if d < WIDE_FROM or d % WIDE_STEP == 0
        ]
        for d_model in widths:
            shape = _shape_from(model, n_layers=n_layers, d_model=d_model, nominal=target)
            misfit = abs(math.log(shape.total_params() / target))
            misfit += 0.02 * abs(math.log(d_model / centre))  # prefer the Llama aspect ratio on ties
            if best is None or misfit < best[0]:
                best = (misfit, shape)
    assert best is not None
    return best[1]


def resolve_shape(model: ModelSpec) -> ModelShape:
    """The explicit shape for a model spec (explicit fields win over the size rule; with `init_from` the
    checkpoint's config.json decides, and an explicit field that disagrees is an error)."""
    if model.init_from is not None:
        explicit = {name: getattr(model, name) for name in model.model_fields_set if name in SHAPE_FIELDS}
        config_path = Path(model.init_from) / "config.json"
        stamp = config_path.stat().st_mtime_ns if config_path.is_file() else 0
        return _resolve_hf(str(model.init_from), json.dumps(explicit, sort_keys=True), model.architecture, stamp)
    return _resolve_cached(model.model_dump_json())


@lru_cache(maxsize=64)
def _resolve_hf(init_from: str, explicit_json: str, architecture: str, _stamp: int) -> ModelShape:
    config = read_hf_config(init_from)
    if architecture != ("moe" if config.moe else "dense"):
        raise HFConfigError(f"model.architecture is {architecture!r}, but {config.path} describes a "
                            f"{'mixture-of-experts' if config.moe else 'dense'} model (drop the field)")
    problems = shape_conflicts(config, json.loads(explicit_json))
    if problems:
        raise HFConfigError("; ".join(problems))
    m, e = config.mla, config.moe
    shape = ModelShape(
        n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
        ffn_hidden=config.ffn_hidden, vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings,
        moe=None if e is None else ResolvedMoE(e.num_experts, e.top_k, e.num_shared_experts, e.expert_hidden,
                                               e.first_dense_layers),
        nominal_params=0.0, qkv_bias=config.qkv_bias, attn_head_dim=config.head_width,
        mla=None if m is None else ResolvedMLA(m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
                                               m.qk_rope_head_dim, m.v_head_dim),
    )
    return _with_nominal(shape, float(shape.total_params()))


@lru_cache(maxsize=256)
def _resolve_cached(model_json: str) -> ModelShape:
    model = ModelSpec.model_validate_json(model_json)
    explicit = model.n_layers is not None and model.d_model is not None
    if explicit:
        nominal = float(round(model.size_billion * 1e9)) if model.size_billion else None
        return _shape_from(model, n_layers=model.n_layers, d_model=model.d_model, nominal=nominal)  # type: ignore[arg-type]
    assert model.size_billion is not None
    return _search_shape(model, float(round(model.size_billion * 1e9)))
