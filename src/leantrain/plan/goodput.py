"""Whole-run time: the step-time prediction divided by the expected goodput, plus held-out evaluation, and a
warning with what would help when checkpointing and failures eat more than 10 % of the run.

- goodput (plan/budget.py): Daly's model of save stalls, lost work and restarts at the job's MTBF.
- evaluation share: `training.eval_batches` forward-only micro-batches (a third of a training micro-batch's
  compute each) every `training.eval_every` steps.
- whole-run efficiency (`plan.whole_run_efficiency`, default plan/inputs.py): the share of the remaining
  GPU time that is steady steps (ramps, rollbacks, stragglers and stalls take the rest), fitted on
  published whole runs.
- whole run = steps × step time × (1 + eval share) / goodput / whole-run efficiency. The pure step-time
  prediction is reported beside it (`time.predicted_days`), never mixed.
- below `LOW_GOODPUT` the plan says which change raises it and by how much, each recomputed with the same
  model: asynchronous saves (only the device-to-host copy blocks, and the wait for the previous write), a 4×
  faster store, in-memory checkpoints (a failure restores from a peer's memory, so the restart is shorter) and
  a 60 s restart where `fault.restart_s` is longer.
"""

from __future__ import annotations

from typing import Any

from leantrain.plan.budget import SECONDS_PER_DAY, checkpoint_interval, write_bandwidth_gb_s
from leantrain.plan.inputs import DEFAULT_WHOLE_RUN_EFFICIENCY, PlanInputs
from leantrain.plan.layout import Layout
from leantrain.spec.schema import JobSpec

LOW_GOODPUT = 0.90
FASTER_STORE = 4.0
IN_MEMORY_RESTART_SHARE = 0.5  # restoring from host/peer memory skips the storage read of a restart
FAST_RESTART_S = 60.0  # a restart with hot spares and a warm image (the remedy priced when fault.restart_s is above it)


def eval_share(spec: JobSpec, *, step_s: float, num_microbatches: int) -> float:
    """Evaluation time as a share of training time."""
    t = spec.training
    if t.eval_every <= 0 or step_s <= 0:
        return 0.0
    eval_s = t.eval_batches * step_s / max(num_microbatches, 1) / 3
    return eval_s / (t.eval_every * step_s)


def whole_run(spec: JobSpec, inputs: PlanInputs, *, num_gpus: int, step_s: float, num_microbatches: int,
              tokens_per_s: float, checkpoint: dict[str, float], layout: Layout | None = None) -> dict[str, Any]:
    """Whole-run days and GPU-hours, the goodput and eval share, and warnings with remedies."""
    goodput = checkpoint["expected_goodput"]
    share = eval_share(spec, step_s=step_s, num_microbatches=num_microbatches)
    efficiency = spec.plan.whole_run_efficiency or DEFAULT_WHOLE_RUN_EFFICIENCY
    pure_s = inputs.tokens_total / tokens_per_s
    wall_s = pure_s * (1 + share) / goodput / efficiency if goodput > 0 else float("inf")
    out: dict[str, Any] = {"whole_run_days": wall_s / SECONDS_PER_DAY,
                           "whole_run_gpu_hours": wall_s / 3600 * num_gpus, "expected_goodput": goodput,
                           "eval_share": share, "whole_run_efficiency": efficiency, "warnings": []}
    if goodput < LOW_GOODPUT:
        out["warnings"].append(_low_goodput_warning(spec, inputs, num_gpus=num_gpus, step_s=step_s,
                                                    checkpoint=checkpoint, layout=layout))
    return out


def _low_goodput_warning(spec: JobSpec, inputs: PlanInputs, *, num_gpus: int, step_s: float,
                         checkpoint: dict[str, float], layout: Layout | None) -> str:
    options = []
    ck, fault = spec.checkpoint, spec.fault
    if ck.interval_steps != "auto":
        options.append(("checkpoint.interval_steps: auto", spec.model_copy(update={
            "checkpoint": ck.model_copy(update={"interval_steps": "auto"})})))
    if not ck.async_save:
        options.append(("checkpoint.async_save: true", spec.model_copy(update={
            "checkpoint": ck.model_copy(update={"async_save": True, "interval_steps": "auto"})})))
    bandwidth = write_bandwidth_gb_s(spec, num_gpus=num_gpus)
    options.append((f"a {FASTER_STORE:.0f}× faster store (checkpoint.write_bandwidth_gb_s: "
                    f"{bandwidth * FASTER_STORE:g})", spec.model_copy(update={
                        "checkpoint": ck.model_copy(update={"write_bandwidth_gb_s": bandwidth * FASTER_STORE,
                                                            "interval_steps": "auto"})})))
    options.append(("in-memory checkpoints (async staging, restore from a peer's memory)", spec.model_copy(
        update={"checkpoint": ck.model_copy(update={"async_save": True, "interval_steps": "auto"}),
                "fault": fault.model_copy(update={"restart_s": fault.restart_s * IN_MEMORY_RESTART_SHARE})})))
    if fault.restart_s > FAST_RESTART_S:
        options.append((f"a {FAST_RESTART_S:g} s restart (fault.restart_s: {FAST_RESTART_S:g}: hot spares, a warm "
                        "image and the fast tier's restore)", spec.model_copy(update={
                            "fault": fault.model_copy(update={"restart_s": FAST_RESTART_S})})))
    parts = []
    for label, alt in options:
        g = checkpoint_interval(alt, inputs, num_gpus=num_gpus, step_s=step_s, layout=layout)["expected_goodput"]
        parts.append(f"{label} → {g:.0%}")
    causes = [name for name, is_default in (
        ("checkpoint.async_save: false", not ck.async_save and "async_save" not in ck.model_fields_set),
        (f"checkpoint.write_bandwidth_gb_s_per_node: {ck.write_bandwidth_gb_s_per_node:g}",
         ck.write_bandwidth_gb_s is None and "write_bandwidth_gb_s_per_node" not in ck.model_fields_set),
        (f"fault.restart_s: {fault.restart_s:g}", "restart_s" not in fault.model_fields_set),
        ("fault.failures_per_gpu_day (Llama 3's rate)", fault.failures_per_gpu_day is None)) if is_default]
    blame = f" Defaults in play: {', '.join(causes)}." if causes else ""
    restart = spec.fault.restart_s + checkpoint.get("durability_lag_s", 0.0)
    return (f"expected goodput {checkpoint['expected_goodput']:.0%} (save blocks {checkpoint['blocking_s']:.3g} s, "
            f"every {checkpoint['interval_s']:.3g} s, and each failure costs a {restart:.3g} s restart and half an "
            f"interval, against an MTBF of {checkpoint['mtbf_s'] / 3600:.2g} h): checkpointing and failures take "
            "more than 10 % of the run." + blame + " Would raise it: " + "; ".join(parts))
