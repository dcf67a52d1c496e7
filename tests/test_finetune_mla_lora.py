"""LoRA and QLoRA on a multi-head latent attention (DeepSeek-V3-shaped) checkpoint with the default targets: they
name the latent projections (MLA has no wk/wv), the run trains, and only the adapters change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from leantrain.model.lora import LoRALinear, is_adapter
from leantrain.model.tiny_hf import save_tiny_deepseek
from leantrain.spec import spec_from_dict
from leantrain.train.trainer import Trainer
from test_finetune_lora import write_counting_data

pytest.importorskip("transformers")
SEQ = 32
VOCAB = 256
MLP = ["w1", "w2", "w3"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Learnable sequences (count up by one), test_finetune_lora.py's."""
    return write_counting_data(tmp_path_factory.mktemp("data"), vocab=VOCAB)


def mla_ft_spec(hf_dir: Path, data_dir: Path, run_dir: Path, *, method: str = "lora", max_steps: int = 8) -> Any:
    return spec_from_dict({
        "task": "finetune",
        "finetune": {"method": method, "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0}},  # no targets: defaults
        "model": {"init_from": str(hf_dir)},
        "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(data_dir)},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1,
                     "max_steps": max_steps, "device": "cpu", "log_every": 1, "deterministic": True,
                     "eval_every": 0},
        "checkpoint": {"interval_steps": max_steps},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
        "run": {"dir": str(run_dir)},
    })


@pytest.mark.parametrize("q_rank,query", [(32, ["wq_a", "wq_b"]), (None, ["wq"])], ids=["q-latent", "q-full"])
def test_lora_default_targets_follow_latent_attention_and_only_adapters_train(
    tmp_path: Path, data_dir: Path, q_rank: int | None, query: list[str]
) -> None:
    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=3, q_lora_rank=q_rank)
    spec = mla_ft_spec(hf_dir, data_dir, tmp_path / "run")
    expected = query + ["wkv_a", "wkv_b", "wo"] + MLP
    assert spec.finetune.lora.targets == expected
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    try:
        swapped = {name for name, m in trainer.model.named_modules() if isinstance(m, LoRALinear)}
        # 3 layers: each has the attention's projections and a SwiGLU (layer 0's dense MLP, the MoE layers'
        # shared expert); routed experts and the router gate get none
        assert swapped == {f"layers.{i}.attention.{t}" for i in range(3) for t in expected[:-3]} | {
            f"layers.0.feed_forward.{t}" for t in MLP} | {
            f"layers.{i}.feed_forward.shared_experts.{t}" for i in (1, 2) for t in MLP}
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        losses = [r["loss"] for r in trainer.train() if "loss" in r]
        assert losses[-1] < losses[0] - 0.1
        after = dict(trainer.model.named_parameters())
        for name, value in before.items():
            if is_adapter(name):
                assert after[name].requires_grad
                if name.endswith(".lora_b"):  # starts at zero: every adapter got gradient and moved
                    assert after[name].detach().abs().max() > 0, name
            else:
                assert not after[name].requires_grad, name
                assert torch.equal(after[name].detach(), value), name
    finally:
        trainer.close()


