"""Assemble a plan from a spec: budget → GPU count → layout (the spec's or the searched best) → memory,
step time, storage and checkpoint interval. `make_plan(spec)` returns plan.json's content.

Two FLOP counts are reported and kept apart: the *sizing* count (the rule of thumb 6·N·D on the nominal N by
default) sizes the GPU count, days and cost at `budget.assumed_mfu`; the *detailed* model count (matmuls
of the active weights + attention, plan.flops) is what MFU is measured against, in the planner's
throughput prediction and in the trainer's metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from leantrain.errors import UserInputError
from leantrain.hardware import CATALOG
from leantrain.plan.budget import (
    SECONDS_PER_DAY,
    Budget,
    checkpoint_interval,
    fast_tier,
    host_memory,
    make_budget,
    storage,
)
from leantrain.plan.goodput import whole_run
from leantrain.plan.inputs import PlanInputs, plan_inputs, sequences_per_step
from leantrain.plan.layout import layout_from_spec
from leantrain.plan.search import BATCH_UNEVEN, Candidate, SearchResult, evaluate, search_layouts
from leantrain.plan.uncertainty import range_dict, step_offsets, whole_run_offsets
from leantrain.spec.rules import batch_fix_hint
from leantrain.spec.schema import JobSpec


@dataclass
class Plan:
    """Everything the planner worked out; `to_json()` is plan.json."""

    spec: JobSpec
    inputs: PlanInputs
    budget: Budget
    layout_gpus: int
    chosen: Candidate
    layout_source: str
    search: SearchResult
    storage: dict[str, float]
    checkpoint: dict[str, float]
    what_if: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)  # whole-run time with goodput (plan/goodput.py)
    calibration: dict[str, Any] | None = None  # constants fitted to earlier runs (plan/calibrate.py)
    fast_tier: dict[str, Any] = field(default_factory=dict)  # the fast tier's memory per node (plan/budget.py)
    host_memory: dict[str, Any] = field(default_factory=dict)  # a node's host memory: ranks + fast tier (same)

    @property
    def fits(self) -> bool:
        return self.chosen.memory.fits

    def ranges(self) -> dict[str, dict[str, float]]:
        """P10/P50/P90 of the step time, the whole run's days and GPU-hours and its cost (plan/uncertainty.py):
        the step-time range of a given or a searched layout; the whole run's, wider unless the fleet's own
        whole-run efficiency is in the spec."""
        given = self.layout_source == "spec"
        step = step_offsets(layout_given=given, moe=self.inputs.shape.moe is not None)
        whole = whole_run_ranges(self.spec, self.inputs, self.run, layout_given=given)
        return {"throughput": range_dict("step_s", step, self.chosen.time.step_s),
                "time": {**whole["time"], "range_basis": whole["basis"]}, "cost": whole["cost"]}

    def to_json(self) -> dict[str, Any]:
        inputs, budget, chosen = self.inputs, self.budget, self.chosen
        shape = inputs.shape
        tokens = inputs.tokens_total
        t = chosen.time
        predicted_days = tokens / t.tokens_per_s / SECONDS_PER_DAY
        ranges = self.ranges()
        return {
            "model": {"total_params": shape.total_params(), "active_params": shape.active_params(),
                      "nominal_params": shape.nominal_params, "n_layers": shape.n_layers,
                      "d_model": shape.d_model, "vocab_size": shape.vocab_size},
            "compute": {
                "sizing": self.spec.budget.sizing_flops,
                "flops_per_token": budget.sizing_flops / tokens,
                "total_flops": budget.sizing_flops,
                "seed_total_flops": 6.0 * shape.nominal_params * tokens,
                "model_flops_per_token": inputs.flops.model,
                "model_total_flops": inputs.flops.model * tokens,
                "hardware_flops_per_token": inputs.hardware_flops_per_token(chosen.layout.recompute),
                "attention_flops_per_token": inputs.flops.attention,
                "tokens": tokens,
                "peak_flops_per_gpu": inputs.peak_flops,
                "assumed_mfu": self.spec.budget.assumed_mfu,
            },
            "resources": {"num_gpus": budget.num_gpus, "num_gpus_exact": budget.num_gpus_exact,
                          "num_gpus_with_spare": budget.num_gpus_with_spare, "layout_gpus": self.layout_gpus,
                          "num_nodes": math.ceil(budget.num_gpus_with_spare / inputs.gpus_per_node),
                          "accelerator": inputs.accelerator},
            "time": {"days": budget.days, "gpu_hours": budget.gpu_hours, "predicted_days": predicted_days,
                     "predicted_gpu_hours": predicted_days * 24 * self.layout_gpus,
                     **{k: v for k, v in self.run.items() if k != "warnings"}, **ranges["time"]},
            "cost": {"total": budget.cost, "per_million_tokens": budget.cost_per_million_tokens,
                     "currency": self.spec.budget.currency,
                     "price_per_gpu_hour": self.spec.budget.price_per_gpu_hour, **ranges["cost"]},
            "memory": {"per_gpu": chosen.memory.to_dict(), "capacity": chosen.memory.capacity,
                       "headroom": chosen.memory.headroom, "fits": chosen.memory.fits,
                       "stage": chosen.memory.stage},
            "layout": {**chosen.layout.to_dict(), "source": self.layout_source, "num_gpus": chosen.layout.num_gpus},
            "throughput": {"tokens_per_s": t.tokens_per_s, "mfu": t.mfu, "hfu": t.hfu, "step_s": t.step_s,
                           "tokens_per_step": t.tokens_per_step, "bubble_fraction": t.bubble_fraction,
                           "comm_fraction": t.comm_fraction, **ranges["throughput"],
                           "breakdown_s": {"compute": t.compute_s, "bubble": t.bubble_s, "tp": t.tp_comm_s,
                                           "pp": t.pp_comm_s, "dp": t.dp_comm_s, "ep": t.ep_comm_s,
                                           "moe_overhead": t.moe_overhead_s, "optimizer": t.optimizer_s}},
            "storage": self.storage,
            "checkpoint": self.checkpoint,
            "fast_tier": self.fast_tier,
            "host_memory": self.host_memory,
            "alternatives": [_candidate_json(c) for c in self.search.ranked],
            "search": {"evaluated": self.search.num_evaluated, "rejected": self.search.rejected,
                       "suggestions": self.search.suggestions},
            "what_if": self.what_if,
            "notes": self.notes,
            "warnings": [*self.run.get("warnings", []), *self.fast_tier.get("problems", []),
                         *self.host_memory.get("problems", [])],
            "calibration": self.calibration,
            "assumptions": self.assumptions(),
        }

    def assumptions(self) -> dict[str, Any]:
        """What the plan assumed where the spec left it open, with where each came from: the kernel set (it moves
        activations and the memory-bound passes), the loss kernel, the MLP, the compute dtype and the power limit."""
        spec, inputs = self.spec, self.inputs
        knobs, acc = spec.plan, CATALOG[inputs.accelerator]
        kernels = "fused" if inputs.fused_kernels else "eager"
        kernels_from = (f"plan.kernels: auto, training.compile: {str(spec.training.compile).lower()}"
                        if knobs.kernels == "auto" else f"plan.kernels: {knobs.kernels}")
        power = spec.hardware.power_w if spec.hardware.power_w is not None else acc.default_power_w or acc.tdp_w
        power_from = ("hardware.power_w" if spec.hardware.power_w is not None
                      else "the catalog's default limit" if acc.default_power_w is not None else "the TDP")
        return {"kernels": kernels, "kernels_from": kernels_from, "fused_loss": inputs.fused_loss,
                "mlp": inputs.shape.mlp, "compute": spec.precision.compute, "power_w": power, "tdp_w": acc.tdp_w,
                "power_from": power_from if power is not None else None, "power_factor": inputs.power_factor}


def _candidate_json(c: Candidate) -> dict[str, Any]:
    return {"layout": c.layout.to_dict(), "describe": c.layout.describe(), "tokens_per_s": c.time.tokens_per_s,
            "mfu": c.time.mfu, "step_s": c.time.step_s, "memory_total": c.memory.total,
            "headroom": c.memory.headroom, "fits": c.memory.fits, "why": c.why}


def layout_gpu_count(spec: JobSpec, budget: Budget) -> int:
    """GPUs the layout runs on: a fixed count as given, else the budget's count rounded up to whole nodes."""
    fixed = spec.budget.num_gpus or spec.hardware.num_gpus
    if fixed is not None:
        return fixed
    node = spec.hardware.gpus_per_node
    return budget.num_gpus if budget.num_gpus < node else math.ceil(budget.num_gpus / node) * node


