"""Hugging Face interop: our export loads in transformers' LlamaForCausalLM with the same logits, and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantrain.errors import UserInputError
from leantrain.model import build_model, model_args_from_spec
from leantrain.model.hf import export_hf
from leantrain.model.hf_load import import_hf
from leantrain.spec.schema import ModelSpec

transformers = pytest.importorskip("transformers")


def tiny_model(*, tie: bool):
    spec = ModelSpec(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=101,
                     tie_embeddings=tie, rope_theta=10000.0)
    return build_model(model_args_from_spec(spec, max_seq_len=32), device=torch.device("cpu"), seed=0)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, tie: bool) -> None:
    ours = tiny_model(tie=tie).eval()
    export_hf(ours, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_import_from_transformers_save_pretrained(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    ours = import_hf(tmp_path / "hf").eval()
    tokens = torch.randint(0, 101, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_moe_export_is_refused(tmp_path: Path) -> None:
    spec = ModelSpec(n_layers=1, d_model=16, n_heads=2, ffn_hidden=32, vocab_size=20, architecture="moe",
                     moe={"num_experts": 2, "top_k": 1})
    model = build_model(model_args_from_spec(spec, max_seq_len=8), device=torch.device("cpu"))
    with pytest.raises(UserInputError, match="mixture-of-experts"):
        export_hf(model, tmp_path / "hf")