def test_qlora_default_targets_on_latent_attention_quantise_and_train(tmp_path: Path, data_dir: Path) -> None:
    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=3)
    trainer = Trainer(mla_ft_spec(hf_dir, data_dir, tmp_path / "run", method="qlora", max_steps=3),
                      run_dir=tmp_path / "run")
    try:
        loras = {name: m for name, m in trainer.model.named_modules() if isinstance(m, LoRALinear)}
        assert {name.rsplit(".", 1)[-1] for name in loras} == {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo", *MLP}
        assert all(type(m.weight).__name__ == "NF4Tensor" for m in loras.values())
        records = [r for r in trainer.train() if "loss" in r]
        assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    finally:
        trainer.close()


def test_mha_targets_on_a_latent_attention_model_are_refused_naming_its_linears(tmp_path: Path) -> None:
    from leantrain.model.lora import apply_lora
    from leantrain.model.transformer import Transformer, model_args_from_spec
    from leantrain.spec.schema import ModelSpec

    spec = ModelSpec(init_from=save_tiny_deepseek(tmp_path / "hf", version=2))
    with torch.device("meta"):
        model = Transformer(model_args_from_spec(spec, max_seq_len=SEQ))
    with pytest.raises(ValueError, match=r"wk, wq, wv match no Linear layer of the model \(its Linears: gate, "
                                         r"output, w1, w2, w3, wkv_a, wkv_b, wo, wq_a, wq_b\)"):
        apply_lora(model, targets=["wq", "wk", "wv", "wo"], rank=4, alpha=8.0, dropout=0.0)


@pytest.fixture(scope="module")
def trained_v3(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, Path, Any]:
    """A DeepSeek-V3-shaped checkpoint (latent q, 1 dense + 2 MoE layers) after 3 LoRA steps with the default
    targets: (hf_dir, run_dir, the trained LoRA model in memory)."""
    from leantrain.ckpt.hook import TrainerCheckpointer
    from leantrain.train.command import train

    root = tmp_path_factory.mktemp("v3")
    hf_dir = save_tiny_deepseek(root / "hf", version=3)
    spec = mla_ft_spec(hf_dir, data_dir, root / "run", max_steps=3)
    train(spec, run_dir=root / "run", max_steps=None, console=None)
    resumed = Trainer(spec, run_dir=root / "run", checkpointer_factory=TrainerCheckpointer)  # the step-3 adapters
    resumed.close()
    assert resumed.step == 3
    return hf_dir, root / "run", resumed.model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def test_merged_export_of_a_deepseek_lora_run_loads_in_transformers_with_its_logits(
    trained_v3: tuple[Path, Path, Any], tmp_path: Path
) -> None:
    """W + (alpha / rank) · B A on the latent attention, dense MLP and shared experts; the routed experts and the
    selection bias copied from the base: transformers, our loader and the LoRA model give the same logits."""
    from leantrain.ckpt.export import export_run
    from leantrain.model.hf_load import import_hf
    from test_model_mla import _theirs

    _, run_dir, lora_model = trained_v3
    result = export_run(run_dir, tmp_path / "merged")
    assert result.merged_lora
    tokens = _tokens()
    with torch.no_grad():
        expected = lora_model(tokens)
        theirs = _theirs(tmp_path / "merged")(tokens).logits
        ours_merged = import_hf(tmp_path / "merged").eval()(tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(ours_merged, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs, expected, rtol=0, atol=1e-5)


def test_peft_export_of_deepseek_mlp_adapters_is_refused_naming_them(
    trained_v3: tuple[Path, Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PEFT maps `*.gate_proj|up_proj|down_proj` targets of a DeepSeek MoE model onto the fused routed experts: the
    dense MLP's and shared experts' adapters cannot be written as a PEFT adapter, so the export refuses (exit 2,
    one line), naming them, and writes nothing."""
    from leantrain.cli import main

    _, run_dir, _ = trained_v3
    assert main(["export", str(run_dir), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "cannot hold the LoRA on layers.0.feed_forward.w1, layers.0.feed_forward.w2" in err and "5 more" in err
    assert not (tmp_path / "adapter").exists()


def test_peft_adapter_of_a_deepseek_attention_lora_loads_onto_transformers_with_its_logits(
    tmp_path: Path, data_dir: Path
) -> None:
    """Latent-attention targets only: target_modules are PEFT's short names (each names only adapted modules),
    and PEFT on transformers' DeepSeek-V3 gives the LoRA model's logits; no routed expert gets an adapter."""
    import json

    from leantrain.ckpt.export import export_run
    from leantrain.ckpt.hook import TrainerCheckpointer
    from leantrain.train.command import train
    from test_model_mla import _theirs

    peft = pytest.importorskip("peft")
    hf_dir = save_tiny_deepseek(tmp_path / "hf", version=3)
    spec = mla_ft_spec(hf_dir, data_dir, tmp_path / "run", max_steps=2)
    spec.finetune.lora.targets = ["wq_a", "wq_b", "wkv_a", "wkv_b", "wo"]
    train(spec, run_dir=tmp_path / "run", max_steps=None, console=None)
    lora_model = Trainer(spec, run_dir=tmp_path / "run", checkpointer_factory=TrainerCheckpointer)
    lora_model.close()
    assert export_run(tmp_path / "run", tmp_path / "adapter", adapter_only=True).adapter_only
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    with_adapter = peft.PeftModel.from_pretrained(_theirs(hf_dir), tmp_path / "adapter").eval()
    adapted = {n for n, m in with_adapter.named_modules() if hasattr(m, "lora_A")}
    assert len(adapted) == 15 and all(".self_attn." in n for n in adapted)
    tokens = _tokens()
    with torch.no_grad():
        expected = lora_model.model.eval()(tokens)
        torch.testing.assert_close(with_adapter(tokens).logits, expected, rtol=0, atol=1e-5)
