"""Published runs (plan/published_runs.yaml) as planner inputs, predictions, and the calibration that fits the
step-time constants on some of them and reports the error on the others.

- `load_runs()` → throughput (`runs`) and whole-run entries (`whole_runs`); `load_moe_runs()` → the MoE entries,
  which fit only the MoE-layer overhead (plan/published_moe.py). `measured_tokens_per_gpu_s(run)` reads the
  source's figure (tokens/s, step time, Megatron TFLOP/s or MFU); `predicted_tokens_per_gpu_s(run, ...)` runs the
  step-time model on its layout.
- `fit_constants(runs)` picks, per accelerator family, the compute efficiency, one memory-bound pass count and
  the fp8 step speed-up that minimise the median |log(predicted / measured)|: the only fitted step-time constants.
  `split_halves(runs)` alternates runs within each family (by name) for the split-half error; the step range
  leaves one software stack out at a time (`step_residuals_out_of_sample`, checked by `step_range_coverage`).
- `whole_run_gpu_hours(run)`: the planner's whole-run prediction in model mode; `whole_run_split_errors(runs)`
  fits the whole-run efficiency on half the whole runs and reports the other half; `whole_run_range_coverage` and
  `whole_run_range_coverage_resampled` check its range on the fixed and on random halves;
  plan/published_moe.py does the same for the MoE runs and range, one release left out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from leantrain.plan.inputs import (
    FP8_GEMM_SPEEDUP,
    MOE_LAYER_OVERHEAD_S,
    PlanInputs,
    default_compute_efficiency,
    plan_inputs,
)
from leantrain.plan.layout import Layout
from leantrain.plan.timing import step_time
from leantrain.plan.uncertainty import conformal_range, prediction_range
from leantrain.spec import spec_from_dict

RUNS_FILE = Path(__file__).with_name("published_runs.yaml")
EFFICIENCY_GRID = [round(0.30 + 0.005 * i, 3) for i in range(101)]  # 0.30 ... 0.80
FP8_GRID = [round(1.0 + 0.02 * i, 2) for i in range(51)]  # fp8 step speed-up over bf16, 1.00 ... 2.00
PASSES_GRID = [float(i) for i in range(17)]  # memory-bound passes over a layer's activations, 0 ... 16
EAGER_PASSES_GRID = [float(i) for i in range(33)]  # the same for eager (unfused) stacks, 0 ... 32


def family(accelerator: str) -> str:
    """Accelerators that share one fitted efficiency constant: A100s, and Hopper (H100/H800/H200). Any other part
    (B200, MI300X, L40S) is its own family, which no calibration run has: it is priced at the planner's shipped,
    judged efficiency (`default_compute_efficiency`), as a user's plan is (until 2026-12-06 it was priced as
    Hopper here, which the planner never does)."""
    if accelerator.startswith("A100"):
        return "A100"
    return "H100" if accelerator.startswith("H") else accelerator


# Name prefixes of the runs measured on torchtitan (and Trainy's torchtitan runs, bench/published_heldout.yaml), whose
# recompute is torch's non-reentrant checkpoint with early stop (torchtitan's activation_checkpoint.py wraps blocks
# with ptd_checkpoint_wrapper, CheckpointImpl.NO_REENTRANT); every other run's stack (Megatron-LM, NeMo, DeepSpeed,
# LLM Foundry's 2023 runs, in-house stacks) is priced with the whole forward redone.
EARLY_STOP_STACKS = ("torchtitan", "tt", "ttatp", "trainy")


def name_prefix(name: str) -> str:
    """A run name's first field without its digits (dgxc2504 -> dgxc, llama3 -> llama): its software stack's key."""
    return name.split("-", 1)[0].rstrip("0123456789")


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
    fp8_recipe: str = "te"  # fp8 runs: te (Transformer Engine: casts fused, speed-up fitted) | torchao (defaults)
    attention: str = "fused"  # fused (TE/cuDNN, or unfused matmuls): the GEMM rate | sdpa: FlashAttention-2's
    plan: tuple[tuple[str, Any], ...] = ()  # planner knobs the source states (plan section of the spec)

    @property
    def family(self) -> str:
        return family(self.accelerator)

    def spec_dict(self) -> dict[str, Any]:
        early_stop = name_prefix(self.name) in EARLY_STOP_STACKS
        plan: dict[str, Any] = {"kernels": self.kernels, "recompute_early_stop": early_stop, **dict(self.plan)}
        return {"model": self.model, "data": {"tokens_total": self.tokens or 1e12, "seq_len": self.seq_len},
                "training": {"global_batch_tokens": self.global_batch_seqs * self.seq_len},
                "precision": {"compute": self.compute},
                "hardware": {"accelerator": self.accelerator, "num_nodes": max(1, self.gpus // 8)},
                "budget": {"target_days": None, "num_gpus": self.gpus}, "plan": plan}

    def run_layout(self) -> Layout:
        assert self.layout is not None
        lay = dict(self.layout)
        v = int(lay.pop("v", 1))
        schedule = str(lay.pop("schedule", "interleaved_1f1b" if v > 1 else "1f1b"))
        tp, pp = int(lay.get("tp", 1)), int(lay.get("pp", 1))
        if "etp" in lay:  # Megatron's expert tensor parallelism: experts split over TP (etp = tp) or whole (1)
            lay["experts_tp_split"] = int(lay.pop("etp")) == tp > 1
        return Layout(dp=self.gpus // (tp * pp), virtual_stages=v, schedule=schedule, **lay)


def _run(entry: dict[str, Any]) -> PublishedRun:
    fields = {k: entry[k] for k in ("name", "source", "accelerator", "gpus", "seq_len", "global_batch_seqs",
                                    "model")}
    return PublishedRun(**fields, layout=entry.get("layout"), measured=entry.get("measured", {}),
                        tokens=float(entry.get("tokens", 0.0)), gpu_hours=float(entry.get("gpu_hours", 0.0)),
                        compute=entry.get("compute", "bf16"), kernels=entry.get("kernels", "auto"),
                        fp8_recipe=entry.get("fp8_recipe", "te"), attention=entry.get("attention", "fused"),
                        plan=tuple(sorted(entry.get("plan", {}).items())))


@cache
def _data(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@cache
def load_runs(path: Path = RUNS_FILE) -> tuple[tuple[PublishedRun, ...], tuple[PublishedRun, ...]]:
    """(throughput runs, whole runs) from the data file."""
    return tuple(_run(e) for e in _data(path)["runs"]), tuple(_run(e) for e in _data(path)["whole_runs"])


@cache
def load_moe_runs(path: Path = RUNS_FILE) -> tuple[PublishedRun, ...]:
    """The mixture-of-experts throughput runs (`moe_runs`): the dense constants and their own MoE-layer overhead
    (one release left out) predict them; those residuals are an MoE plan's step range."""
    return tuple(_run(e) for e in _data(path).get("moe_runs") or ())


