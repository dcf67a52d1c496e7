"""Expert × tensor parallelism, rehearsed at 8 ranks (dp 4 with ep 2, tp 2) against the same job without TP.

The TP ranks of an ep group route the same tokens. Each now sends the experts only its share of them
(parallel/expert.py `TokenSplit`), so the all-to-all payload per rank halves at tp 2. The experts' states are
sharded over the TP peers as well, as the planner prices them. The job runs the trainer's whole step and log,
with the aux loss under loss parallelism, which had made the logged aux loss a DTensor that its all-reduce
refused at the first logging step.
"""

from __future__ import annotations

from typing import Any

import pytest
from pins import EXAMPLES

JOB = ("parallelism.data_parallel=4", "parallelism.expert_parallel=2", "parallelism.zero_stage=3",
       "hardware.accelerator=H100-SXM", "precision.compute=bf16", "training.global_batch_tokens=4096",
       "model.moe.balance=aux_loss", "model.tie_embeddings=false", "parallelism.loss_parallel=true")


def _rehearse(tp: int) -> dict[str, Any]:
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / "moe-small-cpu.yaml",
                     overrides=[*JOB, f"parallelism.tensor_parallel={tp}", f"hardware.gpus_per_node={4 * tp}"])
    return rehearse(spec, ranks=[0])  # in worker processes: the fake worlds leave nothing in this one


@pytest.fixture(scope="module")
def by_tp() -> dict[int, dict[str, Any]]:
    return {tp: _rehearse(tp) for tp in (1, 2)}


def _all_to_all_bytes(report: dict[str, Any]) -> int:
    return sum(c["bytes"] for c in report["ranks"][0]["collectives_per_step"]
               if c["op"] == "all_to_all" and c["group"] == "ep")


def test_each_tp_rank_sends_the_experts_its_share_of_the_tokens(by_tp: dict[int, dict[str, Any]]) -> None:
    one, two = _all_to_all_bytes(by_tp[1]), _all_to_all_bytes(by_tp[2])
    assert one > 1_000_000
    # The rows' payload halves; the per-expert counts each dispatch exchanges first (E numbers) do not.
    assert two <= one / 2 + 1024, (one, two)


def test_the_experts_states_are_sharded_over_tp_as_planned(by_tp: dict[int, dict[str, Any]]) -> None:
    groups = {c["group"] for c in by_tp[2]["ranks"][0]["collectives_per_step"] if c["op"] == "reduce_scatter"}
    assert "dp_mod_ep_tp" in groups  # the experts' gradients are summed over the TP peers' tokens
    for tp, report in by_tp.items():
        ratios = report["plan_vs_rehearsal"]
        for category in ("params", "grads", "optimizer"):
            assert ratios[category] == pytest.approx(1.0, abs=0.02), (tp, category, ratios)
    states = {tp: sum(r["memory_bytes"][c] for r in report["ranks"] for c in ("params", "grads", "optimizer"))
              for tp, report in by_tp.items()}
    assert states[2] < 0.6 * states[1]  # TP halves the dense weights, and now the experts' too
