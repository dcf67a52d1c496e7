"""Hugging Face interop: names, config.json, and writing/reading a dense model as a HF checkpoint directory.

The names map one to one (our layer ↔ HF `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
which share them; Qwen2 adds q/k/v biases); both use rotate-half RoPE, so q/k weights copy without
permutation. Tied embeddings are written as HF writes them: no `lm_head.weight`, and
`tie_word_embeddings: true`. MoE models have no Llama equivalent and are refused. Large models are written
in `model-0000i-of-0000n.safetensors` shards with an index, one shard in memory at a time
(`write_hf_shards`); `leantrain.model.hf_load` reads them back slice by slice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from leantrain.errors import UserInputError
from leantrain.model.transformer import ModelArgs, Transformer
from leantrain.spec.hf_config import SUPPORTED_MODEL_TYPES, read_hf_config
from leantrain.spec.model_schema import ModelSpec
from leantrain.spec.shapes import resolve_shape

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
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


def hf_config(
    args: ModelArgs, *, dtype: torch.dtype = torch.float32, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A config.json for our model: `base` (the init_from checkpoint's config, keeping its architecture and
    extra fields) updated with our shape, else a LlamaConfig. rope_theta is written in the v4 and v5 forms."""
    shape = args.shape
    model_type = (base or {}).get("model_type", "qwen2" if shape.qkv_bias else "llama")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope = {**dict(args.rope_scaling), "rope_theta": args.rope_theta}
    config = dict(base or {})
    config.update({
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": max(args.max_seq_len, int(config.get("max_position_embeddings", 0))),
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if args.rope_scaling is None else dict(args.rope_scaling),
        "rope_parameters": rope,
        "tie_word_embeddings": shape.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    if model_type != "qwen2":
        config.update({"attention_bias": False, "mlp_bias": False})
    return config


def plan_shards(sizes: dict[str, int], *, max_shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Our tensor names grouped into files of at most `max_shard_bytes` (a bigger tensor gets a file alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_shards(
    out_dir: Path, *, shards: list[list[str]], load: Callable[[list[str]], dict[str, torch.Tensor]],
    config: dict[str, Any],
) -> Path:
    """Write config.json and the safetensors files, calling `load(names)` for one shard's tensors at a time."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, names in enumerate(shards):
        file = WEIGHTS_FILE if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {to_hf_name(name): tensor.contiguous() for name, tensor in load(names).items()}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n", encoding="utf-8")
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


def export_hf(
    model: Transformer, out_dir: Path, *, dtype: torch.dtype = torch.float32, base: dict[str, Any] | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write config.json and safetensors for `AutoModelForCausalLM.from_pretrained(out_dir)` from a model in memory
    (`tensors` overrides its state dict, e.g. with LoRA merged)."""
    if model.moe_layers():
        raise UserInputError("HF export: mixture-of-experts models have no Llama equivalent; export a dense model")
    if model.args.shape.mlp != "swiglu":
        raise UserInputError(f"HF export: model.mlp {model.args.shape.mlp} has no Llama equivalent (SwiGLU); "
                             "export a SwiGLU model")
    state = {name: t.detach().to("cpu", dtype) for name, t in (tensors or model.state_dict().items())}
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    return write_hf_shards(out_dir, shards=plan_shards(sizes), load=lambda names: {n: state[n] for n in names},
                           config=hf_config(model.args, dtype=dtype, base=base))


def args_from_hf_config(hf_dir: Path, *, max_seq_len: int | None = None) -> ModelArgs:
    """ModelArgs from a Llama/Mistral/Qwen2 config.json (refuses features our model does not have)."""
    config = read_hf_config(hf_dir)
    shape = resolve_shape(ModelSpec(init_from=Path(hf_dir)))
    return ModelArgs(
        shape=shape, rope_theta=config.rope_theta, norm_eps=config.norm_eps,
        max_seq_len=max_seq_len or config.max_position_embeddings, balance="none", aux_loss_coef=0.0,
        bias_update_rate=0.0, rope_scaling=config.rope_scaling,
    )