_INPUTS: dict[str, PlanInputs] = {}


def run_inputs(run: PublishedRun) -> PlanInputs:
    """The run's planner inputs (resolved once per run name)."""
    if run.name not in _INPUTS:
        inputs = plan_inputs(spec_from_dict(run.spec_dict()))
        if run.compute == "fp8" and run.fp8_recipe == "te":  # TE fuses the fp8 casts into the kernels before
            inputs = replace(inputs, fp8_cast_bytes=0.0)
        if run.attention != "sdpa":
            inputs = replace(inputs, attention_flops_s=0.0)
        _INPUTS[run.name] = inputs
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


@dataclass(frozen=True)
class Fit:
    """The fitted step-time constants: compute efficiency per accelerator family, memory-bound passes (of fused
    stacks, and of eager ones: None = the same), the fp8 speed-up of the Transformer Engine runs, and the MoE
    layers' fixed time per micro-batch (plan/published_moe.py; no dense run uses it)."""

    efficiency: dict[str, float]
    elementwise_passes: float
    fp8_speedup: float = FP8_GEMM_SPEEDUP
    eager_passes: float | None = None
    moe_layer_overhead_s: float = MOE_LAYER_OVERHEAD_S

    def passes(self, fused: bool) -> float:
        return self.elementwise_passes if fused or self.eager_passes is None else self.eager_passes

    def __repr__(self) -> str:
        eff = ", ".join(f"{k} {v}" for k, v in sorted(self.efficiency.items()))
        return (f"efficiency {eff}; elementwise passes {self.elementwise_passes:g} (eager "
                f"{self.passes(False):g}); fp8 speed-up {self.fp8_speedup:g}")


