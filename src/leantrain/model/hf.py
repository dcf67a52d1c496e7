"""Hugging Face interop: names, config.json, and writing/reading a dense model as a HF checkpoint directory.

The names map one to one (our layer ↔ HF `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
which share them; Qwen2 adds q/k/v biases); both use rotate-half RoPE, so q/k weights copy without
permutation. Tied embeddings are written as HF writes them: no `lm_head.weight`, and
`tie_word_embeddings: true`. Models with `model.mla` are DeepSeek-V2 (softmax routing) or DeepSeek-V3
(sigmoid) checkpoints: the latent attention maps one to one, and our stacked routed experts (experts, in,
out) to one `mlp.experts.N.{gate,up,down}_proj.weight` (out, in) per expert, as DeepSeek's files hold them.
Other MoE models have no Hugging Face equivalent and are refused. Large models are written
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
from leantrain.model.transformer import ModelArgs, Transformer, args_from_config
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
    # DeepSeek-V2/V3: multi-head latent attention and the MoE's router, selection bias and shared experts.
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# Our stacked routed experts (experts, in, out) ↔ one HF Linear weight (out, in) per expert.
_EXPERT_NAMES = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
                 "feed_forward.experts.w2": "down_proj"}
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
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


def hf_layer(name: str) -> int | None:
    """The layer index of a HF tensor name (`model.layers.N....`), None outside the layers."""
    match = _HF_LAYER_RE.match(name)
    return int(match.group(1)) if match else None


def is_expert_stack(name: str) -> bool:
    """Is our parameter `name` a stack of routed experts (one HF tensor per expert)?"""
    match = _OURS_LAYER_RE.match(name)
    return bool(match) and match.group(2) in _EXPERT_NAMES


def expert_hf_name(name: str, expert: int) -> str:
    """The HF name of expert `expert`'s slice of our stacked expert weight `name`."""
    match = _OURS_LAYER_RE.match(name)
    assert match and match.group(2) in _EXPERT_NAMES, name
    return f"model.layers.{match.group(1)}.mlp.experts.{expert}.{_EXPERT_NAMES[match.group(2)]}.weight"


def from_hf_expert_name(name: str) -> tuple[str, int] | None:
    """(our stacked name, expert index) for a per-expert HF weight, None for any other name."""
    match = _HF_EXPERT_RE.match(name)
    if match is None:
        return None
    ours = {v: k for k, v in _EXPERT_NAMES.items()}[match.group(3)]
    return f"layers.{match.group(1)}.{ours}", int(match.group(2))


def hf_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our tensor as the HF tensor(s) it is: itself under its HF name, or a stack split into per-expert (out, in)."""
    if not is_expert_stack(name):
        return {to_hf_name(name): tensor}
    return {expert_hf_name(name, e): tensor[e].t() for e in range(tensor.shape[0])}


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
    if shape.mla is not None:
        return _deepseek_config(args, dtype=dtype, base=base)
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


def _deepseek_config(args: ModelArgs, *, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
    """A DeepseekV2/V3 config.json for an MLA model; V3 for sigmoid routing, V2 for softmax. Routing that the
    chosen transformers model would compute differently is refused rather than written."""
    shape, mla, moe = args.shape, args.shape.mla, args.shape.moe
    assert mla is not None
    model_type = (base or {}).get("model_type", "deepseek_v3" if args.router == "sigmoid" else "deepseek_v2")
    norm_topk = args.norm_topk_prob if args.norm_topk_prob is not None else bool(moe and moe.top_k > 1)
    if moe is not None and model_type == "deepseek_v2" and (norm_topk or args.balance == "aux_free"
                                                           or args.router != "softmax"):
        raise UserInputError("HF export: DeepSeek-V2 (softmax routing) neither renormalises the top-k weights nor "
                             "has a selection bias; set model.moe.norm_topk_prob: false and balance: aux_loss|none, "
                             "or use router: sigmoid (exported as DeepSeek-V3)")
    if moe is not None and model_type == "deepseek_v3" and args.router != "sigmoid":
        raise UserInputError("HF export: DeepSeek-V3 routes with sigmoid scores; model.moe.router is softmax")
    config = dict(base or {})
    config.update({
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]], "model_type": model_type,
        "vocab_size": shape.vocab_size, "hidden_size": shape.d_model, "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layers, "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_heads, "q_lora_rank": mla.q_lora_rank or None,
        "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "head_dim": mla.qk_rope_head_dim,
        "qk_head_dim": mla.qk_head_dim, "rope_interleave": args.rope_interleave,
        "max_position_embeddings": max(args.max_seq_len, int(config.get("max_position_embeddings", 0))),
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_parameters": {**dict(args.rope_scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta},
        "rope_scaling": None if args.rope_scaling is None else dict(args.rope_scaling),
        "tie_word_embeddings": shape.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    if moe is None:  # every layer dense
        config.update({"first_k_dense_replace": shape.n_layers})
        return config
    config.update({
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.num_shared_experts, "moe_intermediate_size": moe.expert_hidden,
        "first_k_dense_replace": moe.first_dense_layers, "n_group": args.n_group, "topk_group": args.topk_group,
        "routed_scaling_factor": args.routed_scaling_factor, "norm_topk_prob": norm_topk,
        "topk_method": "noaux_tc" if model_type == "deepseek_v3" else (
            "group_limited_greedy" if args.n_group > 1 else "greedy"),
    })
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
        tensors = {hf: t.contiguous() for name, tensor in load(names).items()
                   for hf, t in hf_tensors(name, tensor).items()}
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
    if model.moe_layers() and model.args.shape.mla is None:
        raise UserInputError("HF export: mixture-of-experts models without model.mla have no Hugging Face "
                             "equivalent (DeepSeek-V2/V3 are MLA + MoE); export a dense or an MLA model")
    if model.args.shape.mlp != "swiglu":
        raise UserInputError(f"HF export: model.mlp {model.args.shape.mlp} has no Llama equivalent (SwiGLU); "
                             "export a SwiGLU model")
    state = {name: t.detach().to("cpu", dtype) for name, t in (tensors or model.state_dict().items())}
    if model.args.router != "sigmoid":  # only DeepSeek-V3 has the selection bias (e_score_correction_bias)
        state = {name: t for name, t in state.items() if not name.endswith("expert_bias")}
    else:  # transformers keeps the bias in fp32 (the scores it is added to are fp32)
        state = {name: t.float() if name.endswith("expert_bias") else t for name, t in state.items()}
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    return write_hf_shards(out_dir, shards=plan_shards(sizes), load=lambda names: {n: state[n] for n in names},
                           config=hf_config(model.args, dtype=dtype, base=base))


def args_from_hf_config(hf_dir: Path, *, max_seq_len: int | None = None) -> ModelArgs:
    """ModelArgs from a Llama/Mistral/Qwen2/DeepSeek config.json (refuses features our model does not have)."""
    config = read_hf_config(hf_dir)
    architecture = "moe" if config.moe is not None else "dense"
    shape = resolve_shape(ModelSpec(init_from=Path(hf_dir), architecture=architecture))
    return args_from_config(config, shape=shape, max_seq_len=max_seq_len or config.max_position_embeddings)
