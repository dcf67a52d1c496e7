"""A tiny Hugging Face checkpoint built on demand (random weights, nothing downloaded) for examples and tests.

`save_tiny_hf(out_dir)` writes what `model.init_from` expects: config.json and model.safetensors from
transformers' own `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` (`save_pretrained`), plus a
byte-level tokenizer.json (256 byte tokens and the chat special tokens) and a tokenizer_config.json carrying
a ChatML chat template. transformers is needed only here and in export tests (it is a dev dependency).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tokenizer(out_dir: Path, *, chat_template: str | None = CHATML_TEMPLATE) -> int:
    """Byte-level tokenizer.json + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                              "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return tokenizer.get_vocab_size()


def save_tiny_hf(
    out_dir: Path | str, *, model_type: str = "llama", vocab_size: int = 512, hidden_size: int = 64,
    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
    tie_embeddings: bool = False, rope_scaling: dict[str, Any] | None = None, seed: int = 0,
    max_positions: int = 256, tokenizer: bool = True, head_dim: int | None = None,
) -> Path:
    """Save a randomly initialised transformers model (and a tokenizer) to `out_dir`; returns it."""
    import torch
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, name) for name in classes[model_type])
    extra: dict[str, Any] = {"sliding_window": None} if model_type == "mistral" else {}
    if rope_scaling is not None:
        extra["rope_scaling"] = rope_scaling
    if head_dim is not None:  # a head width other than hidden_size / num_attention_heads (Mistral NeMo, Qwen3)
        extra["head_dim"] = head_dim
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=tie_embeddings,
        rope_theta=10000.0, **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # transformers zero-initialises biases; random ones make the bias path testable
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.02)
    out = Path(out_dir)
    model.save_pretrained(out)
    if tokenizer:
        save_tokenizer(out)
    return out


def save_tiny_deepseek(
    out_dir: Path | str, *, version: int = 2, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 3,
    num_heads: int = 4, intermediate_size: int = 128, num_experts: int = 8, top_k: int = 2, shared_experts: int = 1,
    expert_hidden: int = 32, first_dense: int = 1, q_lora_rank: int | None = 32, kv_lora_rank: int = 16,
    qk_nope: int = 16, qk_rope: int = 8, v_head_dim: int = 12, n_group: int = 2, topk_group: int = 1,
    routed_scaling: float = 1.0, seed: int = 0, weight_std: float = 0.15, max_positions: int = 256,
) -> Path:
    """A random DeepSeek-V2 (`version` 2: softmax, group-limited greedy) or V3 (sigmoid, selection bias) model with
    multi-head latent attention, saved by transformers (`save_pretrained`: per-expert weights, as DeepSeek's
    files hold them). Weights are redrawn at `weight_std` (and V3's selection bias too) so routing and
    attention are far from uniform and a wrong layout would show in the logits."""
    import torch
    import transformers

    config_cls, model_cls = (("DeepseekV2Config", "DeepseekV2ForCausalLM") if version == 2
                             else ("DeepseekV3Config", "DeepseekV3ForCausalLM"))
    extra: dict[str, Any] = {"topk_method": "group_limited_greedy" if n_group > 1 else "greedy"} if version == 2 \
        else {"norm_topk_prob": True, "num_nextn_predict_layers": 0}
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=expert_hidden, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, n_routed_experts=num_experts, n_shared_experts=shared_experts,
        num_experts_per_tok=top_k, first_k_dense_replace=first_dense, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope, qk_rope_head_dim=qk_rope, v_head_dim=v_head_dim,
        max_position_embeddings=max_positions, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling, rms_norm_eps=1e-5, rope_theta=10000.0, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(std=weight_std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.1)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


# The tiny model the CPU examples start from (examples/*-cpu.yaml with model.init_from: ../demo-out/tiny-llama).
EXAMPLE_MODEL_SHAPE: dict[str, int] = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                                       "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "max_positions": 512}


def save_example_model(out_dir: Path | str) -> bool:
    """Build the examples' tiny random Llama in `out_dir` unless it is there; True when it was built."""
    if (Path(out_dir) / "config.json").is_file():
        return False
    save_tiny_hf(out_dir, **EXAMPLE_MODEL_SHAPE)
    return True