@cache  # the fits' grids ask for the same run at the same constants many times (runs hash by identity)
def predicted_tokens_per_gpu_s(run: PublishedRun, *, efficiency: float | None = None,
                               elementwise_passes: float | None = None, fp8_speedup: float | None = None,
                               moe_layer_overhead_s: float | None = None) -> float:
    knobs = {"compute_efficiency": efficiency, "elementwise_passes": elementwise_passes,
             "moe_layer_overhead_s": moe_layer_overhead_s}
    inputs = replace(run_inputs(run), **{k: v for k, v in knobs.items() if v is not None})
    if fp8_speedup is not None and inputs.fp8_speedup != 1.0 and run.fp8_recipe == "te":
        inputs = replace(inputs, fp8_speedup=fp8_speedup)
    t = step_time(inputs, run.run_layout(), sequences_per_step=run.global_batch_seqs)
    return t.tokens_per_s / run.gpus


def family_efficiency(fit: Fit, run: PublishedRun) -> float:
    """The fitted efficiency of the run's family, else the shipped one of its accelerator."""
    return fit.efficiency.get(run.family, default_compute_efficiency(run.accelerator))


def predicted_with(run: PublishedRun, fit: Fit) -> float:
    return predicted_tokens_per_gpu_s(run, efficiency=family_efficiency(fit, run),
                                      elementwise_passes=fit.passes(run_inputs(run).fused_kernels),
                                      fp8_speedup=fit.fp8_speedup, moe_layer_overhead_s=fit.moe_layer_overhead_s)


def log_errors(runs: list[PublishedRun], fit: Fit) -> list[float]:
    """log(predicted / measured tokens per second) = log(measured / predicted step time): the residual every
    P10-P90 range is built from and checked against (plan/uncertainty.py)."""
    return [math.log(predicted_with(r, fit) / measured_tokens_per_gpu_s(r)) for r in runs]


def median_abs_error(runs: list[PublishedRun], fit: Fit) -> float:
    """Median |predicted / measured − 1| of tokens per second per GPU."""
    return statistics.median(abs(math.exp(e) - 1) for e in log_errors(runs, fit))


def grid_min(grid: list[float], score: Any) -> float:
    """The grid point with the smallest score: a coarse pass, then a fine one around its best point (a
    quarter of the evaluations; on the published runs it picks what the full grid picks, for every fit)."""
    coarse = min(grid[::4], key=score)
    i = grid.index(coarse)
    return min(grid[max(0, i - 4):i + 5], key=score)


def _median_abs_log(runs: list[PublishedRun], fit: Fit) -> float:
    return statistics.median(abs(x) for x in log_errors(runs, fit))


