"""Multi-head latent attention and DeepSeek-V2/V3 checkpoints: transformers' logits on load, transformers loads
our export with the same logits, and a DeepSeek-V3-shaped checkpoint continues pre-training on 2 ranks (FSDP × EP,
TP) as it does on one process. The parallel layouts of a from-scratch MLA + MoE model are in
test_parallel_layouts.py (mla_*)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from leantrain.errors import UserInputError
from leantrain.model import build_model, model_args_from_spec
from leantrain.model.hf import export_hf
from leantrain.model.hf_load import check_hf_dir, import_hf
from leantrain.model.mla import LatentAttention
from leantrain.model.tiny_hf import save_tiny_deepseek
from leantrain.spec.hf_config import HFConfigError
from leantrain.spec.schema import ModelSpec

transformers = pytest.importorskip("transformers")


def _theirs(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("version,q_rank", [(2, 32), (2, None), (3, 32), (3, None)],
                         ids=["v2-q-latent", "v2-q-full", "v3-q-latent", "v3-q-full"])
def test_deepseek_checkpoints_load_with_transformers_logits_and_export_back(
    tmp_path: Path, version: int, q_rank: int | None
) -> None:
    """Random weights at std 0.15, two expert groups (a token may use one), V3's selection bias random and its
    weights scaled by 2.5: routing, group limits, the shared RoPE key and the interleaved RoPE all show."""
    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=version, q_lora_rank=q_rank,
                                routed_scaling=2.5 if version == 3 else 1.5)
    theirs = _theirs(hf_dir)
    ours = import_hf(hf_dir).eval()
    assert isinstance(ours.layers["0"].attention, LatentAttention)
    assert ours.layers["0"].is_moe is False and ours.layers["1"].is_moe is True  # first_k_dense_replace: 1
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    assert expected.abs().max() > 1.0  # far from uniform: a wrong layout could not hide
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)
    export_hf(ours, tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(_theirs(tmp_path / "out")(tokens).logits, got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("version", [2, 3])
def test_yarn_rope_as_deepseek_configs_use_it_gives_transformers_logits(tmp_path: Path, version: int) -> None:
    """DeepSeek-V2/V3's released configs extend the context with YaRN: the frequency ramp, the cos/sin factor
    (mscale ≠ mscale_all_dim, so it is not 1) and the attention's mscale² all count, past the original context."""
    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=version)
    plain = import_hf(hf_dir).eval()
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 0.8}
    config["max_position_embeddings"] = 128
    (hf_dir / "config.json").write_text(json.dumps(config))
    ours = import_hf(hf_dir).eval()
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _theirs(hf_dir)(tokens).logits
        got = ours(tokens)
        assert (plain(tokens) - got).abs().max() > 0.1  # YaRN changes the model: the comparison means something
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)
    export_hf(ours, tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(_theirs(tmp_path / "out")(tokens).logits, got, rtol=0, atol=1e-5)


def test_a_latent_attention_model_from_the_spec_exports_as_deepseek_v3(tmp_path: Path) -> None:
    spec = ModelSpec(architecture="moe", n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, ffn_hidden=64,
                     vocab_size=101, rope_theta=10000.0,
                     mla={"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                          "v_head_dim": 8},
                     moe={"num_experts": 4, "top_k": 2, "expert_hidden": 16, "num_shared_experts": 1,
                          "first_dense_layers": 1, "router": "sigmoid", "balance": "aux_free", "n_group": 2,
                          "topk_group": 1, "routed_scaling_factor": 2.5})
    ours = build_model(model_args_from_spec(spec, max_seq_len=32), device=torch.device("cpu"), seed=0).eval()
    with torch.no_grad():
        ours.layers["1"].feed_forward.expert_bias.normal_(std=0.05)  # as an aux-free run would have moved it
    export_hf(ours, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["n_group"] == 2 and config["norm_topk_prob"] is True
    tokens = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_theirs(tmp_path / "hf")(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_softmax_routing_that_renormalises_is_not_exported_as_deepseek_v2(tmp_path: Path) -> None:
    """transformers' DeepseekV2 never renormalises the top-k weights: such an export would change the model."""
    spec = ModelSpec(architecture="moe", n_layers=1, d_model=32, n_heads=4, n_kv_heads=4, ffn_hidden=64,
                     vocab_size=64, mla={"q_lora_rank": 0, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                         "qk_rope_head_dim": 4, "v_head_dim": 8},
                     moe={"num_experts": 4, "top_k": 2})
    model = build_model(model_args_from_spec(spec, max_seq_len=8), device=torch.device("cpu"))
    with pytest.raises(UserInputError, match="norm_topk_prob: false"):
        export_hf(model, tmp_path / "hf")


@pytest.mark.parametrize("field,value,message", [
    ("quantization_config", {"quant_method": "fp8"}, "dequantize"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("topk_method", "noaux_tc", "topk_method"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
])
def test_deepseek_configs_the_model_cannot_build_are_refused_by_field(
    tmp_path: Path, field: str, value: Any, message: str
) -> None:
    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=2)
    config = json.loads((hf_dir / "config.json").read_text())
    config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError, match=message):
        import_hf(hf_dir)


def test_experts_split_over_files_and_a_missing_expert_is_named(tmp_path: Path) -> None:
    """DeepSeek's files split a layer's experts over several shards: each expert is read from its own file; a
    checkpoint that lacks one expert is refused naming it."""
    from safetensors.torch import load_file, save_file

    from leantrain.model.hf import INDEX_FILE, args_from_hf_config

    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=3)
    whole = import_hf(hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    (hf_dir / "model.safetensors").unlink()
    def part(name: str) -> str:  # experts round-robin over three files, the rest in the first
        index = int(name.split(".")[5]) % 3 if ".mlp.experts." in name else 0
        return f"part-{index}.safetensors"

    weight_map = {name: part(name) for name in tensors}
    for file in sorted(set(weight_map.values())):
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, str(hf_dir / file))
    (hf_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    owners = check_hf_dir(hf_dir, args=args_from_hf_config(hf_dir))
    assert len(set(owners["layers.1.feed_forward.experts.w1"])) == 3  # one file per expert, three files in all
    again = import_hf(hf_dir)
    for (name, a), b in zip(whole.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    weight_map.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    (hf_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(UserInputError, match="expert 5"):
        import_hf(hf_dir)


VOCAB = 256
DS_RUNS: dict[str, dict[str, Any]] = {
    "fsdp_ep": {"data_parallel": 2, "expert_parallel": 2},
    "tp": {"tensor_parallel": 2},
}


@pytest.mark.heavy  # 45 s of four ranks: CI runs it with `make test-heavy`
@pytest.mark.slow
def test_a_deepseek_v3_checkpoint_trains_on_two_and_four_ranks_as_on_one(tmp_path: Path) -> None:
    from leantrain.data.layout import write_token_data_dir
    from leantrain.spec import spec_from_dict
    from leantrain.train.trainer import Trainer
    from test_finetune_distributed import STEPS, job, losses, run_two_rank_jobs

    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=3, vocab_size=VOCAB, weight_std=0.05,
                                routed_scaling=2.5)
    rng = np.random.default_rng(0)
    docs = [[int((s + i) % 200) + 1 for i in range(40)] for s in rng.integers(0, 200, 40)]
    write_token_data_dir(tmp_path / "data", {"counting": docs}, vocab_size=VOCAB - 3, eos_id=0)
    single = Trainer(spec_from_dict(job(hf_dir, tmp_path / "data", kind="continue_pretrain", zero_stage=3)),
                     run_dir=tmp_path / "single")
    try:
        single.train()
    finally:
        single.close()
    reference = losses(tmp_path / "single" / "metrics.jsonl")
    assert len(reference) == STEPS and reference[-1] < reference[0]
    run_two_rank_jobs({name: job(hf_dir, tmp_path / "data", kind="continue_pretrain", zero_stage=3, **parallelism)
                       for name, parallelism in DS_RUNS.items()}, tmp_path)
    for name in DS_RUNS:
        assert losses(tmp_path / name / "metrics.jsonl") == pytest.approx(reference, rel=1e-5), name
    # EP × TP on 4 ranks: the checkpoint's experts land in each rank's (dp_mod_ep_tp, ep) shard, and each TP rank
    # sends the experts its share of the tokens (parallel/expert.py)
    four = job(hf_dir, tmp_path / "data", kind="continue_pretrain", zero_stage=3, data_parallel=2,
               tensor_parallel=2, expert_parallel=2)
    four["hardware"]["gpus_per_node"] = 4
    run_two_rank_jobs({"fsdp_tp_ep": four}, tmp_path, nproc=4)
    assert losses(tmp_path / "fsdp_tp_ep" / "metrics.jsonl") == pytest.approx(reference, rel=1e-5)
