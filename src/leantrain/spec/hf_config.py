"""Read a Hugging Face `config.json` (Llama, Mistral, Qwen2, DeepSeek-V2/V3) into the fields of our model shape.

Pure JSON, no torch: `spec/shapes.py` calls `read_hf_config` when `model.init_from` is set, so the planner, the
spec checks and the trainer all see the checkpoint's shape. What our model cannot express (sliding-window
attention, dynamic/LongRoPE scaling, MLP biases) is refused with the file and the field named, never silently
approximated; a `head_dim` other than hidden_size / num_attention_heads (Mistral NeMo) is the shape's `head_dim`.
DeepSeek-V2/V3 bring multi-head latent attention (`mla`) and their mixture of experts (`moe`, with the routing
transformers' modeling code applies: V2 softmax scores, greedy or group-limited by the group's best score, no
renormalisation; V3 sigmoid scores with the `e_score_correction_bias` for selection, groups ranked by their two
best scores, `norm_topk_prob`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError

CONFIG_FILE = "config.json"
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
# RoPE variants whose frequencies model/rope.py computes exactly as transformers does.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Fields of ModelSpec that config.json decides; an explicit spec value must agree with it.
SHAPE_FIELDS = {
    "n_layers": "num_hidden_layers", "d_model": "hidden_size", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size", "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
    "head_dim": "head_dim",
}


class HFConfigError(UserInputError, ValueError):
    """config.json is missing, malformed, or describes a model this trainer cannot build."""


@dataclass(frozen=True)
class HFLatentAttention:
    """DeepSeek's multi-head latent attention dimensions (q_lora_rank 0: a full-rank query projection)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE on interleaved pairs (DeepSeek's layout; V3's `rope_interleave`)