def _fit_with_eager(runs: list[PublishedRun], eager: float | None) -> Fit:
    """Per family the efficiency (bf16 runs), the fused stacks' pass count and the TE fp8 speed-up, for a given
    eager pass count (None: the same count for every stack)."""
    best: tuple[float, Fit] | None = None
    bf16 = [r for r in runs if r.compute != "fp8"]
    fp8 = [r for r in runs if r.compute == "fp8" and r.fp8_recipe == "te"]
    for passes in PASSES_GRID:
        eff = {}
        for fam in sorted({r.family for r in runs}):
            members = [r for r in bf16 if r.family == fam] or [r for r in runs if r.family == fam]
            eff[fam] = grid_min(EFFICIENCY_GRID, lambda e, ms=members, f=fam, p=passes: _median_abs_log(
                ms, Fit({f: e}, p, eager_passes=eager)))
        fit = Fit(eff, passes, eager_passes=eager)
        if fp8:
            fit = Fit(eff, passes, grid_min(FP8_GRID, lambda x, f=eff, p=passes: _median_abs_log(
                fp8, Fit(f, p, x, eager))), eager)
        score = _median_abs_log(runs, fit)
        if best is None or score < best[0] - 1e-12:
            best = (score, fit)
    assert best is not None
    return best[1]


def fit_constants(runs: list[PublishedRun]) -> Fit:
    """The step-time constants with the smallest median |log error| over `runs`: first with one pass count for
    every stack, then the eager stacks' own count on the eager runs (unfused norms, activations and casts make
    more memory-bound passes), then the rest again with it."""
    first = _fit_with_eager(list(runs), None)
    eager_runs = [r for r in runs if not run_inputs(r).fused_kernels]
    if not eager_runs:
        return first
    eager = min(EAGER_PASSES_GRID, key=lambda p: _median_abs_log(eager_runs, replace(first, eager_passes=p)))
    return _fit_with_eager(list(runs), eager)


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
    fit_a, fit_b = fit_constants(a), fit_constants(b)
    return {"fit_on_a": fit_a, "fit_on_b": fit_b,
            "error_b_with_fit_a": median_abs_error(b, fit_a), "error_a_with_fit_b": median_abs_error(a, fit_b),
            "error_a_in_sample": median_abs_error(a, fit_a), "error_b_in_sample": median_abs_error(b, fit_b),
            "half_a": [r.name for r in a], "half_b": [r.name for r in b]}


def whole_run_gpu_hours(run: PublishedRun, *, whole_run_efficiency: float | None = None) -> dict[str, Any]:
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
    if whole_run_efficiency is not None:
        spec["plan"] = {**spec["plan"], "whole_run_efficiency": whole_run_efficiency}
    spec["checkpoint"] = {"interval_steps": "auto", "async_save": True}
    plan = make_plan(spec_from_dict(spec))
    t = plan["time"]
    return {"predicted_gpu_hours": t["whole_run_gpu_hours"], "step_only_gpu_hours": t["predicted_gpu_hours"],
            "goodput": t["expected_goodput"], "layout": plan["layout"]["source"], "mfu": plan["throughput"]["mfu"],
            "whole_run_efficiency": t["whole_run_efficiency"], "error": t["whole_run_gpu_hours"] / run.gpu_hours - 1}


def fit_whole_run_efficiency(ratios: list[float]) -> float:
    """The median of the runs' predicted / published GPU-hours at efficiency 1 (the prediction scales as
    1 / efficiency), to two decimals: the robust estimate of one multiplicative constant."""
    return round(statistics.median(ratios), 2)


def whole_run_split_errors(runs: tuple[PublishedRun, ...]) -> dict[str, Any]:
    """Whole-run efficiency fitted on alternate runs (name order) and the median |error| on the others, both
    ways; the runs' step-time constants are the defaults (fitted on throughput runs only)."""
    ratios = {r.name: whole_run_gpu_hours(r, whole_run_efficiency=1.0)["predicted_gpu_hours"] / r.gpu_hours
              for r in runs}
    names = sorted(ratios)
    a, b = names[0::2], names[1::2]
    fit_a = fit_whole_run_efficiency([ratios[n] for n in a])
    fit_b = fit_whole_run_efficiency([ratios[n] for n in b])

    def error(group: list[str], f: float) -> float:
        return statistics.median(abs(ratios[n] / f - 1) for n in group)
    return {"fit_on_a": fit_a, "fit_on_b": fit_b, "fit_on_all": fit_whole_run_efficiency(list(ratios.values())),
            "error_b_with_fit_a": error(b, fit_a), "error_a_with_fit_b": error(a, fit_b),
            "error_all_unfitted": error(names, 1.0), "half_a": a, "half_b": b, "ratios_at_1": ratios}