def _batch_notes(spec: JobSpec, inputs: PlanInputs, chosen: Candidate, search: SearchResult, *,
                 source: str) -> list[str]:
    """Where the global batch does not split evenly over the searched layouts (the trainer gives every replica
    whole micro-batches), a batch and a GPU count that would: the search only ranks layouts that divide it."""
    if source != "search" or BATCH_UNEVEN not in search.rejected:
        return []
    gpus, seqs, node = search.num_gpus, sequences_per_step(inputs), inputs.gpus_per_node
    hint = batch_fix_hint(global_batch_tokens=inputs.global_batch_tokens, micro_batch=1, seq_len=inputs.seq_len,
                          data_parallel=gpus, micro_batches=False)
    counts = [c for c in range(node * math.ceil(gpus / node), 2 * gpus + 1, node) if c > gpus and seqs % c == 0]
    other = f", or plan {counts[0]} GPUs, which divide it" if counts else ""
    return [f"the best layout on {gpus} GPUs that splits the global batch ({seqs} sequences) evenly has "
            f"{chosen.layout.dp} data-parallel replicas (the trainer gives every replica whole micro-batches; "
            f"{search.rejected[BATCH_UNEVEN]} layout groups that do not divide it were refused): {hint} (a multiple "
            f"of {gpus} × {inputs.seq_len}){other}"]


