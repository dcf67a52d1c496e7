"""The model sections of the job spec: shape, mixture-of-experts routing, starting weights, fine-tuning.

`spec/shapes.py` resolves these into a `ModelShape`; `spec/schema.py` assembles them into the `JobSpec`.
Imports run one way: schema → rules → shapes → model_schema → base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from leantrain.spec.base import PositiveInt, Section
from leantrain.spec.hf_config import SHAPE_FIELDS, read_hf_config, shape_conflicts

# LoRA's default targets are every projection of the block's attention and its SwiGLU MLP (w1/w2/w3; routed
# experts are not Linears and get none): peft's `target_modules="all-linear"` less the output head, the set
# the QLoRA paper found needed to match full fine-tuning. Our Llama-style attention (model/transformer.py):
# wq/wk/wv/wo.
DEFAULT_LORA_TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
# Latent attention (model/mla.py) has no wk/wv: the same rule gives its query (wq, or the latent pair wq_a and
# wq_b when q_lora_rank > 0), the joint key/value latent down-projection wkv_a (it also makes the shared RoPE
# key), its up-projection wkv_b and wo — torchtitan's deepseek_v3 names for transformers' q_proj / q_a_proj,
# q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj. The latent norms are not Linears and stay frozen.
MLA_LORA_ATTENTION = ["wkv_a", "wkv_b", "wo"]
MLP_LORA_TARGETS = ["w1", "w2", "w3"]
MIN_SIZE_BILLION = 0.001  # 1M parameters: below that, a sized model is mostly its embedding


class MoESpec(Section):
    """Mixture-of-experts shape and routing (model.architecture: moe)."""

    num_experts: PositiveInt = Field(8, description="Routed experts per MoE layer.")
    top_k: PositiveInt = Field(2, description="Experts each token is routed to.")
    num_shared_experts: int = Field(0, ge=0, description="Always-active shared experts (DeepSeek style).")
    expert_hidden: PositiveInt | None = Field(
        None, description="Hidden size of one expert's SwiGLU MLP; default ffn_hidden / top_k."
    )
    router: Literal["softmax", "sigmoid"] = Field("softmax", description="Router score function.")
    balance: Literal["aux_loss", "aux_free", "none"] = Field(
        "aux_loss", description="Load balancing: Switch/GShard auxiliary loss, or DeepSeek-V3 bias update."
    )
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the auxiliary balance loss.")
    bias_update_rate: float = Field(1e-3, ge=0, description="Step of the aux-free bias update.")
    capacity_factor: float | None = Field(
        None, gt=0, description="Token capacity per expert; None means dropless (no token is dropped)."
    )
    first_dense_layers: int = Field(0, ge=0, description="Leading layers that stay dense (DeepSeek style).")
    n_group: PositiveInt = Field(
        1, description="Expert groups for group-limited routing (DeepSeek-V2 §2.1.2 / V3 §2.1.2, the HF `n_group`): "
        "a token first picks topk_group groups, then its top_k experts inside them; 1: no groups."
    )
    topk_group: PositiveInt = Field(1, description="Groups a token may use (HF `topk_group`; with n_group > 1).")
    routed_scaling_factor: float = Field(
        1.0, gt=0, description="Multiplier on the routed experts' weights (HF `routed_scaling_factor`; "
        "DeepSeek-V3 2.5)."
    )
    norm_topk_prob: bool | None = Field(
        None, description="Renormalise the top-k weights to sum to 1 (HF `norm_topk_prob`); default: yes when "
        "top_k > 1 (top-1 keeps the raw score so the router still learns)."
    )

    @model_validator(mode="after")
    def _groups_divide(self) -> MoESpec:
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be at most n_group ({self.n_group})")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"top_k ({self.top_k}) exceeds the experts in topk_group groups "
                             f"({self.topk_group} × {self.num_experts // self.n_group})")
        return self


class MLASpec(Section):
    """DeepSeek multi-head latent attention (DeepSeek-V2 §2.1), trained and planned; names as DeepSeek's configs.

    Queries and keys/values go through low-rank latents, with a decoupled RoPE part whose key is shared by all
    heads (model/mla.py)."""

    q_lora_rank: int = Field(1536, ge=0, description="Query compression rank (0: a full-rank query projection).")
    kv_lora_rank: PositiveInt = Field(512, description="Joint key/value compression rank.")
    qk_nope_head_dim: PositiveInt = Field(128, description="Per-head query/key dimensions without RoPE.")
    qk_rope_head_dim: PositiveInt = Field(64, description="Per-head query/key dimensions with RoPE (the key's shared).")
    v_head_dim: PositiveInt = Field(128, description="Per-head value dimensions.")


def default_lora_targets(mla: MLASpec | None) -> list[str]:
    """`finetune.lora.targets` when the spec names none: every attention and MLP projection of the model's block."""
    if mla is None:
        return list(DEFAULT_LORA_TARGETS)
    query = ["wq_a", "wq_b"] if mla.q_lora_rank else ["wq"]
    return query + MLA_LORA_ATTENTION + MLP_LORA_TARGETS


