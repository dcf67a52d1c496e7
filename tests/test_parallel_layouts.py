"""Equivalence of every layout with one process: same losses (1e-4 relative) and gradient norms, fp32.

Each layout trains the real model for STEPS steps with AdamW and clipping on the same seeded weights and
token batches (tests/parallel_harness.py). The 2-rank layouts share one set of processes; the 4-rank
compositions another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from parallel_harness import GLOBAL_SEQUENCES, SEQ_LEN, make_spec, reference_run, spawn_layouts

STEPS = 10
REL_TOL = 1e-4

TWO_RANK: dict[str, dict[str, Any]] = {
    "fsdp": {"data_parallel": 2},
    "hsdp": {"data_parallel": 2, "data_parallel_replicate": 2},
    "fsdp_cpu_offload": {"data_parallel": 2, "cpu_offload": True},
    "tp": {"tensor_parallel": 2},
    "tp_loss_parallel": {"tensor_parallel": 2, "loss_parallel": True},
    "pp_1f1b": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b"},
    "pp_gpipe": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"},
    "pp_interleaved": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2,
                       "n_layers": 4},
    "ep_moe": {"moe": True, "data_parallel": 2, "expert_parallel": 2},
    # no EP: every expert (and the shared one) split over TP instead of computed whole on both ranks
    "tp_moe": {"moe": True, "tensor_parallel": 2},
    # The MoE aux loss carried by each pipeline stage (a large coefficient, so a dropped term would show).
    "pp_moe_aux_loss": {"moe": True, "pipeline_parallel": 2, "pipeline_schedule": "1f1b", "aux_loss_coef": 1.0},
    # DeepSeek-shaped: latent attention (latents whole on each TP rank, up-projections split by heads) + MoE
    # with group-limited sigmoid routing, under TP (experts split by hidden dim), FSDP × EP, and PP.
    "mla_tp_moe": {"mla": True, "moe": True, "tensor_parallel": 2},
    "mla_fsdp_ep": {"mla": True, "moe": True, "data_parallel": 2, "expert_parallel": 2},
    "mla_pp": {"mla": True, "moe": True, "pipeline_parallel": 2, "pipeline_schedule": "1f1b"},
    # op-level selective recompute (model/transformer.py) under FSDP2's hooks, under TP's DTensors with sequence
    # parallelism (its reduce-scatters are kept) and inside a pipeline stage's backward
    "fsdp_op": {"data_parallel": 2, "recompute": "op"},
    "tp_sp_op": {"tensor_parallel": 2, "sequence_parallel": True, "recompute": "op"},
    "pp_op": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "recompute": "op"},
}
# bf16 compute through FSDP's MixedPrecisionPolicy: masters stay fp32, the loss tracks fp32 to bf16 accuracy.
BF16 = {"fsdp_bf16": {"data_parallel": 2, "compute": "bf16"}}
BF16_REL_TOL = 2e-2
FOUR_RANK: dict[str, dict[str, Any]] = {
    "fsdp_tp_tied": {"data_parallel": 2, "tensor_parallel": 2, "tie": True},
    "fsdp_pp": {"data_parallel": 2, "pipeline_parallel": 2},
    "tp_pp": {"tensor_parallel": 2, "pipeline_parallel": 2},
    # dp_mod_ep = 2: the routed experts get their own FSDP over the two ranks holding the same experts
    "fsdp_ep_sharded_experts": {"moe": True, "data_parallel": 4, "expert_parallel": 2},
    "mla_fsdp_tp_sp": {"mla": True, "data_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True},
    # EP × TP: each TP rank dispatches half the tokens; the experts' FSDP spans dp_mod_ep × tp. With the
    # aux loss (the harness's default balance) under loss parallel, and MLA without sequence parallelism under
    # full recompute (the kept all-to-all splits of the token split's share).
    "fsdp_tp_ep_sp": {"moe": True, "data_parallel": 2, "tensor_parallel": 2, "expert_parallel": 2,
                      "sequence_parallel": True, "loss_parallel": True},
    "mla_fsdp_tp_ep_full": {"mla": True, "moe": True, "data_parallel": 2, "tensor_parallel": 2, "expert_parallel": 2,
                            "sequence_parallel": False, "recompute": "full"},
}


def _assert_matches(name: str, got: dict[str, list[float]], kwargs: dict[str, Any]) -> None:
    ref = reference_run(make_spec(**kwargs), steps=STEPS)
    assert len(got["loss"]) == STEPS
    # MLA layouts at 1e-6: a shared RoPE key whose gradient is not summed over TP is off by ~1e-5 only.
    tol = 1e-6 if kwargs.get("mla") else REL_TOL
    for key in ("loss", "grad_norm"):
        for step, (mine, expected) in enumerate(zip(got[key], ref[key], strict=True)):
            assert mine == pytest.approx(expected, rel=tol), f"{name}: {key} differs at step {step}"
    assert ref["loss"][-1] < ref["loss"][0], "the reference must learn, or equal losses prove little"


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("two_rank")
    return spawn_layouts([*TWO_RANK.items(), *BF16.items()], world_size=2, steps=STEPS, out_dir=out)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_rank_layout_matches_one_process(name: str, two_rank: dict[str, dict[str, Any]]) -> None:
    _assert_matches(name, two_rank[name], TWO_RANK[name])


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_keeps_fp32_masters(two_rank: dict[str, dict[str, Any]]) -> None:
    got = two_rank["fsdp_bf16"]
    assert got["param_dtypes"] == ["torch.float32"]
    ref = reference_run(make_spec(), steps=STEPS)
    assert got["loss"] == pytest.approx(ref["loss"], rel=BF16_REL_TOL)
    assert got["loss"] != pytest.approx(ref["loss"], rel=1e-6), "bf16 compute should not be bitwise fp32"


@pytest.mark.slow
def test_expert_parallel_really_splits_experts(two_rank: dict[str, dict[str, Any]]) -> None:
    assert two_rank["ep_moe"]["local_experts"] == 2  # 4 experts over ep 2
    assert two_rank["tp_moe"]["local_experts"] == 4 and two_rank["tp_moe"]["expert_share"] == 0.5  # half of each
    assert two_rank["fsdp"]["local_experts"] is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "tp", "pp_1f1b", "ep_moe"])
def test_comm_time_is_measured(name: str, two_rank: dict[str, dict[str, Any]]) -> None:
    comm = two_rank[name]["comm"]
    assert comm["num_events"] > 0
    assert 0 < comm["comm_s"] < comm["step_s"]


@pytest.mark.heavy  # 80 s: `make test` keeps the two-rank layouts; CI runs this with `make test-heavy`
@pytest.mark.slow
def test_four_rank_compositions_match_one_process(tmp_path: Path) -> None:
    results = spawn_layouts(list(FOUR_RANK.items()), world_size=4, steps=STEPS, out_dir=tmp_path)
    for name, kwargs in FOUR_RANK.items():
        _assert_matches(name, results[name], kwargs)
    # 4 experts over ep 2 × dp_mod_ep 2: each rank keeps a quarter of every expert weight (and its Adam states)
    assert results["fsdp_ep_sharded_experts"]["expert_share"] == pytest.approx(1 / 4)
    # EP 2 × TP 2: rank 0 sends its experts half of its tokens' assignments (tokens × top-k × MoE layers ÷ tp),
    # where every TP rank sent them all before; it holds 1/4 of each weight (ep 2 × dp_mod_ep 1 × tp 2).
    tokens = GLOBAL_SEQUENCES // 2 * SEQ_LEN  # per data-parallel rank and step (dp 2)
    assert results["fsdp_tp_ep_sp"]["expert_rows_sent"] == tokens * 2 * 2 // 2
    assert results["fsdp_tp_ep_sp"]["expert_share"] == pytest.approx(1 / 4)
    assert results["fsdp_ep_sharded_experts"]["expert_rows_sent"] == GLOBAL_SEQUENCES // 4 * SEQ_LEN * 2 * 2