MOE_OVERHEAD_NOTE_SHARE = 0.2  # a note says how to shrink the MoE layers' fixed time above this share of the step


def _moe_overhead_notes(inputs: PlanInputs, chosen: Candidate, *, spec_value: bool) -> list[str]:
    """Where the MoE layers' fixed time per micro-batch (timing.moe_overhead_s) is a large share of the step, what
    it is and what moves it."""
    t = chosen.time
    if t.moe_overhead_s <= MOE_OVERHEAD_NOTE_SHARE * t.step_s:
        return []
    source = "the spec's" if spec_value else "the default, fitted on Megatron/NeMo runs"
    return [f"MoE layers' fixed time is {t.moe_overhead_s / t.step_s:.0%} of the step "
            f"({inputs.moe_layer_overhead_s * 1e3:g} ms per MoE layer and micro-batch, plan.moe_layer_overhead_ms: "
            f"{source}): larger micro-batches pay it less often; a stack without the dispatcher's host sync "
            f"(CUDA-graphed, drop-and-pad) would set it lower"]


def whole_run_ranges(spec: JobSpec, inputs: PlanInputs, run: dict[str, Any], *,
                     layout_given: bool) -> dict[str, Any]:
    """The whole run's days and GPU-hours and its cost with their P10/P50/P90 (plan/uncertainty.py), the same for
    the plan and each what-if row: `time` and `cost` as plan.json names them, and the range's basis in words."""
    moe = inputs.shape.moe is not None
    fleet_known = spec.plan.whole_run_efficiency is not None
    whole = whole_run_offsets(layout_given=layout_given, fleet_known=fleet_known, moe=moe)
    hours, price = run.get("whole_run_gpu_hours", 0.0), spec.budget.price_per_gpu_hour
    basis = (("fleet's whole-run efficiency" if fleet_known else "published whole runs")
             + (", the spec's layout" if layout_given else ", a searched layout")
             + (", published MoE runs' step range" if moe else ""))
    return {"time": {**range_dict("days", whole, run.get("whole_run_days", 0.0)),
                     **range_dict("gpu_hours", whole, hours)},
            "cost": {"whole_run": hours * price, **range_dict("total", whole, hours * price)}, "basis": basis}


def choose_layout(spec: JobSpec, inputs: PlanInputs, gpus: int,
                  search: SearchResult) -> tuple[Candidate, str, list[str]]:
    """The layout a plan on `gpus` GPUs runs: the spec's where it covers them and fits, else the searched best
    (else the leanest, which does not fit); with its source and notes."""
    chosen, source, notes = None, "search", []
    par = spec.parallelism
    if par.layout == "spec" and par.world_size == gpus:
        own = evaluate(inputs, layout_from_spec(par, spec.training))
        if own.memory.fits or search.best is None:
            chosen, source = own, "spec"
        else:
            notes.append(f"the spec's layout ({own.layout.describe()}) needs {own.memory.total / 2**30:.1f} GiB "
                         f"of {own.memory.capacity / 2**30:.0f} GiB per GPU: using the searched best instead")
    elif par.layout == "spec" and par.world_size not in (1, gpus):
        notes.append(f"the spec's layout covers {par.world_size} GPUs, the plan {gpus}: using the searched best")
    if chosen is None:
        chosen = search.best or search.smallest
        source = "search" if search.best is not None else "none fits (leanest shown)"
    if chosen is None:  # no layout the trainer accepts at all (`search.rejected` says why)
        reasons = "; ".join(f"{n} × {why}" for why, n in search.rejected.items()) or "no candidate layout"
        raise UserInputError(f"no layout on {gpus} GPUs is one the trainer runs ({reasons}): choose another GPU "
                             "count, or a global batch that divides over it")
    return chosen, source, notes


