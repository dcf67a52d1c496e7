"""The fast tier stops on every rank together: a collective that fails on one rank never leaves the others
waiting in the tier's next collective (ckpt/memory_tier.py, docs/checkpoints.md "The fast tier")."""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from leantrain.ckpt.memory_tier import MemoryTier
from parallel_harness import spawn_gloo

GROUP_TIMEOUT_S = 3.0  # the tier's group: a peer that never joins costs this much, not the shipped 120 s


def _ranks(root: str, fail_at: str) -> list[dict[str, Any]]:
    """Three ranks save at steps 1..3 as the hook does (a tier that reports itself disabled is dropped: that rank
    calls no save again). At step 1 rank 1's tier collective fails: with `fail_at` "agreement", the save's last
    agreement completes on every rank but raises on rank 1 (the peers saw it succeed); with "transfer", rank 1's
    peer transfer raises before it sends anything."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    tier: MemoryTier | None = MemoryTier(root=Path(root) / f"node-{rank}", rank=rank, world_size=world,
                                         peer_offset=1, process_group=group)
    real_gather, real_exchange, armed = dist.all_gather, tier._exchange, []

    def gather_then_fail(*args: Any, **kwargs: Any) -> Any:
        result = real_gather(*args, **kwargs)
        if armed:
            armed.clear()
            raise RuntimeError("simulated: the collective failed on this rank after the peers completed it")
        return result

    def exchange(*args: Any, **kwargs: Any) -> Any:
        if fail_at == "transfer":
            raise RuntimeError("simulated: the peer transfer failed on this rank")
        received = real_exchange(*args, **kwargs)
        armed.append(1)  # the next agreement (the save's last) fails here
        return received

    steps: list[dict[str, Any]] = []
    for step in (1, 2, 3):
        record: dict[str, Any] = {"step": step, "called": tier is not None}
        if tier is not None:
            if rank == 1 and step == 1:
                dist.all_gather, tier._exchange = gather_then_fail, exchange  # type: ignore[method-assign]
            outcome = tier.save(step, {"w": torch.full((4,), float(rank * 10 + step))}, meta={})
            record.update(ok=outcome.ok, error=outcome.error,
                          disabled=tier.disabled, files=sorted(p.name for f in tier.node_folders() if f.is_dir()
                                                               for p in f.iterdir()))
            dist.all_gather, tier._exchange = real_gather, real_exchange  # type: ignore[method-assign]
            if tier.disabled:
                tier = None
        steps.append(record)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, steps)  # the default group: not the tier's, never failed
    return everyone


def _both(root: str) -> dict[str, list[list[dict[str, Any]]]]:
    return {fail_at: _ranks(f"{root}/{fail_at}", fail_at) for fail_at in ("agreement", "transfer")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[dict[str, Any]]]]:
    """Both cases on one set of three processes (each case on a tier group of its own)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    out = tmp_path_factory.mktemp("tier_disable")
    return spawn_gloo(functools.partial(_both, str(out / "shm")), world_size=3, out_dir=out)


def _stopped_together(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every rank saved at the same steps and agreed after each save whether the tier is on; the save where
    each rank stopped (the same step everywhere), with nothing of the tier left on its node."""
    for step in range(3):
        called = {r[step]["called"] for r in ranks}
        assert len(called) == 1, f"step {step + 1}: some ranks saved and some did not: {ranks}"
        if called == {True}:
            assert len({r[step]["disabled"] is None for r in ranks}) == 1, \
                f"step {step + 1}: the ranks disagree whether the tier is on: {ranks}"
    assert not any(r[-1]["called"] for r in ranks), f"the tier is still on somewhere: {ranks}"
    stopped = [next(s for s in r if s["called"] and s["disabled"]) for r in ranks]
    assert len({s["step"] for s in stopped}) == 1, stopped
    assert all(not s["ok"] and s["files"] == [] for s in stopped), stopped
    return stopped


@pytest.mark.slow
def test_a_collective_failed_on_one_rank_stops_the_tier_on_every_rank_at_the_next_save_without_a_stall(
        runs: dict[str, Any]) -> None:
    # The old code: rank 1 alone turned the tier off at step 1; ranks 0 and 2 entered step 2's agreement
    # without it and waited the group's whole timeout (3 s here, 120 s shipped).
    ranks = runs["agreement"]
    stopped = _stopped_together(ranks)
    # the agreed reason on every rank, not each rank's own collective timing out (the old code's stall)
    assert stopped[0]["step"] == 2 and all("failed on rank 1 " in s["disabled"] for s in stopped), stopped
    assert not any("timed out" in s["disabled"].lower() for s in stopped), stopped


@pytest.mark.slow
def test_a_transfer_that_times_out_stops_the_tier_on_every_rank(runs: dict[str, Any]) -> None:
    # Rank 1's transfer fails at once; the ranks that send to it or receive from it wait the group's timeout, and
    # gloo closes the pairs that timed out: the group can agree nothing more, each rank's next agreement fails at
    # once, and every rank stops there (each naming itself), none waiting again.
    ranks = runs["transfer"]
    stopped = _stopped_together(ranks)
    assert stopped[0]["step"] == 2, stopped
    assert all(f"rank {rank}" in s["disabled"] for rank, s in enumerate(stopped)), stopped
    assert ranks[1][0]["error"] and "the peer transfer at step 1 failed" in ranks[1][0]["error"], ranks[1][0]
