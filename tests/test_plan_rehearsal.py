"""The planner's memory held to `leantrain rehearse` (the trainer itself under a fake process group and fake
tensors) on a small grid of layouts: a Llama-3-8B-wide model cut to 4 layers, rank 0 of each world.
bench/plan_vs_rehearsal.py runs the whole grid (13 layouts, bench/RESULTS.md); these pin one layout per
mechanism: ZeRO-2's gathered stage, TP with the vocabulary-parallel loss (TP2, and TP8 where the loss's
backward and the sequence-parallel gathered inputs weigh most), a pipeline's first stage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan_vs_rehearsal.py"
TOLERANCE = 0.10  # the issue's ±10 % per category


def _bench():
    spec = importlib.util.spec_from_file_location("plan_vs_rehearsal", BENCH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


# The pipeline row: temp 0.67 while plan.memory.PIPELINE_HOLDS_UNSHARDED is off (0.94 with it).
PIPELINE_GAP = pytest.mark.xfail(strict=True, reason="torch pipelining's unsharded gradients not planned yet")
# TP8's activations are 0.86 while plan.activations.SP_GATHERED_PLANNED is off (0.99 with it).
SP_GAP = pytest.mark.xfail(strict=True, reason="sequence parallelism's gathered inputs are not planned yet")


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp8 zero2 selective", "fsdp4 tp2", pytest.param("fsdp2 tp8", marks=SP_GAP),
                                  pytest.param("fsdp4 pp2 1f1b", marks=PIPELINE_GAP)])
def test_plan_matches_the_rehearsal_per_category(name: str) -> None:
    bench = _bench()
    dp, tp, pp, zero, schedule, virtual, recompute, extra = bench.GRID[name]
    spec = bench.spec_for(dp, tp, pp, zero, schedule, virtual, recompute, extra)
    measured, plan = bench.compare(spec)
    off = {c: plan[c] / measured[c] for c in bench.CATEGORIES if measured[c] > 2**20}
    bad = {c: round(r, 3) for c, r in off.items() if abs(r - 1) > TOLERANCE}
    assert not bad, (name, bad)