def whole_run_on(spec: JobSpec, inputs: PlanInputs, gpus: int,
                 chosen: Candidate) -> tuple[dict[str, float], dict[str, Any]]:
    """The checkpoint interval (with its goodput) and the whole run (plan/goodput.py) of a layout on `gpus` GPUs."""
    ckpt = checkpoint_interval(spec, inputs, num_gpus=gpus, step_s=chosen.time.step_s, layout=chosen.layout)
    run = whole_run(spec, inputs, num_gpus=gpus, step_s=chosen.time.step_s, tokens_per_s=chosen.time.tokens_per_s,
                    num_microbatches=chosen.layout.num_microbatches(sequences_per_step(inputs)), checkpoint=ckpt,
                    layout=chosen.layout)
    return ckpt, run


def build_plan(spec: JobSpec) -> Plan:
    """The whole plan for a spec."""
    inputs = plan_inputs(spec)
    budget = make_budget(spec, inputs)
    gpus = layout_gpu_count(spec, budget)
    knobs = spec.plan
    search = search_layouts(inputs, gpus, max_micro_batch=knobs.max_micro_batch, top_k=knobs.top_k)
    chosen, source, notes = choose_layout(spec, inputs, gpus, search)
    notes.extend([*_batch_notes(spec, inputs, chosen, search, source=source),
                  *_moe_overhead_notes(inputs, chosen, spec_value=knobs.moe_layer_overhead_ms is not None)])
    ckpt, run = whole_run_on(spec, inputs, gpus, chosen)
    tier = fast_tier(spec, inputs, chosen.layout)
    return Plan(spec=spec, inputs=inputs, budget=budget, layout_gpus=gpus, chosen=chosen, layout_source=source,
                search=search, storage=storage(spec, inputs), checkpoint=ckpt, notes=notes, run=run,
                fast_tier=tier, host_memory=host_memory(spec, inputs, chosen.layout, tier))


def what_if_rows(plan: Plan, gpu_counts: list[int]) -> list[dict[str, Any]]:
    """Days, cost and fit for other GPU counts: the budget at the assumed MFU, and the whole run as the plan
    predicts it (its layout chosen, its checkpoints, goodput and ranges worked out as `build_plan` does, so that
    the row of the plan's own GPU count repeats the plan's figures). `predicted_days` is the step-time model
    alone (no goodput, evaluation or whole-run efficiency), with the step-time range."""
    rows = []
    spec, inputs, knobs = plan.spec, plan.inputs, plan.spec.plan
    for gpus in gpu_counts:
        budget = make_budget(spec, inputs, num_gpus=gpus)
        found = search_layouts(inputs, gpus, max_micro_batch=knobs.max_micro_batch, top_k=1, suggest=False)
        chosen: Candidate | None
        try:
            chosen, source, _ = choose_layout(spec, inputs, gpus, found)
        except UserInputError:  # no layout the trainer runs on this count: a row that says so
            chosen, source = None, "none"
        row: dict[str, Any] = {"gpus": gpus, "days": budget.days, "gpu_hours": budget.gpu_hours,
                               "cost": budget.cost, "fits": chosen is not None and chosen.memory.fits,
                               "layout": None, "layout_source": None, "predicted_days": None,
                               "predicted_days_p10": None, "predicted_days_p90": None, "predicted_mfu": None}
        if chosen is not None and chosen.memory.fits:
            given = source == "spec"
            days = inputs.tokens_total / chosen.time.tokens_per_s / SECONDS_PER_DAY
            band = range_dict("predicted_days", step_offsets(layout_given=given, moe=inputs.shape.moe is not None),
                              days)
            _, run = whole_run_on(spec, inputs, gpus, chosen)
            whole = whole_run_ranges(spec, inputs, run, layout_given=given)
            row.update({"layout": chosen.layout.describe(), "layout_source": source, "predicted_days": days,
                        "predicted_days_p10": band["predicted_days_p10"],
                        "predicted_days_p90": band["predicted_days_p90"], "predicted_mfu": chosen.time.mfu,
                        "expected_goodput": run["expected_goodput"],
                        "whole_run_days": run["whole_run_days"], "whole_run_gpu_hours": run["whole_run_gpu_hours"],
                        **{f"whole_run_{k}": v for k, v in whole["time"].items()},
                        "whole_run_cost": whole["cost"]["whole_run"],
                        **{f"whole_run_cost_{k[len('total_'):]}": v for k, v in whole["cost"].items()
                           if k.startswith("total_")}})
        rows.append(row)
    plan.what_if = rows
    return rows


def make_plan(spec: JobSpec) -> dict[str, Any]:
    """plan.json's content for a spec (keys in docs/architecture.md, bytes/seconds/FLOP as plain numbers)."""
    return build_plan(spec).to_json()
