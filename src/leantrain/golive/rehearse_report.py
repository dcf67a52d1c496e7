"""rehearsal.json from what `leantrain rehearse` watched (golive/rehearse.py runs the ranks): memory by
category, collectives per step by mesh axis and plane, host syncs by site, startup reads, the plan for the same
stage; and the table the command prints. The contract is docs/rehearse.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError
from leantrain.golive.rehearse_probes import FileReads, Probes, StepLog
from leantrain.spec.schema import JobSpec

# Step 1 warms up (optimizer states appear); step 2 is steady and logs: the trainer's `_log` is recorded apart
# (`LOGGING` below), so step 2 is the steady step and step 2 with its logging the logging step (the step itself does
# not depend on whether it logs). A third step cost a third of a rank's rehearsal and showed nothing more.
STEPS = 2
LOGGING = "logging"  # the phase the logging call is recorded into
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "temp")


def memory_categories(peak: dict[str, int], resident: dict[str, int]) -> dict[str, int]:
    """rehearsal.json's categories: resident state measured from the tensors, the peak and its activations from
    MemTracker, and `temp` what else was live at the peak (activation gradients, gathered weights, buffers).

    MemTracker learns of optimizer states through its hook after `optimizer.step()`: the states step 1 made
    (before the tracked step 2) are unknown to it until step 2's update, after the forward/backward peak, so
    its peak snapshot lacks them (`Optstate` 0). They are live through the whole step, so they are added to
    the peak here (what the snapshot did count of them is not added twice)."""
    untracked_states = max(0, int(resident.get("optimizer", 0)) - int(peak.get("Optstate", 0)))
    total = int(peak.get("Total", 0)) + untracked_states
    activations = int(peak.get("Activation", 0))
    state = resident.get("params", 0) + resident.get("grads", 0) + resident.get("optimizer", 0)
    return {**{k: int(resident.get(k, 0)) for k in ("params", "grads", "optimizer")},
            "activations": activations, "temp": max(0, total - state - activations), "peak": max(total, state)}


def _collectives(log: StepLog, *, labels: dict[str, str], control: bool) -> list[dict[str, Any]]:
    rows = []
    for (op, raw_group, is_control), (count, num_bytes) in sorted(log.collectives.items()):
        group = labels.get(raw_group, raw_group if raw_group in labels.values() else "control")
        if is_control == control:
            rows.append({"op": op, "group": group, "count": count, "bytes": num_bytes})
    return merge_collectives(rows)


def merge_collectives(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the same (op, group) as one, their calls and bytes added."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        entry = merged.setdefault((row["op"], row["group"]), {"op": row["op"], "group": row["group"], "count": 0,
                                                              "bytes": 0})
        entry["count"] += row["count"]
        entry["bytes"] += row["bytes"]
    return list(merged.values())


def _count(rows: list[dict[str, Any]]) -> int:
    return sum(r["count"] for r in rows)


def per_step(probes: Probes, *, labels: dict[str, str], control_window: int) -> dict[str, Any]:
    steady, control = probes.phase(f"step{STEPS}"), probes.phase("control")
    logging = steady.plus(probes.phase(LOGGING))
    control_rows = _collectives(steady, labels=labels, control=True)
    window_rows = _collectives(control, labels=labels, control=True)
    logging_rows = _collectives(logging, labels=labels, control=True)
    sites = sorted({site for log in (steady, logging) for site in log.syncs})
    return {
        "collectives_per_step": _collectives(steady, labels=labels, control=False),
        "control_collectives_per_step": _count(control_rows) + _count(window_rows) / control_window,
        "control_collectives": {"step": control_rows, "logging_step": logging_rows,
                                f"checkpoint_manager_over_{control_window}_steps": window_rows},
        "host_syncs_per_step": sum(steady.syncs.values()),
        "host_syncs_per_logging_step": sum(logging.syncs.values()),
        "host_sync_sites": sites,
        "host_sync_counts": {"step": dict(steady.syncs), "logging_step": dict(logging.syncs)},
    }


def slope_record(slope: Any, *, labels: dict[str, str]) -> dict[str, Any]:
    """rehearsal.json's `microbatch_slope` of a rank: what one more micro-batch adds to its step (the logging
    step's extra host syncs are the step's: the logging call does not depend on the micro-batch count)."""
    log = slope.log()
    memory = slope.memory()
    activations, total = memory["Activation"], memory["Total"]
    return {"memory_bytes": {"activations": activations, "temp": total - activations, "peak": total},
            "collectives_per_step": _collectives(log, labels=labels, control=False),
            "host_sync_counts": {"step": dict(log.syncs), "logging_step": dict(log.syncs)}}


def startup_record(files: FileReads, log: StepLog, *, labels: dict[str, str], startup_s: float) -> dict[str, Any]:
    opened = sorted(files.opened)
    return {
        "files_opened": len(opened),
        "bytes_read": files.bytes_read,
        "files": opened,
        "metadata_reads": sorted(p for p in opened if p.endswith((".json", ".metadata", ".idx", ".yaml"))),
        "collectives": _collectives(log, labels=labels, control=False),
        "control_collectives": _collectives(log, labels=labels, control=True),
        "host_syncs": sum(log.syncs.values()),
    }


def planned_memory(spec: JobSpec, *, world_size: int, num_microbatches: int,
                   stage: int | None = None) -> dict[str, float]:
    """The planner's per-GPU memory for this very layout (the heaviest stage, or `stage`), by rehearsal.json's
    categories (`temp` is the planner's buffers: gathered weights, logits' gradient, buckets). The framework
    reserve (CUDA context, NCCL, allocator slack) is left out of `temp` and `peak`, as bench/plan_vs_rehearsal.py
    leaves it out: a fake-tensor rehearsal cannot hold it; it is `reserve`, and the plan's total is peak + reserve."""
    from leantrain.plan.inputs import plan_inputs
    from leantrain.plan.layout import layout_from_spec
    from leantrain.plan.memory import memory_per_gpu, stage_memory

    layout = layout_from_spec(spec.parallelism, spec.training, num_gpus=world_size)
    inputs = plan_inputs(spec)
    memory = (memory_per_gpu(inputs, layout, num_microbatches=num_microbatches) if stage is None
              else stage_memory(inputs, layout, stage=stage, num_microbatches=num_microbatches))
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
            "activations": memory.activations, "temp": memory.temp, "peak": memory.total - memory.reserve,
            "reserve": memory.reserve, "stage": memory.stage}


