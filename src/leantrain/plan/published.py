"""Published runs (plan/published_runs.yaml) as planner inputs, predictions, and the calibration that fits the
step-time constants on one half of them and reports the error on the other half.

- `load_runs()` → throughput entries (`runs`) and whole-run entries (`whole_runs`), each a `PublishedRun`.
- `measured_tokens_per_gpu_s(run)` turns the source's figure (tokens/s, step time, Megatron TFLOP/s or MFU)
  into tokens per second per GPU.
- `predicted_tokens_per_gpu_s(run, efficiency=...)` runs the step-time model on the run's layout.
- `fit_efficiency(runs)` picks, per accelerator family, the compute efficiency that minimises the median
  |log(predicted / measured)|: the only fitted constants. `split_halves(runs)` alternates runs within each
  family (sorted by name), so both halves cover every accelerator, style and size range.
- `whole_run_gpu_hours(run)`: the planner's whole-run prediction in model mode (the published layout, or the
  searched best when none is published, divided by the expected goodput).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from leantrain.plan.inputs import PlanInputs, plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.timing import step_time
from leantrain.spec import spec_from_dict

RUNS_FILE = Path(__file__).with_name("published_runs.yaml")
EFFICIENCY_GRID = [round(0.30 + 0.005 * i, 3) for i in range(101)]  # 0.30 ... 0.80


def family(accelerator: str) -> str:
    """Accelerators that share one efficiency constant: A100s, and Hopper (H100/H800/H200)."""
    return "A100" if accelerator.startswith("A100") else "H100"


@dataclass(frozen=True, eq=False)
class PublishedRun:
    name: str
    source: str
    accelerator: str
    gpus: int
    seq_len: int
    global_batch_seqs: int
    model: dict[str, Any]
    layout: dict[str, Any] | None
    measured: dict[str, float]
    tokens: float = 0.0
    gpu_hours: float = 0.0
    compute: str = "bf16"
    kernels: str = "auto"
    plan: tuple[tuple[str, Any], ...] = ()  # planner knobs the source states (plan section of the spec)

    @property
    def family(self) -> str:
        return family(self.accelerator)

    def spec_dict(self) -> dict[str, Any]:
        plan: dict[str, Any] = {"activation_kernels": self.kernels, **dict(self.plan)}
        return {"model": self.model, "data": {"tokens_total": self.tokens or 1e12, "seq_len": self.seq_len},
                "training": {"global_batch_tokens": self.global_batch_seqs * self.seq_len},
                "precision": {"compute": self.compute},
                "hardware": {"accelerator": self.accelerator, "num_nodes": max(1, self.gpus // 8)},
                "budget": {"target_days": None, "num_gpus": self.gpus}, "plan": plan}

    def run_layout(self) -> Layout:
        assert self.layout is not None
        lay = dict(self.layout)
        v = int(lay.pop("v", 1))
        tp, pp = int(lay.get("tp", 1)), int(lay.get("pp", 1))
        return Layout(dp=self.gpus // (tp * pp), virtual_stages=v,
                      schedule="interleaved_1f1b" if v > 1 else "1f1b", **lay)


def _run(entry: dict[str, Any]) -> PublishedRun:
    fields = {k: entry[k] for k in ("name", "source", "accelerator", "gpus", "seq_len", "global_batch_seqs",
                                    "model")}
    return PublishedRun(**fields, layout=entry.get("layout"), measured=entry.get("measured", {}),
                        tokens=float(entry.get("tokens", 0.0)), gpu_hours=float(entry.get("gpu_hours", 0.0)),
                        compute=entry.get("compute", "bf16"), kernels=entry.get("kernels", "auto"),
                        plan=tuple(sorted(entry.get("plan", {}).items())))


@cache
def load_runs(path: Path = RUNS_FILE) -> tuple[tuple[PublishedRun, ...], tuple[PublishedRun, ...]]:
    """(throughput runs, whole runs) from the data file."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return tuple(_run(e) for e in data["runs"]), tuple(_run(e) for e in data["whole_runs"])


_INPUTS: dict[str, PlanInputs] = {}


def run_inputs(run: PublishedRun) -> PlanInputs:
    """The run's planner inputs (resolved once per run name)."""
    if run.name not in _INPUTS:
        _INPUTS[run.name] = plan_inputs(spec_from_dict(run.spec_dict()))
    return _INPUTS[run.name]


def megatron_flops_per_token(model: dict[str, Any], seq_len: int) -> float:
    """Megatron-LM's count (Narayanan et al. 2021, eq. 3): 96·l·h²·(1 + s/6h + V/16lh) per token."""
    layers, h, vocab = model["n_layers"], model["d_model"], model["vocab_size"]
    return 96 * layers * h * h * (1 + seq_len / (6 * h) + vocab / (16 * layers * h))


