"""A LoRA/QLoRA checkpoint holds the adapters and their optimizer state only (the frozen base is referenced by
hash, not saved): the plan's checkpoint size, save time and interval follow from that; full fine-tuning saves
every parameter as pretraining does."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.hardware import GB
from leantrain.plan.planner import make_plan
from leantrain.spec import load_spec

QLORA_70B = Path(__file__).resolve().parents[1] / "examples" / "qlora-70b.yaml"
# The example: a Llama-3-70B shape, rank-64 adapters on wq wk wv wo w1 w2 w3, bf16 weights, fp32 Adam moments.
D, KV, F, R, LAYERS = 8192, 1024, 28672, 64, 80
ADAPTERS = LAYERS * R * (2 * (D + D) + 2 * (D + KV) + 3 * (D + F))
BYTES_PER_TRAINED_PARAM = 2 + 2 * 4  # bf16 weight (no separate master) + two fp32 moments


def _plan(method: str) -> dict:
    spec = load_spec(QLORA_70B)
    spec = spec.model_copy(update={"finetune": spec.finetune.model_copy(update={"method": method})})
    return make_plan(spec)


def test_qlora_70b_checkpoint_is_the_adapters_and_their_states() -> None:
    plan = _plan("qlora")
    ckpt = plan["storage"]["checkpoint_bytes"]
    assert ckpt == pytest.approx(ADAPTERS * BYTES_PER_TRAINED_PARAM)  # 828 M adapter parameters: 8.3 GB
    full = _plan("full")
    base_params = full["storage"]["checkpoint_bytes"] / BYTES_PER_TRAINED_PARAM
    assert base_params == pytest.approx(70.55e9, rel=1e-3)  # full fine-tuning: every parameter, as before
    assert ckpt < full["storage"]["checkpoint_bytes"] / 50
    spec = load_spec(QLORA_70B)
    assert plan["storage"]["checkpoints_kept_bytes"] == pytest.approx(ckpt * spec.checkpoint.keep_last)
    # The save time and what it drives (the save stall, Daly's interval, goodput) use the adapters' bytes.
    from leantrain.plan.budget import write_bandwidth_gb_s

    bandwidth = write_bandwidth_gb_s(spec, num_gpus=plan["resources"]["layout_gpus"]) * GB
    assert plan["checkpoint"]["save_s"] == pytest.approx(ckpt / bandwidth)
    assert full["checkpoint"]["save_s"] == pytest.approx(full["storage"]["checkpoint_bytes"] / bandwidth)
    assert plan["checkpoint"]["recommended_interval_s"] < full["checkpoint"]["recommended_interval_s"] / 5
    assert plan["checkpoint"]["expected_goodput"] > full["checkpoint"]["expected_goodput"]


def test_lora_checkpoint_matches_qlora() -> None:
    """LoRA and QLoRA train the same adapters: the base's storage format (bf16 or NF4) is not in the checkpoint."""
    assert _plan("lora")["storage"]["checkpoint_bytes"] == pytest.approx(
        _plan("qlora")["storage"]["checkpoint_bytes"])