@dataclass(frozen=True)
class HFExperts:
    """DeepSeek's mixture of experts and its routing, as transformers computes it."""

    num_experts: int
    top_k: int
    num_shared_experts: int
    expert_hidden: int
    first_dense_layers: int
    router: str  # softmax (V2) | sigmoid (V3)
    selection_bias: bool  # V3: e_score_correction_bias added to the scores for selection only
    n_group: int
    topk_group: int
    group_score: str  # max (V2 group_limited_greedy) | top2 (V3)
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class HFModelConfig:
    """What our model needs from a config.json, plus where it came from (for messages and export)."""

    path: Path
    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, Any], ...] | None  # sorted (key, value) pairs; None for plain RoPE
    sliding_window: int | None
    raw: tuple[tuple[str, Any], ...]  # the JSON as sorted pairs (hashable), for export
    mla: HFLatentAttention | None = None
    moe: HFExperts | None = None
    mtp_layers: int = 0  # DeepSeek-V3's multi-token-prediction layers after the last block (not loaded)
    head_width: int = 0  # config.json's head_dim where it is not hidden_size / num_attention_heads; 0: that ratio

    @property
    def head_dim(self) -> int:
        return self.head_width or self.d_model // self.n_heads

    def value(self, field: str) -> Any:
        return getattr(self, field)


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFConfigError(f"{path}: not found (model.init_from must be a directory with config.json and "
                            "*.safetensors)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFConfigError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _int_field(data: dict[str, Any], key: str, *, path: Path, default: int | None = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HFConfigError(f"{path}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(data: dict[str, Any], *, path: Path) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from either the v4 form (rope_theta + rope_scaling) or v5's rope_parameters."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise HFConfigError(f"{path}: field 'rope_scaling' must be an object or null, got {params!r}")
    theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise HFConfigError(f"{path}: field 'rope_theta' must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise HFConfigError(f"{path}: field 'rope_scaling.rope_type' {rope_type!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings")}
    scaling = {"rope_type": rope_type}
    for key in keys[rope_type]:
        if not isinstance(params.get(key), int | float):
            raise HFConfigError(f"{path}: field 'rope_scaling.{key}' is required for rope_type {rope_type!r}")
        scaling[key] = params[key]
    if rope_type == "yarn":  # optional refinements, kept when given (transformers' defaults otherwise)
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                if isinstance(params[key], bool) or not isinstance(params[key], int | float):
                    raise HFConfigError(f"{path}: field 'rope_scaling.{key}' must be a number, got {params[key]!r}")
                scaling[key] = params[key]
        if params.get("truncate") is not None:
            scaling["truncate"] = bool(params["truncate"])
    return float(theta), tuple(sorted(scaling.items()))


def _architecture(data: dict[str, Any], *, path: Path) -> str:
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(f"{path}: field 'model_type' {model_type!r} is not a supported architecture "
                            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    archs = data.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
    if archs != [SUPPORTED_MODEL_TYPES[model_type]]:
        raise HFConfigError(f"{path}: field 'architectures' {archs!r} is not supported "
                            f"(expected [{SUPPORTED_MODEL_TYPES[model_type]!r}])")
    if data.get("quantization_config"):
        raise HFConfigError(f"{path}: field 'quantization_config' is set (e.g. DeepSeek-V3's fp8 block-scaled "
                            "weights); dequantize the checkpoint to bf16 first")
    if data.get("mlp_bias") or (model_type != "qwen2" and data.get("attention_bias")):
        raise HFConfigError(f"{path}: fields 'attention_bias'/'mlp_bias' are set; only Qwen2's q/k/v biases are "
                            "supported")
    if data.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{path}: field 'hidden_act' {data.get('hidden_act')!r} is not supported (silu only)")
    return model_type


def _sliding_window(data: dict[str, Any], model_type: str) -> int | None:
    if model_type == "qwen2" and not data.get("use_sliding_window", False):
        return None
    window = data.get("sliding_window")
    return int(window) if isinstance(window, int) and not isinstance(window, bool) else None


def _latent_attention(data: dict[str, Any], *, path: Path, n_heads: int) -> HFLatentAttention:
    q_rank = data.get("q_lora_rank")
    if q_rank is not None:
        q_rank = _int_field(data, "q_lora_rank", path=path)
    n_kv = data.get("num_key_value_heads", n_heads)
    if n_kv != n_heads:
        raise HFConfigError(f"{path}: field 'num_key_value_heads' ({n_kv}) must equal num_attention_heads "
                            f"({n_heads}) for multi-head latent attention")
    return HFLatentAttention(
        q_lora_rank=q_rank or 0, kv_lora_rank=_int_field(data, "kv_lora_rank", path=path),
        qk_nope_head_dim=_int_field(data, "qk_nope_head_dim", path=path),
        qk_rope_head_dim=_int_field(data, "qk_rope_head_dim", path=path),
        v_head_dim=_int_field(data, "v_head_dim", path=path),
        rope_interleave=bool(data.get("rope_interleave", True)),
    )


def _deepseek_experts(data: dict[str, Any], *, path: Path, model_type: str, n_layers: int) -> HFExperts | None:
    """The MoE of a DeepSeek config (None when every layer is dense)."""
    first_dense = data.get("first_k_dense_replace", 0)
    if not isinstance(first_dense, int) or first_dense < 0:
        raise HFConfigError(f"{path}: field 'first_k_dense_replace' must be a non-negative integer")
    if data.get("n_routed_experts") is None or first_dense >= n_layers:
        return None
    if data.get("moe_layer_freq", 1) != 1:
        raise HFConfigError(f"{path}: field 'moe_layer_freq' {data.get('moe_layer_freq')!r} is not supported "
                            "(every layer after first_k_dense_replace is MoE, as transformers builds it)")
    experts = _int_field(data, "n_routed_experts", path=path)
    n_group = _int_field(data, "n_group", path=path, default=1)
    topk_group = _int_field(data, "topk_group", path=path, default=1)
    v3 = model_type == "deepseek_v3"
    method = data.get("topk_method", "noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise HFConfigError(f"{path}: field 'topk_method' {method!r} is not supported for {model_type} "
                            f"(supported: {', '.join(allowed)})")
    if method == "greedy":
        n_group = topk_group = 1
    if experts % n_group or topk_group > n_group:
        raise HFConfigError(f"{path}: fields 'n_group' ({n_group}) and 'topk_group' ({topk_group}) must divide "
                            f"n_routed_experts ({experts}) and be ordered")
    scale = data.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or scale <= 0:
        raise HFConfigError(f"{path}: field 'routed_scaling_factor' must be a positive number, got {scale!r}")
    return HFExperts(
        num_experts=experts, top_k=_int_field(data, "num_experts_per_tok", path=path),
        num_shared_experts=int(data.get("n_shared_experts") or 0),
        expert_hidden=_int_field(data, "moe_intermediate_size", path=path), first_dense_layers=first_dense,
        router="sigmoid" if v3 else "softmax", selection_bias=v3, n_group=n_group, topk_group=topk_group,
        group_score="top2" if v3 else "max",
        # transformers' DeepseekV2 never renormalises (its config field is unused); V3 follows the field.
        norm_topk_prob=bool(data.get("norm_topk_prob", True)) if v3 else False,
        routed_scaling_factor=float(scale),
    )


def read_hf_config(model_dir: Path | str) -> HFModelConfig:
    """Parse `model_dir/config.json`; HFConfigError names the file and the field on any problem."""
    path = Path(model_dir) / CONFIG_FILE
    data = _load_json(path)
    model_type = _architecture(data, path=path)
    d_model, n_heads = _int_field(data, "hidden_size", path=path), _int_field(data, "num_attention_heads", path=path)
    if model_type in DEEPSEEK_TYPES:
        return _read_deepseek(data, path=path, model_type=model_type, d_model=d_model, n_heads=n_heads)
    head_dim = data.get("head_dim") or (d_model // n_heads if d_model % n_heads == 0 else None)
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise HFConfigError(f"{path}: field 'head_dim' ({data.get('head_dim')!r}) must be a positive even integer "
                            f"(or absent, when num_attention_heads divides hidden_size: {d_model} / {n_heads})")
    n_kv_heads = _int_field(data, "num_key_value_heads", path=path, default=n_heads)
    if n_heads % n_kv_heads:
        raise HFConfigError(f"{path}: field 'num_key_value_heads' ({n_kv_heads}) must divide num_attention_heads "
                            f"({n_heads})")
    theta, scaling = _rope(data, path=path)
    eps = data.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, int | float) or eps <= 0:
        raise HFConfigError(f"{path}: field 'rms_norm_eps' must be a positive number, got {eps!r}")
    return HFModelConfig(
        path=path, model_type=model_type, n_layers=_int_field(data, "num_hidden_layers", path=path),
        d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_hidden=_int_field(data, "intermediate_size", path=path),
        vocab_size=_int_field(data, "vocab_size", path=path),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)), rope_theta=theta, norm_eps=float(eps),
        qkv_bias=model_type == "qwen2" or bool(data.get("attention_bias", False)),
        max_position_embeddings=_int_field(data, "max_position_embeddings", path=path, default=4096),
        rope_scaling=scaling, sliding_window=_sliding_window(data, model_type),
        raw=tuple(sorted((k, json.dumps(v)) for k, v in data.items())),
        head_width=head_dim if head_dim * n_heads != d_model else 0,
    )


def _read_deepseek(data: dict[str, Any], *, path: Path, model_type: str, d_model: int, n_heads: int) -> HFModelConfig:
    n_layers = _int_field(data, "num_hidden_layers", path=path)
    theta, scaling = _rope(data, path=path)
    eps = data.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, int | float) or eps <= 0:
        raise HFConfigError(f"{path}: field 'rms_norm_eps' must be a positive number, got {eps!r}")
    return HFModelConfig(
        path=path, model_type=model_type, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads,
        ffn_hidden=_int_field(data, "intermediate_size", path=path),
        vocab_size=_int_field(data, "vocab_size", path=path),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)), rope_theta=theta, norm_eps=float(eps),
        qkv_bias=False, max_position_embeddings=_int_field(data, "max_position_embeddings", path=path, default=4096),
        rope_scaling=scaling, sliding_window=None, raw=tuple(sorted((k, json.dumps(v)) for k, v in data.items())),
        mla=_latent_attention(data, path=path, n_heads=n_heads),
        moe=_deepseek_experts(data, path=path, model_type=model_type, n_layers=n_layers),
        mtp_layers=int(data.get("num_nextn_predict_layers") or 0),
    )


def shape_conflicts(config: HFModelConfig, explicit: dict[str, Any]) -> list[str]:
    """`model.<field>` values the spec set explicitly that disagree with config.json, one message each."""
    problems = []
    for field, value in explicit.items():
        if field not in SHAPE_FIELDS or value is None:
            continue
        theirs = config.value(field)
        if (float(value) != float(theirs)) if isinstance(theirs, float) else value != theirs:
            problems.append(f"model.{field} is {value!r} but {config.path} has {SHAPE_FIELDS[field]} = {theirs!r} "
                            "(drop the field, or point model.init_from at a matching checkpoint)")
    return problems
