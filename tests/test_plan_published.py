"""The planner against published numbers (sources cited per case; docs/plan.md explains each).

1. GPU-hours at a run's reported MFU (or achieved FLOP/s per GPU) reproduce its reported GPU-hours or
   step time within ±10%: the FLOP count per token and the budget arithmetic are right.
The step-time model is checked out of sample against the published-runs data file in
tests/test_plan_calibration.py (a fit checked on its own data would only be a regression check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from leantrain.plan.budget import SECONDS_PER_DAY, days_for_gpus
from leantrain.plan.inputs import plan_inputs
from leantrain.spec import spec_from_dict

A100, H100 = 312e12, 989.5e12


def gpt(layers: int, d: int, heads: int) -> dict[str, Any]:
    """GPT-style shape (4h GeLU MLP = 8h² weights, the SwiGLU hidden that gives the same count: 8h/3)."""
    return {"n_layers": layers, "d_model": d, "n_heads": heads, "n_kv_heads": heads,
            "ffn_hidden": round(8 * d / 3), "vocab_size": 51200, "tie_embeddings": True}


def mpt(layers: int, d: int, heads: int) -> dict[str, Any]:
    return {**gpt(layers, d, heads), "vocab_size": 50368}


LLAMA3_8B = {"n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336,
             "vocab_size": 128256}
LLAMA3_70B = {"n_layers": 80, "d_model": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden": 28672,
              "vocab_size": 128256}
LLAMA3_405B = {"n_layers": 126, "d_model": 16384, "n_heads": 128, "n_kv_heads": 8, "ffn_hidden": 53248,
               "vocab_size": 128256}
# Squared-ReLU MLP of 73,728 (2 matrices) = SwiGLU hidden 49,152 (3 matrices) in weights and FLOPs.
NEMOTRON4_340B = {"n_layers": 96, "d_model": 18432, "n_heads": 96, "n_kv_heads": 8, "ffn_hidden": 49152,
                  "vocab_size": 256000}


def inputs_for(model: dict[str, Any], *, seq_len: int, accelerator: str = "H100-SXM", gbs_seqs: int = 1):
    spec = spec_from_dict({"model": model, "data": {"tokens_total": 1e12, "seq_len": seq_len},
                           "training": {"global_batch_tokens": gbs_seqs * seq_len},
                           "hardware": {"accelerator": accelerator}})
    return plan_inputs(spec)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: dict[str, Any]
    seq_len: int
    tokens: float
    gpus: int
    achieved_flops_per_gpu: float  # reported MFU × peak, or reported achieved FLOP/s per GPU
    counts_recompute: bool  # the source's FLOP/s include full recomputation (Megatron's 8·T·P)
    reported_gpu_hours: float


RUNS = [
    Run("GPT-3 175B, 300B tokens", "Narayanan et al. 2021 (Megatron-LM, SC21) §5.1: 1024 A100 at 140 TFLOP/s "
        "→ 34 days", gpt(96, 12288, 96), 2048, 300e9, 1024, 140e12, True, 34 * 24 * 1024),
    Run("GPT 1T, 450B tokens", "Narayanan et al. 2021 §5.1: 3072 A100 at 163 TFLOP/s → 84 days",
        gpt(128, 25600, 160), 2048, 450e9, 3072, 163e12, True, 84 * 24 * 3072),
    Run("Llama 3.1 405B, 15.6T tokens", "Llama 3 paper (Dubey et al. 2024) Table 4: 400 TFLOP/s per GPU "
        "(41% MFU) on 16,384 H100; 30.84M GPU-hours (Llama 3.1 model card)",
        LLAMA3_405B, 8192, 15.6e12, 16384, 400e12, False, 30.84e6),
    Run("Nemotron-4 340B, one step", "Nemotron-4 340B report (NVIDIA 2024) Table 2: 6144 H100, batch 2304 × "
        "4096, 8.0 s per iteration, 41% MFU", NEMOTRON4_340B, 4096, 2304 * 4096, 6144, 0.41 * H100, False,
        6144 * 8.0 / 3600),
    Run("Llama 3 8B, torchtitan", "torchtitan docs/performance.md: 64 A100, FSDP, seq 8192, 2973 tokens/s "
        "per GPU at 58.2% MFU", LLAMA3_8B, 8192, 1e9, 64, 0.582 * A100, False, 1e9 / 2973 / 3600),
    Run("Llama 3 70B, torchtitan", "torchtitan docs/performance.md: 64 A100, FSDP, full AC, 323 tokens/s per "
        "GPU at 50.5% MFU", LLAMA3_70B, 8192, 1e9, 64, 0.505 * A100, False, 1e9 / 323 / 3600),
    Run("MPT-70B, LLM Foundry", "mosaicml/llm-foundry scripts/train/benchmarking/README.md: 64 H100, seq 2048, "
        "1039 tokens/s per GPU at 42.57% MFU", mpt(80, 8192, 64), 2048, 1e9, 64, 0.4257 * 989e12, False,
        1e9 / 1039 / 3600),
    Run("MPT-7B, LLM Foundry", "same table: 8 H100, seq 2048, 10643 tokens/s per GPU at 46.44% MFU",
        mpt(32, 4096, 32), 2048, 1e9, 8, 0.4644 * 989e12, False, 1e9 / 10643 / 3600),
    Run("MPT-30B, LLM Foundry", "same table: 8 H100, seq 8192, 1384 tokens/s per GPU at 29.92% MFU",
        mpt(48, 7168, 64), 8192, 1e9, 8, 0.2992 * 989e12, False, 1e9 / 1384 / 3600),
]


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_gpu_hours_at_reported_mfu(run: Run) -> None:
    inputs = inputs_for(run.model, seq_len=run.seq_len)
    per_token = inputs.flops.hardware("full") if run.counts_recompute else inputs.flops.model
    days = days_for_gpus(total_flops=per_token * run.tokens, flops_per_gpu_s=run.achieved_flops_per_gpu,
                         num_gpus=run.gpus)
    gpu_hours = days * 24 * run.gpus
    assert gpu_hours == pytest.approx(run.reported_gpu_hours, rel=0.10), (run.source, gpu_hours)


def test_megatron_formula_is_ours_with_full_recompute() -> None:
    """Megatron's 96·l·h²·(1 + s/6h + V/16lh) per token = our hardware FLOPs with full recompute, except that
    we also count recomputing the output layer (8·V·h instead of 6·V·h)."""
    layers, h, s, v = 96, 12288, 2048, 51200
    inputs = inputs_for(gpt(layers, h, 96), seq_len=s)
    megatron = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    assert inputs.flops.hardware("full") - 2 * v * h == pytest.approx(megatron, rel=1e-3)


def test_days_follow_gpu_count() -> None:
    assert days_for_gpus(total_flops=SECONDS_PER_DAY * 8e14, flops_per_gpu_s=1e14, num_gpus=8) == pytest.approx(1.0)