# --- P10-P90 ranges (plan/uncertainty.py): the residuals the ranges come from, and their held-out coverage ---


NVIDIA = "NVIDIA NeMo/Megatron"
STACKS = {"megatron": "Megatron-LM 2021", "mt": "MT-NLG", "torchtitan": "torchtitan", "foundry": "LLM Foundry",
          "llama": "Meta Llama 3", "nemotron": NVIDIA, "dgxc": NVIDIA, "nemo": NVIDIA, "mb": NVIDIA}


def stack(run: PublishedRun) -> str:
    """The software stack a throughput run was measured on, by `name_prefix`; a name no stack claims is
    refused."""
    prefix = name_prefix(run.name)
    if prefix not in STACKS:
        raise ValueError(f"published run {run.name!r}: no software stack for its name prefix {prefix!r}")
    return STACKS[prefix]


_FITS: dict[frozenset[PublishedRun], Fit] = {}


def fit_without(runs: tuple[PublishedRun, ...] | list[PublishedRun], *stacks: str) -> Fit:
    """`fit_constants` on the runs of the other stacks (cached by the runs fitted on)."""
    kept = [r for r in runs if stack(r) not in stacks]
    key = frozenset(kept)  # the run objects themselves (PublishedRun hashes by identity)
    if key not in _FITS:
        _FITS[key] = fit_constants(kept)
    return _FITS[key]


def step_residuals_out_of_sample(runs: tuple[PublishedRun, ...] | list[PublishedRun]) -> list[float]:
    """log(measured / predicted step time) of every run, each predicted with the constants fitted on the runs of
    the other stacks (`stack`; leave one stack out): what the step time misses on a stack it was not fitted on,
    as on a user's own stack."""
    names = sorted({stack(r) for r in runs})
    return [e for n in names for e in log_errors([r for r in runs if stack(r) == n], fit_without(runs, n))]


def searched_step_residuals(runs: tuple[PublishedRun, ...], fits: dict[str, Fit] | None = None) -> list[float]:
    """log(measured step time of the published layout / predicted step time of the planner's own searched best
    on the same GPUs): the miss when the spec gives no layout. `fits` maps run names to the constants to use
    (the other half's fit, for an out-of-sample residual); by default the shipped ones."""
    from leantrain.plan.search import search_layouts

    out = []
    for run in runs:
        inputs = run_inputs(run)
        fit = (fits or {}).get(run.name)
        if fit is not None:
            inputs = replace(inputs, compute_efficiency=family_efficiency(fit, run),
                             elementwise_passes=fit.passes(inputs.fused_kernels),
                             fp8_speedup=fit.fp8_speedup if inputs.fp8_speedup != 1.0 and run.fp8_recipe == "te"
                             else inputs.fp8_speedup)
        found = search_layouts(inputs, run.gpus, max_micro_batch=8, top_k=1, suggest=False)
        if found.best is not None:
            out.append(math.log(found.best.time.tokens_per_s / run.gpus / measured_tokens_per_gpu_s(run)))
    return out


def whole_run_residuals(ratios_at_1: dict[str, float], efficiency: float, names: list[str]) -> list[float]:
    """log(published / predicted GPU-hours) of `names` at a whole-run efficiency (the prediction scales as
    1 / efficiency)."""
    return [-math.log(ratios_at_1[n] / efficiency) for n in names]