class ModelSpec(Section):
    """The model: a nominal size (mapped to a documented Llama-like shape) or an explicit shape."""

    architecture: Literal["dense", "moe"] = Field("dense", description="Dense Llama-style or mixture-of-experts.")
    size_billion: float | None = Field(
        None, gt=0, le=10000, description="Nominal parameter count in billions; shape chosen by spec.shapes."
    )
    n_layers: PositiveInt | None = Field(None, description="Transformer blocks.")
    d_model: PositiveInt | None = Field(None, description="Hidden size.")
    n_heads: PositiveInt | None = Field(None, description="Attention (query) heads.")
    n_kv_heads: PositiveInt | None = Field(None, description="Key/value heads (grouped-query attention).")
    head_dim: PositiveInt | None = Field(
        None, description="Width of one attention head where it is not d_model / n_heads (Qwen3, Mistral NeMo, "
        "Gemma): the query and output projections are then d_model × n_heads·head_dim; default d_model / n_heads."
    )
    ffn_hidden: PositiveInt | None = Field(
        None, description="Hidden size of the dense MLP; default Llama's SwiGLU rule, 4 × d_model for gelu and "
        "squared_relu."
    )
    mlp: Literal["swiglu", "gelu", "squared_relu"] = Field(
        "swiglu", description="Dense MLP: swiglu (three matrices, Llama), gelu (two, GPT/MPT/Falcon) or squared_relu "
        "(two, Nemotron-4); experts and init_from checkpoints are SwiGLU."
    )
    vocab_size: PositiveInt | None = Field(None, description="Vocabulary size (default 128256 for sized models).")
    tie_embeddings: bool = Field(False, description="Share the input embedding and output projection.")
    rope_theta: float = Field(500000.0, gt=0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    moe: MoESpec | None = Field(None, description="Expert settings; required (defaults filled) for moe.")
    mla: MLASpec | None = Field(
        None, description="Multi-head latent attention (DeepSeek-V2/V3) instead of MHA/GQA (n_kv_heads is then "
        "n_heads: every head has its own key and value, made from the shared latent)."
    )
    init_from: Path | None = Field(
        None,
        description="Start from a Hugging Face checkpoint dir (config.json + *.safetensors); the shape is read "
        "from its config.json, and an explicit shape field that disagrees is an error.",
    )

    @field_validator("size_billion")
    @classmethod
    def _at_least_a_million(cls, value: float | None) -> float | None:
        if value is not None and value < MIN_SIZE_BILLION:
            raise ValueError(f"{value:g} is {value * 1e9:,.0f} parameters, below the 1M ({MIN_SIZE_BILLION:g}) that "
                             "sized models start at; give an explicit shape (n_layers, d_model, n_heads, vocab_size) "
                             "for a smaller model")
        return value

    @model_validator(mode="after")
    def _need_size_or_shape(self) -> ModelSpec:
        explicit = [self.n_layers, self.d_model, self.n_heads]
        if self.init_from is None and self.size_billion is None and any(v is None for v in explicit):
            missing = [n for n, v in zip(("n_layers", "d_model", "n_heads"), explicit, strict=True) if v is None]
            raise ValueError(
                f"give size_billion, an explicit shape or init_from; missing {', '.join(missing)}"
            )
        if self.head_dim is not None and self.mla is not None:
            raise ValueError("head_dim is for MHA/GQA; multi-head latent attention sets its widths in model.mla "
                             "(qk_nope_head_dim, qk_rope_head_dim, v_head_dim)")
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of dimensions")
        if self.architecture == "moe" and self.moe is None:
            self.moe = MoESpec()
        if self.architecture == "dense" and self.moe is not None:
            raise ValueError("moe settings given but architecture is 'dense' (set architecture: moe)")
        if self.mlp != "swiglu" and (self.architecture == "moe" or self.init_from is not None):
            what = "mixture-of-experts experts are" if self.architecture == "moe" else "init_from checkpoints are"
            raise ValueError(f"mlp: {self.mlp} is for dense models built from scratch; {what} SwiGLU (mlp: swiglu)")
        return self

    @model_validator(mode="after")
    def _shape_from_checkpoint(self) -> ModelSpec:
        """With init_from, the shape fields take config.json's values (so a dumped spec says what runs); an
        explicit field that disagrees is an error naming it and the file."""
        if self.init_from is None:
            return self
        config = read_hf_config(self.init_from)
        problems = shape_conflicts(config, {name: getattr(self, name) for name in self.model_fields_set})
        if problems:
            raise ValueError("; ".join(problems))
        architecture = "moe" if config.moe is not None else "dense"
        if "architecture" in self.model_fields_set and self.architecture != architecture:
            raise ValueError(f"model.architecture is {self.architecture!r} but {config.path} describes a "
                             f"{architecture} model (drop the field)")
        self.__dict__["architecture"] = architecture
        for name in SHAPE_FIELDS:
            self.__dict__[name] = config.value(name)  # no re-validation, and not marked as set by the user
        self.__dict__["head_dim"] = config.head_width or None  # only where it is not d_model / n_heads
        if config.mla is not None:
            m = config.mla
            self.__dict__["mla"] = MLASpec(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                                           qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                                           v_head_dim=m.v_head_dim)
        if config.moe is not None:
            e = config.moe
            self.__dict__["moe"] = MoESpec(
                num_experts=e.num_experts, top_k=e.top_k, num_shared_experts=e.num_shared_experts,
                expert_hidden=e.expert_hidden, first_dense_layers=e.first_dense_layers, router=e.router,
                balance="aux_free" if e.selection_bias else "none", aux_loss_coef=0.0, bias_update_rate=0.0,
                n_group=e.n_group, topk_group=e.topk_group, routed_scaling_factor=e.routed_scaling_factor,
                norm_topk_prob=e.norm_topk_prob)
        return self


class LoraSpec(Section):
    """Low-rank adapters (LoRA): W + (alpha / rank) · B·A on each target Linear, the base frozen."""

    rank: PositiveInt = Field(16, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is multiplied by alpha / rank.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    targets: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Names of the Linear layers that get adapters; by default every attention and MLP projection "
        "(with model.mla: wq, or wq_a and wq_b, then wkv_a, wkv_b, wo, w1, w2, w3).",
    )


class DpoSpec(Section):
    """Direct preference optimisation (finetune.method: dpo, Rafailov et al. 2023) on `format: preference` data."""

    weights: Literal["lora", "qlora", "full"] = Field(
        "lora", description="Which weights DPO trains: lora/qlora adapters (the frozen base, adapters off, is the "
        "reference model: no extra memory) or full (a frozen copy of the init_from weights is the reference).",
    )
    beta: float = Field(0.1, gt=0, description="beta: the strength of the pull towards the reference model.")
    loss: Literal["sigmoid", "ipo", "orpo"] = Field(
        "sigmoid", description="sigmoid: DPO's -log σ(β·Δ); ipo: (Δ/|y| − 1/(2β))², Δ per response token (TRL's); "
        "orpo: chosen NLL − β·log σ(log odds ratio), no reference model (TRL's ORPOTrainer).",
    )


class FinetuneSpec(Section):
    """Fine-tuning (task: finetune): which weights train and how the frozen base is held."""

    method: Literal["full", "lora", "qlora", "dpo"] = Field(
        "full", description="full: every weight trains; lora: adapters on a frozen base; qlora: base in 4-bit NF4; "
        "dpo: preference tuning on format: preference data (finetune.dpo says which weights).",
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="Adapter settings (lora and qlora).")
    dpo: DpoSpec = Field(default_factory=DpoSpec, description="Preference tuning settings (method: dpo).")

    @property
    def weights(self) -> str:
        """Which weights train: full, lora or qlora (the method, or finetune.dpo.weights under dpo)."""
        return self.dpo.weights if self.method == "dpo" else self.method
