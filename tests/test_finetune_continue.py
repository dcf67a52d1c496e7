"""Continued pre-training from a Hugging Face checkpoint: config.json decides the shape, the weights load into the
model, the loss at step 0 is transformers' loss on the same batch, and the export loads back with equal logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from leantrain.cli import main
from leantrain.data.layout import write_token_data_dir
from leantrain.data.sampler import PackedBatchSampler
from leantrain.errors import UserInputError
from leantrain.model.tiny_hf import save_tiny_hf
from leantrain.spec import spec_from_dict
from leantrain.train.command import train

transformers = pytest.importorskip("transformers")
SEQ = 32
VOCAB = 512


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny-llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Domain data plus a 'general' replay source; their shares are the mixture weights."""
    rng = np.random.default_rng(0)
    domain = [[int(t) for t in rng.integers(1, 300, 80)] for _ in range(40)]
    general = [[int(t) for t in rng.integers(1, VOCAB - 3, 80)] for _ in range(40)]
    path = tmp_path_factory.mktemp("data")
    write_token_data_dir(path, {"domain": domain, "general": general}, vocab_size=VOCAB - 3, eos_id=0,
                         valid_docs_by_source={"domain": domain[:3], "general": general[:3]})
    return path


def cp_spec(hf_dir: Path, data_dir: Path, run_dir: Path, **model: Any) -> Any:
    return spec_from_dict({
        "task": "continue_pretrain",
        "model": {"init_from": str(hf_dir), **model},
        "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(data_dir)},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "lr": 1e-3, "warmup_steps": 2,
                     "max_steps": 3, "device": "cpu", "log_every": 1, "deterministic": True, "eval_every": 0},
        "checkpoint": {"interval_steps": 3},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
        "run": {"dir": str(run_dir)},
    })


def test_shape_comes_from_config_json_and_a_disagreeing_field_is_an_error(hf_dir: Path, tmp_path: Path) -> None:
    from leantrain.errors import SpecError
    from leantrain.spec.shapes import resolve_shape

    spec = cp_spec(hf_dir, tmp_path, tmp_path / "run")
    shape = resolve_shape(spec.model)
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads, shape.vocab_size) == (2, 64, 4, 2, VOCAB)
    with pytest.raises(SpecError, match=r"model.n_heads is 8 but .*config.json has num_attention_heads = 4"):
        cp_spec(hf_dir, tmp_path, tmp_path / "run", n_heads=8)


def test_step0_loss_equals_transformers_and_export_round_trips(hf_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    from leantrain.ckpt.export import export_run

    run_dir = tmp_path / "run"
    spec = cp_spec(hf_dir, data_dir, run_dir)
    records = [r for r in train(spec, run_dir=run_dir, max_steps=None, console=None).records if "loss" in r]
    # The same first batch through transformers' own model and loss.
    batch = PackedBatchSampler(data_dir, seq_len=SEQ, micro_batch=4, dp_rank=0, dp_size=1, seed=spec.training.seed,
                               split="train").next_batch()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(input_ids=batch.tokens.long(), labels=batch.tokens.long()).loss.item()
    assert records[0]["loss"] == pytest.approx(expected, abs=1e-5)
    assert records[0]["trainable_params"] == records[0]["params"] == theirs.num_parameters()
    info = json.loads((run_dir / "train_info.json").read_text())
    assert info["task"] == "continue_pretrain"

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--step", "3"]) == 0
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained = _our_model_from_checkpoint(spec, run_dir)
    tokens = batch.tokens[:2, :SEQ].long()
    with torch.no_grad():
        ours, theirs_logits = trained(tokens), exported(tokens).logits
    torch.testing.assert_close(theirs_logits, ours, rtol=0, atol=1e-4)
    assert not torch.allclose(theirs_logits, theirs(tokens).logits, atol=1e-3)  # the weights did train
    with pytest.raises(UserInputError, match="not empty"):
        export_run(run_dir, out)


def _our_model_from_checkpoint(spec: Any, run_dir: Path) -> torch.nn.Module:
    """Our model with the checkpoint's weights, read through DCP independently of the exporter."""
    import torch.distributed.checkpoint as dcp

    from leantrain.model.transformer import build_model, model_args_from_spec

    model = build_model(model_args_from_spec(spec.model, max_seq_len=SEQ), device=torch.device("cpu")).eval()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / "step-00000003"), no_dist=True)
    model.load_state_dict(state["model"])
    return model