def measured_tokens_per_gpu_s(run: PublishedRun) -> float:
    m = run.measured
    if "tokens_per_gpu_s" in m:
        return float(m["tokens_per_gpu_s"])
    if "step_s" in m:
        return run.global_batch_seqs * run.seq_len / float(m["step_s"]) / run.gpus
    if "megatron_tflops" in m:
        return float(m["megatron_tflops"]) * 1e12 / megatron_flops_per_token(run.model, run.seq_len)
    inputs = run_inputs(run)
    return float(m["mfu"]) * inputs.peak_flops / inputs.flops.model


def predicted_tokens_per_gpu_s(run: PublishedRun, *, efficiency: float | None = None) -> float:
    inputs = run_inputs(run)
    if efficiency is not None:
        inputs = replace(inputs, compute_efficiency=efficiency)
    t = step_time(inputs, run.run_layout(), sequences_per_step=run.global_batch_seqs)
    return t.tokens_per_s / run.gpus


def log_errors(runs: list[PublishedRun], efficiency: dict[str, float]) -> list[float]:
    return [math.log(predicted_tokens_per_gpu_s(r, efficiency=efficiency[r.family]) / measured_tokens_per_gpu_s(r))
            for r in runs]


def median_abs_error(runs: list[PublishedRun], efficiency: dict[str, float]) -> float:
    """Median |predicted / measured − 1| of tokens per second per GPU."""
    return statistics.median(abs(math.exp(e) - 1) for e in log_errors(runs, efficiency))


def fit_efficiency(runs: list[PublishedRun]) -> dict[str, float]:
    """Per accelerator family, the grid efficiency with the smallest median |log error| on `runs`."""
    fitted: dict[str, float] = {}
    for fam in sorted({r.family for r in runs}):
        members = [r for r in runs if r.family == fam]
        fitted[fam] = min(EFFICIENCY_GRID, key=lambda e, ms=members, f=fam: statistics.median(
            abs(x) for x in log_errors(ms, {f: e})))
    return fitted


def split_halves(runs: tuple[PublishedRun, ...]) -> tuple[list[PublishedRun], list[PublishedRun]]:
    """Alternate runs within each accelerator family, in name order."""
    a: list[PublishedRun] = []
    b: list[PublishedRun] = []
    for fam in sorted({r.family for r in runs}):
        for i, r in enumerate(sorted((r for r in runs if r.family == fam), key=lambda r: r.name)):
            (a if i % 2 == 0 else b).append(r)
    return a, b


def split_half_errors(runs: tuple[PublishedRun, ...]) -> dict[str, Any]:
    """Fit on each half, report the median error on the other (and the in-sample error, for contrast)."""
    a, b = split_halves(runs)
    fit_a, fit_b = fit_efficiency(a), fit_efficiency(b)
    return {"fit_on_a": fit_a, "fit_on_b": fit_b,
            "error_b_with_fit_a": median_abs_error(b, fit_a), "error_a_with_fit_b": median_abs_error(a, fit_b),
            "error_a_in_sample": median_abs_error(a, fit_a), "error_b_in_sample": median_abs_error(b, fit_b),
            "half_a": [r.name for r in a], "half_b": [r.name for r in b]}


def whole_run_gpu_hours(run: PublishedRun) -> dict[str, Any]:
    """The planner's whole-run GPU-hours for a whole-run entry (published layout when given)."""
    from leantrain.plan.planner import make_plan

    spec = dict(run.spec_dict())
    if run.layout is not None:
        lay = run.run_layout()
        spec["parallelism"] = {"data_parallel": lay.dp, "tensor_parallel": lay.tp, "pipeline_parallel": lay.pp,
                               "expert_parallel": lay.ep, "zero_stage": lay.zero,
                               "pipeline_schedule": lay.schedule, "virtual_stages": lay.virtual_stages}
        spec["training"] = {**spec["training"], "micro_batch": lay.micro_batch,
                            "activation_checkpointing": lay.recompute}
    spec["checkpoint"] = {"interval_steps": "auto", "async_save": True}
    plan = make_plan(spec_from_dict(spec))
    t = plan["time"]
    return {"predicted_gpu_hours": t["whole_run_gpu_hours"], "step_only_gpu_hours": t["predicted_gpu_hours"],
            "goodput": t["expected_goodput"], "layout": plan["layout"]["source"], "mfu": plan["throughput"]["mfu"],
            "error": t["whole_run_gpu_hours"] / run.gpu_hours - 1}
