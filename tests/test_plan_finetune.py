"""Fine-tuning in the memory model (task: finetune; finetune.method full | lora | qlora)."""

from __future__ import annotations

import pytest

from leantrain.hardware import GB
from leantrain.plan.finetune import NF4_BYTES_PER_PARAM, adapter_params, frozen_weight_bytes
from leantrain.plan.inputs import plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.memory import memory_per_gpu
from leantrain.spec import spec_from_dict

LLAMA_65B = {"n_layers": 80, "d_model": 8192, "n_heads": 64, "n_kv_heads": 64, "ffn_hidden": 22016,
             "vocab_size": 32000}
LLAMA3_70B = {"n_layers": 80, "d_model": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden": 28672,
              "vocab_size": 128256}
A6000_BYTES = 49140 * 2**20  # a "48 GB" GPU (RTX A6000 / A40) as nvidia-smi reports it


def finetune_inputs(model: dict, *, method: str, gpus: int = 1, memory_bytes: float | None = None,
                    rank: int = 64, offload: bool = False, **precision):
    hardware = {"accelerator": "A100-80GB", "gpus_per_node": min(gpus, 8), "num_nodes": max(1, gpus // 8)}
    if memory_bytes is not None:
        hardware["memory_gb"] = memory_bytes / GB
    spec = spec_from_dict({
        "task": "finetune", "model": model, "finetune": {"method": method, "lora": {"rank": rank}},
        "data": {"tokens_total": 1e8, "seq_len": 512},
        "training": {"global_batch_tokens": 16 * 512, "micro_batch": 1, "activation_checkpointing": "full"},
        "precision": {"compute": "bf16", **precision}, "hardware": hardware,
        "parallelism": {"data_parallel": gpus, "zero_stage": 0, "cpu_offload": offload},
        "budget": {"target_days": None, "num_gpus": gpus}})
    return plan_inputs(spec)


def test_adapter_and_nf4_counts() -> None:
    inputs = finetune_inputs(LLAMA_65B, method="qlora", rank=64)
    d, f, r = 8192, 22016, 64
    per_layer = 4 * r * (d + d) + 2 * r * (d + f) + r * (f + d)  # wq wk wv wo (MHA), w1 w3, w2
    assert adapter_params(inputs) == 80 * per_layer
    linear = 80 * (4 * d * d + 3 * d * f)
    rest = inputs.shape.total_params() - linear
    assert frozen_weight_bytes(inputs) == pytest.approx(linear * NF4_BYTES_PER_PARAM + rest * 2)
    assert pytest.approx(0.516, abs=1e-3) == NF4_BYTES_PER_PARAM  # QLoRA §3: 4 + 0.127 bits


def test_qlora_65b_fits_one_48gb_gpu() -> None:
    """QLoRA (Dettmers et al. 2023): 65B fine-tuned on a single 48 GB GPU (r = 64 on every linear layer,
    bf16 adapters, gradient checkpointing). Plain LoRA (a bf16 base of 130 GB) does not."""
    layout = Layout(dp=1, tp=1, pp=1, zero=0, micro_batch=1, recompute="full")
    qlora = finetune_inputs(LLAMA_65B, method="qlora", memory_bytes=A6000_BYTES, master_weights="bf16",
                            grad_reduce="bf16")
    mem = memory_per_gpu(qlora, layout, num_microbatches=16)
    assert mem.fits, mem
    assert mem.grads < 0.05 * mem.params  # only the adapters have gradients
    lora = finetune_inputs(LLAMA_65B, method="lora", memory_bytes=A6000_BYTES, master_weights="bf16",
                           grad_reduce="bf16")
    assert not memory_per_gpu(lora, layout, num_microbatches=16).fits


def test_70b_full_finetune_on_8x80gb_needs_zero3() -> None:
    """16 bytes per parameter of weights, gradients and Adam states: 1.1 TB for 70B; without ZeRO-3 every
    GPU holds at least the 141 GB of bf16 weights. ZeRO-3 with the optimizer offloaded to the host fits."""
    full = finetune_inputs(LLAMA3_70B, method="full", gpus=8)
    for zero in (0, 1, 2):
        for recompute in ("none", "full"):
            layout = Layout(dp=8, tp=1, pp=1, zero=zero, micro_batch=1, recompute=recompute)
            assert not memory_per_gpu(full, layout, num_microbatches=2).fits
    offloaded = finetune_inputs(LLAMA3_70B, method="full", gpus=8, offload=True)
    assert memory_per_gpu(offloaded, Layout(dp=8, tp=1, pp=1, zero=3, recompute="full"), num_microbatches=2).fits


def test_lora_freezes_the_base() -> None:
    full = finetune_inputs(LLAMA3_70B, method="full", gpus=8)
    lora = finetune_inputs(LLAMA3_70B, method="lora", gpus=8, rank=16)
    layout = Layout(dp=8, tp=1, pp=1, zero=3, recompute="full")
    f, lo = (memory_per_gpu(i, layout, num_microbatches=2) for i in (full, lora))
    assert lo.optimizer < 0.01 * f.optimizer and lo.grads < 0.01 * f.grads
    assert lo.fits


def test_adapter_states_follow_the_zero_level() -> None:
    lora = finetune_inputs(LLAMA3_70B, method="lora", gpus=8, rank=16)
    mem = {z: memory_per_gpu(lora, Layout(dp=8, tp=1, pp=1, zero=z, recompute="full"), num_microbatches=2)
           for z in (0, 1, 2, 3)}
    from leantrain.plan.memory import rope_table_bytes

    rope = rope_table_bytes(lora)
    # the trainer's FSDP2 shards weights, gradients and optimizer states alike at every level ≥ 1
    for z in (1, 2, 3):
        assert mem[z].optimizer == pytest.approx(mem[0].optimizer / 8)
        assert mem[z].grads == pytest.approx(mem[0].grads / 8)
        assert mem[z].params - rope == pytest.approx((mem[0].params - rope) / 8)


def test_lora_skips_the_frozen_weight_gradients() -> None:
    full = finetune_inputs(LLAMA3_70B, method="full", gpus=8)
    lora = finetune_inputs(LLAMA3_70B, method="lora", gpus=8, rank=16)
    assert lora.adapter_params == adapter_params(lora) > 0
    # and full recompute runs LoRA's base down projection again (base then adapter: the early stop comes after it)
    assert full.recompute_skips_down and not lora.recompute_skips_down
    expected = (full.hardware_flops_per_token("full") + full.flops.down_forward - full.flops.matmul / 3
                + 6 * lora.adapter_params)
    assert lora.hardware_flops_per_token("full") == pytest.approx(expected)
    assert lora.hardware_flops_per_token("none") < 0.75 * full.hardware_flops_per_token("none")


@pytest.mark.parametrize("model,targets", [
    ("llama", None), ("llama", ["wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"]),
    ("v3", None), ("v2-q-full", None), ("v3", ["wq_a", "wkv_b", "w1", "w2", "w3", "gate", "output"]),
], ids=["dense", "dense-all", "mla-moe", "mla-q-full", "mla-moe-router-output"])
def test_planned_adapter_count_is_the_built_models_trainable_count(
    tmp_path, model: str, targets: list[str] | None
) -> None:
    """The planner resolves LoRA targets as apply_lora does: MLA's latent projections, the dense MLP, the shared
    experts and router of MoE layers (routed experts are no Linear), the untied output."""
    pytest.importorskip("transformers")
    import torch

    from leantrain.model.lora import apply_lora
    from leantrain.model.tiny_hf import save_tiny_deepseek, save_tiny_hf
    from leantrain.model.transformer import Transformer, model_args_from_spec

    hf_dir = (save_tiny_hf(tmp_path / "hf", tokenizer=False) if model == "llama" else
              save_tiny_deepseek(tmp_path / "hf", version=3 if model == "v3" else 2,
                                 q_lora_rank=None if model == "v2-q-full" else 32))
    lora = {"rank": 4, **({"targets": targets} if targets else {})}
    spec = spec_from_dict({
        "task": "finetune", "model": {"init_from": str(hf_dir)}, "finetune": {"method": "lora", "lora": lora},
        "data": {"tokens_total": 1e6, "seq_len": 64}, "training": {"global_batch_tokens": 4 * 64, "micro_batch": 1},
        "hardware": {"accelerator": "A100-80GB", "gpus_per_node": 1, "num_nodes": 1},
        "budget": {"target_days": None, "num_gpus": 1}})
    with torch.device("meta"):
        built = Transformer(model_args_from_spec(spec.model, max_seq_len=64))
    apply_lora(built, targets=list(spec.finetune.lora.targets), rank=4, alpha=8.0, dropout=0.0)
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    assert adapter_params(plan_inputs(spec)) == trainable > 0



def _dpo_full_spec():
    return spec_from_dict({
        "task": "finetune", "model": LLAMA3_70B, "finetune": {"method": "dpo", "dpo": {"weights": "full"}},
        "data": {"tokens_total": 1e8, "seq_len": 2048},
        "training": {"global_batch_tokens": 64 * 2048, "micro_batch": 1, "activation_checkpointing": "full"},
        "precision": {"compute": "bf16"}, "hardware": {"accelerator": "H100-SXM", "gpus_per_node": 8, "num_nodes": 8},
        "parallelism": {"data_parallel": 64, "zero_stage": 3}, "budget": {"target_days": None, "num_gpus": 64}})


@pytest.mark.parametrize("example", ["qlora-70b.yaml", "dpo-full", "llama3-8b-h100.yaml"])
def test_plan_json_hardware_flops_are_the_ones_the_hfu_is_priced_on(example: str) -> None:
    """plan.json's `compute.hardware_flops_per_token` is what the step time and HFU count: for LoRA/QLoRA without
    the frozen base's weight gradients and with the adapters', for DPO with the reference model's forward."""
    from pathlib import Path

    from leantrain.plan.planner import build_plan
    from leantrain.spec import load_spec

    spec = (_dpo_full_spec() if example == "dpo-full" else
            load_spec(Path(__file__).resolve().parents[1] / "examples" / example))
    plan = build_plan(spec)
    data = plan.to_json()
    inputs, layout = plan.inputs, plan.chosen.layout
    hardware = data["compute"]["hardware_flops_per_token"]
    assert hardware == pytest.approx(inputs.hardware_flops_per_token(layout.recompute))
    assert (hardware != pytest.approx(inputs.flops.hardware(layout.recompute, early_stop=inputs.recompute_skips_down))
            ) == (example != "llama3-8b-h100.yaml")  # the model alone for pre-training only
    throughput = data["throughput"]
    peak_all = inputs.peak_flops * layout.num_gpus
    assert throughput["hfu"] == pytest.approx(hardware * throughput["tokens_per_s"] / peak_all)


def _lora_saved_bytes(targets: list[str], *, layers: int, seq_len: int) -> tuple[float, float]:
    """(bytes autograd saves in one forward of the trainer's LoRA model, the logits' bytes the step holds):
    fp32, one sequence, every storage once (parameters excluded)."""
    import torch

    from leantrain.model import build_model, model_args_from_spec
    from leantrain.model.lora import apply_lora

    spec = spec_from_dict({"model": {**_TINY, "n_layers": layers}, "data": {"tokens_total": 1e6, "seq_len": seq_len},
                           "training": {"global_batch_tokens": seq_len}, "precision": {"compute": "fp32"}})
    model = build_model(model_args_from_spec(spec.model, max_seq_len=seq_len), device=torch.device("cpu"), seed=0)
    apply_lora(model, targets=targets, rank=8, alpha=16.0, dropout=0.0)
    own = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, _TINY["vocab_size"], (1, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    return float(sum(saved.values())), float(logits.numel() * logits.element_size())


def _lora_planned_bytes(targets: list[str], *, layers: int, seq_len: int) -> float:
    from leantrain.plan.memory import stage_memory

    spec = spec_from_dict({
        "task": "finetune", "model": {**_TINY, "n_layers": layers},
        "finetune": {"method": "lora", "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": targets}},
        "data": {"tokens_total": 1e6, "seq_len": seq_len}, "training": {"global_batch_tokens": seq_len},
        "precision": {"compute": "fp32"}, "plan": {"kernels": "eager"}})
    layout = Layout(dp=1, tp=1, pp=1, zero=0, micro_batch=1, recompute="none")
    return stage_memory(plan_inputs(spec), layout, stage=0, num_microbatches=1).activations


_TINY = {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 256, "vocab_size": 512, "tie_embeddings": False}


@pytest.mark.parametrize("targets", [["wq", "wk", "wv", "wo", "w1", "w2", "w3"], ["wq", "wv"], ["w1", "w2", "w3"]])
def test_lora_activations_are_what_the_frozen_model_saves(targets: list[str]) -> None:
    """A frozen base keeps less than full training: a frozen matmul keeps its weight, not its input, and a frozen
    norm does not keep the normalised tensor its weight's gradient reads. Per layer (two depths cancel the rest)
    the plan equals the saved bytes for every target set; it was 1.13x (all seven) to 1.25x (wq, wv) before the
    frozen tensors were taken off. With a query/key/value adapter the whole forward is planned to the byte but
    for the int64 targets cross-entropy keeps (8 B a token, not planned), with the logits the step holds
    (KEEPS_COMPUTE_LOGITS) added to the saved bytes; without one the first block's attention keeps nothing,
    which the plan does not count (it stays above)."""
    seq = 128
    measured = {n: _lora_saved_bytes(targets, layers=n, seq_len=seq) for n in (1, 2)}
    planned = {n: _lora_planned_bytes(targets, layers=n, seq_len=seq) for n in (1, 2)}
    assert planned[2] - planned[1] == pytest.approx(measured[2][0] - measured[1][0], abs=1)
    whole = measured[1][0] + measured[1][1] - 8 * seq  # the int64 targets are saved, not planned
    if {"wq", "wk", "wv"} & set(targets):
        assert planned[1] == pytest.approx(whole, abs=16)
    else:
        assert planned[1] > whole