def step_range_coverage(runs: tuple[PublishedRun, ...]) -> dict[str, float]:
    """Held-out check of the step-time range, one stack left out of both the constants and the range: for each
    stack, the share of its runs inside the range built from the other stacks' own leave-one-stack-out residuals,
    each run predicted with the constants fitted on the other stacks; "all": the share of all runs."""
    out: dict[str, float] = {}
    for name in sorted({stack(r) for r in runs}):
        offsets = conformal_range(step_residuals_out_of_sample([r for r in runs if stack(r) != name]))
        out[name] = range_coverage([r for r in runs if stack(r) == name], fit_without(runs, name), offsets)
    out["all"] = sum(out[stack(r)] for r in runs) / len(runs)
    return out


def range_coverage(runs: list[PublishedRun], fit: Fit, offsets: tuple[float, float, float]) -> float:
    """The share of `runs` whose measured step time lies in [P10, P90] of the step time predicted with `fit`:
    log(measured / predicted step time) = log(predicted / measured tokens per second), the residual the ranges
    are built from (plan/uncertainty.py)."""
    lo, _, hi = offsets
    return sum(lo <= e <= hi for e in log_errors(runs, fit)) / len(runs)


RangeMethod = Callable[[list[float]], tuple[float, float, float]]


def whole_run_range_coverage(split: dict[str, Any], method: RangeMethod = prediction_range) -> dict[str, Any]:
    """Held-out check of the whole-run range (from `whole_run_split_errors`): each half's efficiency and range
    from its own runs; the share of the other half's published GPU-hours inside [P10, P90]. `method` builds a
    range from residuals: the shipped `prediction_range` unless given (bench/plan_accuracy.py also scores the
    order statistics, `conformal_range`)."""
    ratios = split["ratios_at_1"]
    out: dict[str, Any] = {}
    for label, calib, held in (("b_with_range_from_a", split["half_a"], split["half_b"]),
                               ("a_with_range_from_b", split["half_b"], split["half_a"])):
        eff = fit_whole_run_efficiency([ratios[n] for n in calib])
        lo, _, hi = method(whole_run_residuals(ratios, eff, calib))
        residuals = whole_run_residuals(ratios, eff, held)
        out[label] = sum(lo <= r <= hi for r in residuals) / len(residuals)
        out[f"{label}_range"] = (lo, hi)
    return out


def whole_run_range_coverage_resampled(split: dict[str, Any], *, n_splits: int = 2000, seed: int = 0,
                                       method: RangeMethod = prediction_range) -> dict[str, float]:
    """The held-out check of `whole_run_range_coverage` over `n_splits` random half-splits of the whole runs
    (seeded, so the same every run): each half's efficiency and range from that half alone, the coverage of
    the other half, both ways. With ~20 runs per half one run moves a half's coverage by 5 points, so one
    fixed split says little; the mean over many splits is the method's expected coverage, and `in_70_90` the
    share of single half-splits whose coverage lands in 70-90 %; `width` the geometric mean P90 / P10."""
    import random

    ratios = split["ratios_at_1"]
    names = sorted(ratios)
    rng = random.Random(seed)
    shares: list[float] = []
    widths: list[float] = []  # log(P90 / P10) of each half's range
    for _ in range(n_splits):
        order = rng.sample(names, len(names))
        half = len(order) // 2
        for calib, held in ((order[:half], order[half:]), (order[half:], order[:half])):
            eff = fit_whole_run_efficiency([ratios[n] for n in calib])
            lo, _, hi = method(whole_run_residuals(ratios, eff, calib))
            shares.append(sum(lo <= r <= hi for r in whole_run_residuals(ratios, eff, held)) / len(held))
            widths.append(hi - lo)
    shares.sort()
    return {"mean": statistics.mean(shares), "p10": shares[len(shares) // 10],
            "p90": shares[(9 * len(shares)) // 10], "in_70_90": sum(0.7 <= s <= 0.9 for s in shares) / len(shares),
            "splits": float(n_splits), "width": math.exp(statistics.mean(widths))}
