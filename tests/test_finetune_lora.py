"""LoRA and QLoRA fine-tuning from a Hugging Face checkpoint: few trainable parameters, a falling loss, a frozen
base that stays bitwise unchanged and out of the checkpoint, and exports (merged, PEFT adapter) that load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from leantrain.data.layout import write_token_data_dir
from leantrain.model.hf import to_hf_name
from leantrain.model.lora import LoRALinear, is_adapter
from leantrain.model.tiny_hf import save_tiny_hf
from leantrain.spec import spec_from_dict
from leantrain.train.command import train
from leantrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
SEQ = 32
VOCAB = 512


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny", vocab_size=VOCAB, hidden_size=128,
                        intermediate_size=256, num_heads=4, num_kv_heads=2)


def write_counting_data(path: Path, *, vocab: int) -> Path:
    """Learnable sequences (count up by one): a random base model has a lot to learn from them."""
    rng = np.random.default_rng(0)
    docs = [[int((s + i) % 200) + 1 for i in range(70)] for s in rng.integers(0, 200, 60)]
    write_token_data_dir(path, {"counting": docs}, vocab_size=vocab - 3, eos_id=0,
                         valid_docs_by_source={"counting": docs[:8]})
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_counting_data(tmp_path_factory.mktemp("data"), vocab=VOCAB)


def ft_spec(hf_dir: Path, data_dir: Path, run_dir: Path, *, method: str = "lora", **training: Any) -> Any:
    return spec_from_dict({
        "task": "finetune",
        "finetune": {"method": method, "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0}},
        "model": {"init_from": str(hf_dir)},
        "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(data_dir)},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1,
                     "max_steps": 8, "device": "cpu", "log_every": 1, "deterministic": True, "eval_every": 0,
                     **training},
        "checkpoint": {"interval_steps": 8},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
        "run": {"dir": str(run_dir)},
    })


def test_lora_trains_few_parameters_and_leaves_the_base_bitwise_unchanged(
    hf_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    trainer = Trainer(ft_spec(hf_dir, data_dir, tmp_path / "run"), run_dir=tmp_path / "run")
    counts = trainer.param_counts
    assert 0 < counts["trainable_params"] < 0.05 * counts["params"]
    assert sum(isinstance(m, LoRALinear) for m in trainer.model.modules()) == 2 * 7
    original = load_file(str(hf_dir / "model.safetensors"))
    records = trainer.train()
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.1
    assert records[0]["trainable_params"] == counts["trainable_params"]
    for name, param in trainer.model.named_parameters():
        if not is_adapter(name):
            assert not param.requires_grad
            assert torch.equal(param.detach(), original[to_hf_name(name)]), name
    trainer.close()


def test_lora_checkpoint_holds_adapters_and_exports_merged_and_as_peft(
    hf_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    from leantrain.ckpt.export import export_run

    run_dir = tmp_path / "run"
    spec = ft_spec(hf_dir, data_dir, run_dir, max_steps=4)
    train(spec, run_dir=run_dir, max_steps=None, console=None)
    base_record = json.loads((run_dir / "base_model.json").read_text())
    assert set(base_record["files"]) >= {"config.json", "model.safetensors"}
    reader = dcp.FileSystemReader(str(run_dir / "checkpoints" / "step-00000004"))
    model_keys = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)  # no base weight in the checkpoint

    merged = export_run(run_dir, tmp_path / "merged")
    assert merged.merged_lora
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    adapters = {k.removeprefix("model."): v for k, v in _read_adapters(reader, run_dir, model_keys).items()}
    scale = 8.0 / 4
    hf_base = load_file(str(hf_dir / "model.safetensors"))
    wq = adapters["layers.0.attention.wq.lora_b"] @ adapters["layers.0.attention.wq.lora_a"]
    torch.testing.assert_close(exported.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                               hf_base["model.layers.0.self_attn.q_proj.weight"] + scale * wq, rtol=0, atol=1e-6)
    tokens = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        assert not torch.allclose(exported(tokens).logits, base(tokens).logits, atol=1e-3)

    # eval of the run dir (adapters on the hash-checked base) = eval of the merged export as a starting point
    from leantrain.golive.eval import evaluate

    from_run = evaluate(run_dir, tasks=[])
    merged_spec = tmp_path / "merged.yaml"
    merged_spec.write_text(yaml.safe_dump({**spec.model_dump(mode="json", include={"data", "training"}),
                                           "model": {"init_from": str(tmp_path / "merged")},
                                           "run": {"dir": str(tmp_path / "merged-eval")}}))
    from_export = evaluate(merged_spec, tasks=[])
    assert from_run["step"] == 4 and from_run["held_out"]["counting"]["tokens"] > 0
    assert from_run["held_out"]["counting"]["loss"] == pytest.approx(from_export["held_out"]["counting"]["loss"],
                                                                     abs=1e-4)

    adapter = export_run(run_dir, tmp_path / "adapter", adapter_only=True)
    assert adapter.adapter_only
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    peft = pytest.importorskip("peft")
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(tokens).logits, exported(tokens).logits, rtol=0, atol=1e-4)


def _read_adapters(reader: Any, run_dir: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    meta = reader.read_metadata().state_dict_metadata
    state = {"model": {k.removeprefix("model."): torch.empty(meta[k].size) for k in keys}}
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / "step-00000004"), no_dist=True)
    return {f"model.{k}": v for k, v in state["model"].items()}


def test_qlora_runs_on_cpu_with_an_nf4_base(hf_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(ft_spec(hf_dir, data_dir, tmp_path / "run", method="qlora", max_steps=3),
                      run_dir=tmp_path / "run")
    loras = [m for m in trainer.model.modules() if isinstance(m, LoRALinear)]
    assert loras and all(type(m.weight).__name__ == "NF4Tensor" for m in loras)
    assert all(m.lora_a.dtype == torch.float32 for m in loras)
    base_numel = sum(m.weight.numel() for m in loras)
    nf4_bytes = sum(m.weight.quantized_data.numel() * m.weight.quantized_data.element_size() for m in loras)
    assert nf4_bytes == base_numel // 2  # 4 bits per base weight (plus block scales), not 32
    records = [r for r in trainer.train() if "loss" in r]
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    trainer.close()


def test_a_lora_run_resumes_its_adapters_on_the_same_base(hf_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from leantrain.ckpt.hook import TrainerCheckpointer

    run_dir = tmp_path / "run"
    spec = ft_spec(hf_dir, data_dir, run_dir, max_steps=4)
    train(spec, run_dir=run_dir, max_steps=None, console=None)
    resumed = Trainer(spec, run_dir=run_dir, checkpointer_factory=TrainerCheckpointer)
    try:
        assert resumed.step == 4
        folder = run_dir / "checkpoints" / "step-00000004"
        meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        keys = [k.removeprefix("model.") for k in meta if k.startswith("model.")]
        saved = {"model": {k: torch.empty(meta[f"model.{k}"].size) for k in keys}}
        dcp.load(saved, checkpoint_id=str(folder), no_dist=True)
        params = dict(resumed.model.named_parameters())
        original = load_file(str(hf_dir / "model.safetensors"))
        for name, value in saved["model"].items():
            assert torch.equal(params[name].detach(), value), name
        assert all(torch.equal(p.detach(), original[to_hf_name(n)]) for n, p in params.items() if not is_adapter(n))
    finally:
        resumed.close()


def test_the_ranks_hash_the_base_between_them_and_a_changed_base_is_refused(
    hf_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 alone hashed every file of the base before the first collective (a 405B base: ~10 minutes, past
    the collective timeout at every start). Each rank now hashes every world_size-th file; the shares together
    are the whole record, each file hashed once; a resume onto a base whose files changed is refused."""
    import shutil

    from leantrain.ckpt import base_ref
    from leantrain.errors import UserInputError
    from leantrain.train.run_setup import record_ranks_joined

    base = tmp_path / "base"
    shutil.copytree(hf_dir, base)
    for i in range(3):  # a sharded checkpoint's files
        (base / f"model-0000{i}-of-00003.safetensors").write_bytes(bytes([i]) * 100)
    spec = ft_spec(base, data_dir, tmp_path / "run")
    whole = base_ref.base_share(spec, rank=0, world_size=1)
    shares = [base_ref.base_share(spec, rank=r, world_size=3) for r in range(3)]
    assert len(whole) >= 5 and sum(len(s) for s in shares) == len(whole)
    assert {k: v for s in shares for k, v in s.items()} == whole and all(shares)
    run_dir = tmp_path / "run"
    record_ranks_joined(run_dir, rank=0, world_size=1, distributed=False, spec=spec)
    record = json.loads((run_dir / base_ref.BASE_FILE).read_text())
    assert record["files"] == whole and record["init_from"] == str(base.resolve())
    record_ranks_joined(run_dir, rank=0, world_size=1, distributed=False, spec=spec)  # a resume: kept
    (base / "model-00001-of-00003.safetensors").write_bytes(b"other")
    with pytest.raises(UserInputError, match="started from other weights"):
        record_ranks_joined(run_dir, rank=0, world_size=1, distributed=False, spec=spec)
    assert json.loads((run_dir / base_ref.BASE_FILE).read_text()) == record
