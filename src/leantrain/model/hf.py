"""Hugging Face interop: export a dense model as a Llama checkpoint (config.json + safetensors) and import one.

The names map one to one (our layer ↔ HF `LlamaForCausalLM`); both use rotate-half RoPE, so q/k weights
copy without permutation. Tied embeddings are written as HF writes them: no `lm_head.weight`, and
`tie_word_embeddings: true`. MoE models have no Llama equivalent and are refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from leantrain.errors import UserInputError
from leantrain.model.transformer import ModelArgs, Transformer, build_model
from leantrain.spec.shapes import ModelShape

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf_name(name: str) -> str:
    match = _OURS_LAYER_RE.match(name)
    if match:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return _TOP_NAMES[name]


def from_hf_name(name: str) -> str:
    match = _HF_LAYER_RE.match(name)
    if match:
        ours = {v: k for k, v in _LAYER_NAMES.items()}
        return f"layers.{match.group(1)}.{ours[match.group(2)]}"
    return {v: k for k, v in _TOP_NAMES.items()}[name]


def hf_config(args: ModelArgs, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A LlamaConfig as JSON; rope_theta is written in both the v4 and the v5 (`rope_parameters`) form."""
    shape = args.shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": shape.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_hf(model: Transformer, out_dir: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and model.safetensors for `LlamaForCausalLM.from_pretrained(out_dir)`."""
    if model.moe_layers():
        raise UserInputError("HF export: mixture-of-experts models have no Llama equivalent; export a dense model")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        to_hf_name(name): tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config = hf_config(model.args, dtype=dtype)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


def _read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(str(hf_dir / shard)))
        return tensors
    if not (hf_dir / WEIGHTS_FILE).is_file():
        raise UserInputError(f"{hf_dir}: no {WEIGHTS_FILE} or {INDEX_FILE} (only safetensors checkpoints load)")
    return load_file(str(hf_dir / WEIGHTS_FILE))


def args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """ModelArgs from a Llama config.json (refuses features our model does not have)."""
    if config.get("model_type") != "llama":
        raise UserInputError(f"HF import: model_type {config.get('model_type')!r} is not 'llama'")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default" or config.get("attention_bias") or config.get("mlp_bias"):
        raise UserInputError("HF import: RoPE scaling and attention/MLP biases are not supported by this model")
    d_model, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", d_model // n_heads) != d_model // n_heads:
        raise UserInputError("HF import: head_dim must equal hidden_size / num_attention_heads")
    shape = ModelShape(
        n_layers=config["num_hidden_layers"], d_model=d_model, n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads), ffn_hidden=config["intermediate_size"],
        vocab_size=config["vocab_size"], tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=None, nominal_params=0.0,
    )
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return ModelArgs(
        shape=shape, rope_theta=float(theta), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(config.get("max_position_embeddings", 4096)), balance="none",
    )


def import_hf(hf_dir: Path, *, device: torch.device | None = None) -> Transformer:
    """Load a Llama safetensors checkpoint into our model (fp32 parameters)."""
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    args = args_from_hf_config(config)
    model = build_model(args, device=device or torch.device("cpu"))
    state = {
        from_hf_name(name): tensor.float()
        for name, tensor in _read_tensors(hf_dir).items()
        if not name.endswith("rotary_emb.inv_freq")  # derived from rope_theta; older exports carry it
    }
    if args.shape.tie_embeddings:
        state.pop("output.weight", None)
    model.load_state_dict(state, strict=True)
    return model
