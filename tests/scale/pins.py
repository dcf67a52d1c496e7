"""The scale lane's pins on a rehearsal (docs/rehearse.md): each returns what it found wrong, so a test can
assert a clean report on the real jobs and a non-empty one when a defect is planted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONTROL_PER_STEP_MAX = 1 / 50  # at most one control-plane collective every 50 steps by default


def memory_fits(report: dict[str, Any]) -> list[str]:
    return [f"rank {o['rank']}: {o['peak_bytes'] / 2**30:.1f} GiB > accelerator ({o['category']} largest)"
            for o in report["over_capacity"]]


def no_host_syncs(report: dict[str, Any]) -> list[str]:
    return [f"rank {r['rank']}: {r['host_syncs_per_step']} host syncs per step at {r['host_sync_counts']['step']}"
            for r in report["ranks"] if r["host_syncs_per_step"]]


def few_control_collectives(report: dict[str, Any]) -> list[str]:
    return [f"rank {r['rank']}: {r['control_collectives_per_step']:.3f} control collectives per step "
            f"({r['control_collectives']})"
            for r in report["ranks"] if r["control_collectives_per_step"] > CONTROL_PER_STEP_MAX]


def collective_counts(report: dict[str, Any]) -> dict[tuple[int, str, str, str], int]:
    """(pipeline stage, plane, op, group) → calls per step (data and control plane), to compare world sizes."""
    counts = {}
    for r in report["ranks"]:
        for plane, rows in (("data", r["collectives_per_step"]), ("control", r["control_collectives"]["step"])):
            counts.update({(r["pipeline_stage"], plane, c["op"], c["group"]): c["count"] for c in rows})
    return counts


def same_collectives_at_both_sizes(small: dict[str, Any], large: dict[str, Any]) -> list[str]:
    """Collectives per step do not grow with the world: the same calls at two world sizes."""
    a, b = collective_counts(small), collective_counts(large)
    return [f"{key}: {a.get(key, 0)} calls at {small['world_size']} ranks, {b.get(key, 0)} at {large['world_size']}"
            for key in sorted(set(a) | set(b)) if a.get(key, 0) != b.get(key, 0)]


def collectives_bounded_by_layers(report: dict[str, Any], *, units_per_rank: int) -> list[str]:
    """O(layers): a bounded number of calls per unit (a block, the embedding, the head) and micro-batch — FSDP's
    gather, re-gather and reduce-scatter, TP's sequence-parallel gathers and scatters in forward, backward and
    recompute, EP's all-to-alls — plus the pipeline's sends and receives; nothing that grows with the ranks."""
    per_unit = 16
    limit = per_unit * units_per_rank * report["num_microbatches"] + 4 * report["num_microbatches"] + 16
    return [f"rank {r['rank']}: {sum(c['count'] for c in r['collectives_per_step'])} collectives per step > {limit}"
            for r in report["ranks"] if sum(c["count"] for c in r["collectives_per_step"]) > limit]


def startup_files_do_not_grow(small: dict[str, Any], large: dict[str, Any]) -> list[str]:
    """Files a rank opens at startup depend on what it owns, not on how many ranks there are."""
    a = {r["pipeline_stage"]: r["startup"]["files_opened"] for r in small["ranks"]}
    b = {r["pipeline_stage"]: r["startup"]["files_opened"] for r in large["ranks"]}
    return [f"stage {s}: {a[s]} files at {small['world_size']} ranks, {b[s]} at {large['world_size']}"
            for s in a if s in b and b[s] != a[s]]
