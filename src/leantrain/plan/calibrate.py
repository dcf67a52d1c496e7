"""`leantrain plan SPEC --calibrate RUN_DIR...`: fit the step-time constants to earlier runs' measured step
times on the same hardware, so a small rehearsal makes the big plan honest.

Each run dir holds what `leantrain train` writes: spec.yaml (the job), plan.json (its layout) and
metrics.jsonl (`step_time_s` per logged window). The steady step time is the median after the first 10 % of
records (compile, cold caches). For each run the compute efficiency that makes the step-time model give
exactly that step time is found by bisection (the predicted step time falls as efficiency rises); with
several runs whose data-parallel traffic differs, `dp_overlap` is also chosen on a grid, the value whose
per-run efficiencies agree best (smallest spread of log efficiency). The plan then uses the median fitted
efficiency. Runs must use the target's accelerator and compute dtype: efficiency is a share of that peak.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from leantrain.errors import UserInputError, json_field, read_json_object
from leantrain.hardware import remeasure_cpu_peak
from leantrain.plan.inputs import PlanInputs, plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.timing import step_time
from leantrain.spec import load_spec
from leantrain.spec.schema import JobSpec

SKIP_FRACTION = 0.1
OVERLAP_GRID = [i / 10 for i in range(11)]


@dataclass(frozen=True)
class MeasuredRun:
    run_dir: Path
    inputs: PlanInputs
    layout: Layout
    sequences_per_step: int
    step_s: float  # measured steady step time
    compute_dtype: str


def _steady_step_s(path: Path) -> float:
    values = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserInputError(f"--calibrate {path.parent}: {path.name} cannot be read ({type(err).__name__}: {err}); "
                             "give the run dir `leantrain train` wrote") from None
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if isinstance(record, dict) and "loss" in record and isinstance(record.get("step_time_s"), int | float):
            values.append(float(record["step_time_s"]))
    skip = max(1, int(len(values) * SKIP_FRACTION)) if len(values) > 2 else 0
    steady = [v for v in values[skip:] if math.isfinite(v) and v > 0]
    if not steady:
        raise UserInputError(f"--calibrate {path.parent}: {path.name} has no step_time_s records to fit on")
    return statistics.median(steady)


def load_measured_run(run_dir: Path) -> MeasuredRun:
    """A run dir's spec, layout and steady step time (errors name the missing file)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(f"--calibrate {run_dir}: " + ("is a file; give a run dir" if run_dir.exists() else
                                                           "does not exist"))
    for name in ("spec.yaml", "plan.json", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise UserInputError(f"--calibrate {run_dir}: no {name} (a run dir written by `leantrain train`)")
    spec = load_spec(run_dir / "spec.yaml")
    layout = plan_layout(read_json_object(run_dir / "plan.json", option="--calibrate"),
                         source=f"--calibrate {run_dir / 'plan.json'}")
    inputs = plan_inputs(spec)
    seqs = max(1, math.ceil(spec.training.global_batch_tokens / spec.data.seq_len))
    return MeasuredRun(run_dir=run_dir, inputs=inputs, layout=layout, sequences_per_step=seqs,
                       step_s=_steady_step_s(run_dir / "metrics.jsonl"), compute_dtype=spec.precision.compute)


def plan_layout(plan: dict[str, Any], *, source: str) -> Layout:
    """The layout a plan.json records under `layout`, each field checked against Layout's type (counts positive,
    ZeRO stage from 0): a hand-edited or cut-short file is a UserInputError naming `source` and the key."""
    hints = get_type_hints(Layout)
    values = {}
    for field in fields(Layout):
        key, hint = f"layout.{field.name}", hints[field.name]
        allowed = get_args(hint) if get_origin(hint) is Literal else ()
        optional = {} if field.default is MISSING else {"default": field.default}
        value = json_field(plan, key, str if allowed else hint, source=source, **optional)
        if allowed and value not in allowed:
            raise UserInputError(f"{source}: key {key!r}: expected one of {', '.join(allowed)}, got {value!r}")
        if hint is int and value < (0 if field.name == "zero" else 1):
            raise UserInputError(f"{source}: key {key!r}: expected an integer from {0 if field.name == 'zero' else 1}"
                                 f", got {value}")
        values[field.name] = value
    return Layout(**values)


def efficiency_for(run: MeasuredRun, *, dp_overlap: float | None = None) -> float:
    """The compute efficiency at which the model predicts the run's measured step time (bisection)."""
    inputs = run.inputs if dp_overlap is None else replace(run.inputs, dp_overlap=dp_overlap)

    def predicted(e: float) -> float:
        return step_time(replace(inputs, compute_efficiency=e), run.layout,
                         sequences_per_step=run.sequences_per_step).step_s

    low, high = 1e-4, 1.0
    if predicted(high) >= run.step_s:  # slower than even peak compute can explain: communication-bound
        return high
    for _ in range(60):
        mid = math.sqrt(low * high)
        if predicted(mid) > run.step_s:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)


def calibrate(spec: JobSpec, run_dirs: list[Path]) -> dict[str, Any]:
    """Fitted constants and per-run detail for the target spec."""
    if not run_dirs:
        raise UserInputError("--calibrate needs at least one run dir")
    result = _calibrate(spec, run_dirs)
    if (spec.hardware.peak_flops is None and plan_inputs(spec).accelerator == "cpu"
            and any(r["fitted_efficiency"] >= 1.0 for r in result["runs"])):
        # A run faster than the host's cached peak allows: the peak was measured on a busy machine. Measure
        # it again (the cache keeps the highest, hardware.remeasure_cpu_peak) and fit once more.
        remeasure_cpu_peak(spec.precision.compute)
        result = _calibrate(spec, run_dirs)
    return result


def _calibrate(spec: JobSpec, run_dirs: list[Path]) -> dict[str, Any]:
    target = plan_inputs(spec)
    runs = [load_measured_run(d) for d in run_dirs]
    for run in runs:
        if run.inputs.accelerator != target.accelerator or run.compute_dtype != spec.precision.compute:
            raise UserInputError(
                f"--calibrate {run.run_dir}: ran on {run.inputs.accelerator}/{run.compute_dtype}, the plan is for "
                f"{target.accelerator}/{spec.precision.compute}; calibrate on the same hardware and dtype")
    overlap = spec.plan.dp_overlap
    if len(runs) >= 2:
        def spread(o: float) -> float:
            logs = [math.log(efficiency_for(r, dp_overlap=o)) for r in runs]
            return max(logs) - min(logs)
        overlap = min(OVERLAP_GRID, key=spread)
    per_run = [efficiency_for(r, dp_overlap=overlap) for r in runs]
    efficiency = statistics.median(per_run)
    return {"compute_efficiency": efficiency, "dp_overlap": overlap,
            "runs": [{"run_dir": str(r.run_dir), "layout": r.layout.describe(), "measured_step_s": r.step_s,
                      "fitted_efficiency": e} for r, e in zip(runs, per_run, strict=True)]}


def apply(spec: JobSpec, calibration: dict[str, Any]) -> JobSpec:
    """The spec with the fitted constants in its plan section."""
    knobs = spec.plan.model_copy(update={"compute_efficiency": min(1.0, calibration["compute_efficiency"]),
                                         "dp_overlap": calibration["dp_overlap"]})
    return spec.model_copy(update={"plan": knobs})