def ratios_by_category(plan: dict[str, float], memory: dict[str, int]) -> dict[str, float | None]:
    return {k: (plan[k] / memory[k] if memory[k] else None) for k in (*MEMORY_KEYS, "peak")}


def largest_category(reports: list[dict[str, Any]], rank: int) -> str:
    memory = next(r for r in reports if r["rank"] == rank)["memory_bytes"]
    return max(MEMORY_KEYS, key=lambda k: memory[k])


def parse_ranks(text: str | None, *, world_size: int) -> list[int] | None:
    """`--ranks 0,last,17` → rank numbers (`last` is world − 1)."""
    if not text:
        return None
    ranks = []
    for part in text.split(","):
        part = part.strip()
        if part == "last":
            ranks.append(world_size - 1)
        elif part.lstrip("-").isdigit():
            ranks.append(int(part))
        else:
            raise UserInputError(f"--ranks: {part!r} is not a rank number or 'last' (e.g. --ranks 0,last,17)")
    return ranks


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def render(report: dict[str, Any], *, console: Any) -> None:
    """One row per rehearsed rank: memory by category, collectives, control calls, host syncs, files."""
    from rich.table import Table

    gib = 2**30
    table = Table(title=f"rehearsal: {report['layout']} on {report['accelerator']} "
                        f"({report['accelerator_memory_bytes'] / gib:.1f} GiB)",
                  caption="GiB per rank: state = params + grads + optimizer; colls, ctrl: collectives and "
                          "control-plane calls per step; syncs: host syncs per step / per logging step")
    for column in ("rank", "stage", "state", "act", "temp", "peak", "colls", "ctrl", "syncs", "files"):
        table.add_column(column, justify="right")
    for rank in report["ranks"]:
        mem = rank["memory_bytes"]
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        table.add_row(
            str(rank["rank"]), str(rank["pipeline_stage"]),
            *(f"{v / gib:.2f}" for v in (state, mem["activations"], mem["temp"], mem["peak"])),
            str(_count(rank["collectives_per_step"])), f"{rank['control_collectives_per_step']:.2f}",
            f"{rank['host_syncs_per_step']}/{rank['host_syncs_per_logging_step']}",
            str(rank["startup"]["files_opened"]))
    console.print(table)
    plan = report["plan"]
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in report["plan_vs_rehearsal"].items() if v is not None)
    console.print(f"plan per GPU: {plan['peak'] / gib:.2f} GiB (+ {plan['reserve'] / gib:.2f} GiB reserve); "
                  f"plan ÷ rehearsal (heaviest rank): {ratios}")
