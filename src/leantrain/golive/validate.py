"""`leantrain validate RUN_DIR`: the go-live checklist as checks with evidence.

Categories: health (every rank reported, no unexpected restarts, no errors in events or in any process log:
torchrun's per-rank files, Slurm's and the pod's output, observe/logs.py), convergence (loss falling, no
spikes or non-finite values, grad norm bounded, within tolerance of a baseline run), throughput (tokens/s
and MFU vs the plan; when low, whether data- or communication-bound), memory (peak under the device limit
with headroom), communication share, fault drill. Spikes and grad-norm explosions replay the alert rules
(observe.alerts), so validate and the live alerts agree. FAIL when any check fails, else PASS (warnings listed).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from leantrain.ckpt.rank_records import HANG, OOM, merged_events, read_rank_records
from leantrain.errors import NUMBER, CheckFailed, UserInputError, json_field, read_json_object
from leantrain.observe.alerts import AlertRules, load_rules, replay, replay_engine
from leantrain.observe.logs import log_errors
from leantrain.observe.report_data import (
    COMM_BOUND_SHARE,
    DATA_BOUND_SHARE,
    DRILL_FILE,
    METRICS_FILE,
    PLAN_FILE,
    RunData,
    absent_ranks,
    as_float,
    load_plan_file,
    load_run,
    nonfinite_steps,
    resume_points,
    steady,
    step_share,
)

Status = Literal["PASS", "WARN", "FAIL"]
OOM_RE = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)

# Thresholds, documented in docs/observe.md.
THROUGHPUT_PASS, THROUGHPUT_WARN = 0.9, 0.7      # actual / plan tokens/s per GPU
MFU_PASS, MFU_WARN = 0.8, 0.6                    # actual / plan MFU
MEMORY_HEADROOM = 0.95                           # peak ≤ 95 % of the limit passes
COMM_PASS, COMM_WARN = 0.25, 0.4                 # comm_s / step_time_s
BASELINE_PASS, BASELINE_WARN = 0.05, 0.10        # mean relative loss difference over the last 20 % of steps
LOSS_DROP_MIN = 0.02                             # last window at least 2 % below the first
NOISE_TOLERANCE_MAX = 0.3                        # a noisy run lowers the throughput/MFU bars by at most this


@dataclass(frozen=True)
class Check:
    """One line of the go-live checklist."""

    category: str
    name: str
    status: Status
    evidence: str


@dataclass(frozen=True)
class PlanTargets:
    """What the plan predicts, for the checks that compare the run with it (NaN: not in the plan)."""

    tokens_per_s: float = math.nan  # the whole job's
    mfu: float = math.nan
    gpus: float = math.nan  # the GPUs its layout runs on
    memory_bytes: float = math.nan  # per GPU
    problem: str = ""  # why the run dir's plan.json could not be used (names the file and the key), else ""


def plan_targets(plan: dict[str, Any] | None, *, source: object) -> PlanTargets:
    """The plan's numbers, each checked to be a number: a wrong type is a UserInputError naming `source` and the
    key. The throughput is for the GPUs the layout runs on (whole nodes), not the pre-rounding budget count."""
    def number(key: str) -> float:
        return float(json_field(plan, key, NUMBER, source=source, default=math.nan))

    gpus = number("resources.layout_gpus")
    return PlanTargets(tokens_per_s=number("throughput.tokens_per_s"), mfu=number("throughput.mfu"),
                       gpus=gpus if math.isfinite(gpus) else number("resources.num_gpus"),
                       memory_bytes=number("memory.per_gpu.total"))


def artifact_problem(run: RunData, name: str) -> str:
    """Why a JSON file of the run dir that the reader left out (hand-edited, cut short, not an object) cannot be
    used, naming the file; "" when there is no such file."""
    path = run.run_dir / name
    if not path.is_file():
        return ""
    try:
        read_json_object(path)
    except UserInputError as err:
        return str(err)
    return ""


def load_plan_targets(run: RunData, plan_file: Path | None) -> PlanTargets:
    """The plan to compare with: --plan FILE (unusable: exit 2, the user named it), else the run dir's plan.json
    (unusable: the plan checks warn and name the file and the key, as they warn when there is no plan)."""
    if plan_file is not None:
        return plan_targets(load_plan_file(plan_file, spec=run.spec), source=f"--plan {plan_file}")
    if run.plan is None:
        return PlanTargets(problem=artifact_problem(run, PLAN_FILE))
    try:
        return plan_targets(run.plan, source=run.run_dir / PLAN_FILE)
    except UserInputError as err:
        return PlanTargets(problem=str(err))


def _int(value: Any, default: int) -> int:
    """A count or index from a run file as int; `default` for a missing or non-numeric value."""
    number = as_float(value)
    return int(number) if math.isfinite(number) else default


def bound_diagnosis(run: RunData) -> str:
    """Why throughput is low: data wait, communication, or neither (compute/batch size)."""
    data, comm = step_share(run, "data_wait_s"), step_share(run, "comm_s")
    if math.isfinite(data) and data > DATA_BOUND_SHARE:
        return f"data-bound: steps wait for data {data:.0%} of the time"
    if math.isfinite(comm) and comm > COMM_BOUND_SHARE:
        return f"communication-bound: collectives take {comm:.0%} of the step"
    shown = ", ".join(f"{name} {v:.0%}" for name, v in (("data wait", data), ("comm", comm)) if math.isfinite(v))
    return f"neither data nor communication ({shown or 'not measured'}): compute, kernel or batch size"


def health_checks(run: RunData, rules: AlertRules | None = None) -> list[Check]:
    checks, world, last = [], run.world_size(), (run.metrics[-1] if run.metrics else {})
    seen: set[int] = set(run.rank_metrics) | {int(e["rank"]) for e in run.events_of("rank_joined")
                                              if isinstance(e.get("rank"), int)}
    if isinstance(last.get("rank_step_time_s"), list):
        seen |= {i for i, v in enumerate(last["rank_step_time_s"]) if math.isfinite(as_float(v))}
    if world <= 1:
        checks.append(Check("health", "every rank reported", "PASS", "single process run"))
    elif not seen:
        checks.append(Check("health", "every rank reported", "WARN",
                            f"world size {world}, but no per-rank records (rank_step_time_s, metrics-rankN.jsonl, "
                            "rank_joined events) to tell"))
    else:
        missing = world - len({r for r in seen if 0 <= r < world})  # a world size read from a file may be huge
        first, more = absent_ranks(world, seen), max(0, missing - 10)
        checks.append(Check("health", "every rank reported", "FAIL" if missing else "PASS", f"missing ranks {first}"
                            + (f" and {more} more" if more else "") + f" of {world}" if missing
                            else f"all {world} ranks reported"))
    restarts = run.events_of("restart")
    jumps = resume_points(run)
    planned = planned_events = sum(1 for e in restarts if e.get("planned") or e.get("cause") == "drill")
    if run.drill:
        planned = max(planned, _int(run.drill.get("num_kills"), 1) or 1)
    # A membership change (torchrun restarted the workers because a node joined or left the rendezvous, no worker
    # failed: ckpt/attempt.py) is the elastic job doing its work, not a failure: a warning, never a failure.
    moved = sum(1 for e in restarts if e.get("cause") == "membership change")
    unexpected = max(len(restarts), len(jumps)) - planned - moved
    status = "FAIL" if unexpected > 0 else "WARN" if moved else "PASS"
    checks.append(Check("health", "no unexpected restarts", status,
                        f"{len(restarts)} restart event(s), {len(jumps)} resume(s) in metrics, {planned} planned "
                        f"(fault drill)" + (f", {moved} membership change(s) (a node joined or left)" if moved else "")
                        + (f"; {unexpected} unexpected" if unexpected > 0 else "")
                        + restart_causes(restarts, read_rank_records(run.run_dir, HANG))))
    errors = [f"{e.get('kind')} at step {e.get('step')}: {e.get('message', e.get('error', ''))}"
              for e in run.events_of("error", "oom", "node_lost")]
    errors += [f"alert still firing: {a.get('rule')} ({a.get('message')})" for a in _still_firing(run, rules)]
    # Only a fault that happened in this run (its planned restart events) explains this run's log lines.
    checks.append(_log_check(run, errors=errors, planned=planned_events))
    if run.bad_lines:
        checks.append(Check("health", "run files readable", "WARN", "; ".join(run.bad_lines[:3])))
    return checks


def restart_causes(restarts: list[dict[str, Any]], hangs: list[dict[str, Any]]) -> str:
    """`; causes: 1 hang (ranks [0] aborted after step 3, suspect frozen: [1]), 1 worker failure` ('' if none).
    A restart whose earlier attempt left hang records is a hang even when its event predates the label."""
    hung_attempts = {_int(h.get("attempt"), -1) + 1 for h in hangs}
    labels = []
    for event in restarts:
        cause = event.get("cause") or "worker failure"
        if cause != "hang" and _int(event.get("attempt"), -1) in hung_attempts:
            cause = "hang"
        if cause == "hang":
            ranks = event.get("hang_ranks") or sorted({h.get("rank") for h in hangs
                                                       if _int(h.get("attempt"), -1) + 1 == event.get("attempt")})
            cause += (f" (ranks {ranks} aborted after step {event.get('last_step', '?')}, suspect frozen: "
                      f"{event.get('frozen_ranks', '?')})")
        labels.append(cause)
    return ("; causes: " + ", ".join(f"{n} {label}" for label, n in Counter(labels).items())) if labels else ""


def _log_check(run: RunData, *, errors: list[str], planned: int) -> Check:
    """Errors in events and in every rank's log fail, unless the planned fault (a drill kill) explains them."""
    found = log_errors(run.logs, planned_restarts=planned)
    unexplained = [str(e) for e in found if not e.planned]
    explained = [e for e in found if e.planned]
    named = f"{len(run.logs)} log file(s) read"
    if errors or unexplained:
        return Check("health", "no errors", "FAIL", "; ".join([*errors, *unexplained][:4]) + f" ({named})")
    if explained:
        return Check("health", "no errors", "PASS",
                     f"{len(explained)} log error line(s) from the planned fault, e.g. {explained[0]} ({named})")
    return Check("health", "no errors", "PASS", f"no error events, log errors or firing critical alerts ({named})")


def _still_firing(run: RunData, rules: AlertRules | None) -> list[dict[str, Any]]:
    """Critical alerts whose last record fires, unless the replay of the metrics and events saw the condition clear
    later (e.g. in a later attempt, whose engine never knew the earlier one's alert) and not return."""
    state = {str(alert.get("rule")): alert for alert in run.alerts}
    firing = [a for a in state.values() if a.get("state") == "firing" and a.get("severity") == "critical"]
    replayed = replay_engine(run.metrics, rules=rules, events=run.events) if firing else None
    return [a for a in firing if replayed is None or a.get("rule") in replayed.firing or not any(
        h.rule == a.get("rule") and h.state == "resolved" and h.last_seen >= as_float(a.get("first_seen"))
        for h in replayed.history)]


def convergence_checks(run: RunData, baseline: RunData | None, rules: AlertRules) -> list[Check]:
    checks = []
    steps, losses = run.series("loss")
    finite = losses[np.isfinite(losses)]
    bad_loss, bad_grad = nonfinite_steps(run, "loss"), nonfinite_steps(run, "grad_norm")
    checks.append(Check("convergence", "loss and grad norm finite", "FAIL" if bad_loss or bad_grad else "PASS",
                        f"non-finite loss at steps {bad_loss[:5]}, grad norm at {bad_grad[:5]}"
                        if bad_loss or bad_grad else f"{len(finite)} finite losses"))
    if finite.size < 4:
        checks.append(Check("convergence", "loss falling", "WARN", f"only {finite.size} finite loss records"))
    else:
        window = max(2, finite.size // 5)
        first, last = float(np.mean(finite[:window])), float(np.mean(finite[-window:]))
        falling = last < first * (1 - LOSS_DROP_MIN)
        checks.append(Check("convergence", "loss falling", "PASS" if falling else "FAIL",
                            f"mean loss {first:.4g} over the first {window} records → {last:.4g} "
                            f"over the last {window}"))
    alerts = replay(run.metrics, rules=rules)
    spikes = [a for a in alerts if a.rule == "loss_spike" and a.state == "firing"]
    checks.append(Check("convergence", "no loss spikes", "FAIL" if spikes else "PASS",
                        "; ".join(a.message for a in spikes[:3]) if spikes else
                        f"no loss beyond robust z {rules.loss_spike.z:g} of its running median"))
    explosions = [a for a in alerts if a.rule == "grad_norm_explosion" and a.state == "firing"]
    _, grads = run.series("grad_norm")
    finite_grads = grads[np.isfinite(grads)]
    checks.append(Check("convergence", "grad norm bounded", "FAIL" if explosions else "PASS",
                        "; ".join(a.message for a in explosions[:3]) if explosions else
                        (f"max {finite_grads.max():.3g}, median {np.median(finite_grads):.3g}"
                         if finite_grads.size else "no grad_norm recorded")))
    checks.append(_baseline_check(steps, losses, baseline))
    return checks


def _baseline_check(steps: np.ndarray, losses: np.ndarray, baseline: RunData | None) -> Check:
    if baseline is None:
        return Check("convergence", "matches baseline", "WARN", "no baseline run given (--baseline RUN_DIR)")
    base_steps, base_losses = baseline.series("loss")
    base = {int(s): float(v) for s, v in zip(base_steps, base_losses, strict=True) if math.isfinite(v)}
    ours = {int(s): float(v) for s, v in zip(steps, losses, strict=True) if math.isfinite(v)}
    common = sorted(set(base) & set(ours))
    if not common:
        return Check("convergence", "matches baseline", "FAIL", "no logged step in common with the baseline")
    tail = common[-max(1, len(common) // 5):]
    diff = float(np.mean([abs(ours[s] - base[s]) / max(abs(base[s]), 1e-12) for s in tail]))
    status: Status = "PASS" if diff <= BASELINE_PASS else "WARN" if diff <= BASELINE_WARN else "FAIL"
    return Check("convergence", "matches baseline", status,
                 f"mean relative loss difference {diff:.1%} over steps {tail[0]}–{tail[-1]} "
                 f"(pass ≤ {BASELINE_PASS:.0%})")


def noise_tolerance(values: np.ndarray) -> float:
    """How far below the plan a run may be from its own noise: 2 × the robust record-to-record spread
    (1.4826 × MAD / median) of its steady values, at most NOISE_TOLERANCE_MAX."""
    finite = values[np.isfinite(values)]
    if finite.size < 4 or float(np.median(finite)) <= 0:
        return 0.0
    median = float(np.median(finite))
    spread = 1.4826 * float(np.median(np.abs(finite - median))) / median
    return min(NOISE_TOLERANCE_MAX, 2 * spread)


def _thresholds(values: np.ndarray, pass_at: float, warn_at: float) -> tuple[float, float, str]:
    tol = noise_tolerance(values)
    note = f"; pass ≥ {pass_at - tol:.0%} = {pass_at:.0%} − {tol:.0%} for this run's own spread" if tol > 0 else ""
    return pass_at - tol, warn_at - tol, note


def throughput_checks(run: RunData, plan: PlanTargets) -> list[Check]:
    checks, (_, tokens), (_, mfus) = [], run.series("tokens_per_s"), run.series("mfu")
    tokens_s = float(np.median(steady(tokens))) if steady(tokens).size else math.nan
    mfu = float(np.median(steady(mfus))) if steady(mfus).size else math.nan
    plan_tokens, plan_mfu, plan_gpus = plan.tokens_per_s, plan.mfu, plan.gpus
    world = max(1, run.world_size())
    if not math.isfinite(tokens_s):
        checks.append(Check("throughput", "tokens/s vs plan", "FAIL", "no tokens_per_s in the metrics"))
    elif not math.isfinite(plan_tokens):
        checks.append(Check("throughput", "tokens/s vs plan", "WARN",
                            f"{tokens_s:.4g} tokens/s; "
                            + (plan.problem or "no plan to compare (--plan FILE or plan.json in the run dir)")))
    else:
        per_gpu_plan = plan_tokens / (plan_gpus if math.isfinite(plan_gpus) and plan_gpus > 0 else world)
        ratio = tokens_s / world / per_gpu_plan
        pass_at, warn_at, note = _thresholds(steady(tokens), THROUGHPUT_PASS, THROUGHPUT_WARN)
        status: Status = "PASS" if ratio >= pass_at else "WARN" if ratio >= warn_at else "FAIL"
        why = "" if status == "PASS" else f"; {bound_diagnosis(run)}"
        checks.append(Check("throughput", "tokens/s vs plan", status,
                            f"{tokens_s / world:.4g} tokens/s per GPU vs plan {per_gpu_plan:.4g} ({ratio:.0%})"
                            f"{note}{why}"))
    if not math.isfinite(mfu):
        checks.append(Check("throughput", "MFU vs plan", "WARN", "no mfu in the metrics"))
    elif not math.isfinite(plan_mfu) or plan_mfu <= 0:
        checks.append(Check("throughput", "MFU vs plan", "WARN",
                            f"MFU {mfu:.1%}; {plan.problem or 'no planned MFU to compare'}"))
    else:
        ratio = mfu / plan_mfu
        pass_at, warn_at, note = _thresholds(steady(mfus), MFU_PASS, MFU_WARN)
        status = "PASS" if ratio >= pass_at else "WARN" if ratio >= warn_at else "FAIL"
        why = "" if status == "PASS" else f"; {bound_diagnosis(run)}"
        checks.append(Check("throughput", "MFU vs plan", status,
                            f"MFU {mfu:.1%} vs plan {plan_mfu:.1%} ({ratio:.0%}){note}{why}"))
    return checks


def memory_check(run: RunData, plan: PlanTargets) -> Check:
    _, mem = run.series("mem_bytes")
    ooms = merged_events(run.events_of("oom"), read_rank_records(run.run_dir, OOM))  # every rank's record
    ooms += [{"step": None} for log in run.logs for line in log.error_lines if OOM_RE.search(line)]
    limit, source = run.memory_limit_bytes()
    predicted = plan.memory_bytes
    note = f"; plan predicted {predicted / 2**30:.2f} GiB" if math.isfinite(predicted) else ""
    if ooms:
        return Check("memory", "peak under limit with headroom", "FAIL", f"{len(ooms)} out-of-memory event(s){note}")
    if not np.any(np.isfinite(mem)):
        return Check("memory", "peak under limit with headroom", "WARN", "no mem_bytes in the metrics")
    peak = float(np.nanmax(mem))
    if limit is None:
        return Check("memory", "peak under limit with headroom", "WARN",
                     f"peak {peak / 2**30:.2f} GiB; limit unknown ({source}){note}")
    share = peak / limit
    status: Status = "PASS" if share <= MEMORY_HEADROOM else "WARN" if share <= 1 else "FAIL"
    return Check("memory", "peak under limit with headroom", status,
                 f"peak {peak / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB ({share:.0%}, {source}){note}")


REHEARSAL_FILE = "rehearsal.json"  # `leantrain rehearse --json RUN_DIR/rehearsal.json` (docs/rehearse.md)
REHEARSAL_PEAK_OVER = 1.25  # measured step peak above this × the rehearsed one: something the rehearsal missed


def rehearsal_checks(run: RunData) -> list[Check]:
    """A run against its rehearsal, when RUN_DIR/rehearsal.json exists: each rank's parameters at `model_ready`
    against the rehearsed rank's (within 10 %), and the measured step peak against the rehearsed peak (the
    allocator's cache and the CUDA context come on top, so up to 1.25× passes)."""
    path = run.run_dir / REHEARSAL_FILE
    if not path.is_file():
        return []
    try:
        rehearsed = _rehearsed_bytes(read_json_object(path), source=path)
    except UserInputError as err:  # like a missing plan: the comparison cannot be made, and the file is named
        return [Check("memory", "model_ready vs rehearsal", "WARN", str(err))]
    checks = []
    ready = run.events_of("model_ready")
    listed = (ready[-1].get("ranks") if ready else None) or []
    ranks = {r["rank"]: r for r in listed if isinstance(r, dict) and isinstance(r.get("rank"), int)}
    common = sorted(set(ranks) & set(rehearsed))
    if not common:
        checks.append(Check("memory", "model_ready vs rehearsal", "WARN",
                            "no rank in both model_ready and rehearsal.json"))
    else:
        ratios = {r: as_float(ranks[r].get("param_bytes_local")) / max(1, rehearsed[r]["params"]) for r in common}
        worst = max(ratios, key=lambda r: abs(ratios[r] - 1))
        status: Status = "PASS" if abs(ratios[worst] - 1) <= 0.10 else "FAIL"
        checks.append(Check("memory", "model_ready vs rehearsal", status,
                            f"parameter bytes per rank / rehearsed: worst rank {worst} {ratios[worst]:.2f} "
                            f"({len(common)} ranks compared)"))
    _, mem = run.series("mem_bytes")
    if np.any(np.isfinite(mem)):
        peak = float(np.nanmax(mem))
        rehearsed_peak = max(m["peak"] for m in rehearsed.values())
        share = peak / max(1, rehearsed_peak)
        status = "PASS" if share <= REHEARSAL_PEAK_OVER else "WARN"
        checks.append(Check("memory", "step peak vs rehearsal", status,
                            f"measured {peak / 2**30:.2f} GiB, rehearsed {rehearsed_peak / 2**30:.2f} GiB "
                            f"({share:.2f}×)"))
    return checks


def _rehearsed_bytes(rehearsal: dict[str, Any], *, source: object) -> dict[int, dict[str, float]]:
    """Rank → its rehearsed parameter and peak bytes; a missing key or a wrong type names `source` and the key."""
    if not json_field(rehearsal, "ranks", list, source=source):
        raise UserInputError(f"{source}: key 'ranks' is empty (expected one entry per rehearsed rank)")
    return {json_field(rehearsal, f"ranks.{i}.rank", int, source=source):
            {part: float(json_field(rehearsal, f"ranks.{i}.memory_bytes.{part}", NUMBER, source=source))
             for part in ("params", "peak")}
            for i in range(len(rehearsal["ranks"]))}


def comm_check(run: RunData) -> Check:
    share = step_share(run, "comm_s")
    if not math.isfinite(share):
        if run.world_size() <= 1:
            return Check("communication", "communication share", "PASS", "single process: no collectives")
        return Check("communication", "communication share", "WARN", "no comm_s in the metrics")
    status: Status = "PASS" if share <= COMM_PASS else "WARN" if share <= COMM_WARN else "FAIL"
    return Check("communication", "communication share", status,
                 f"collectives take {share:.0%} of the step (pass ≤ {COMM_PASS:.0%}, fail > {COMM_WARN:.0%})")


def drill_check(run: RunData) -> Check:
    drill = run.drill
    if drill is None:
        return Check("fault tolerance", "fault drill", "WARN", artifact_problem(run, DRILL_FILE)
                     or "no drill.json: run `leantrain drill SPEC` on this setup")
    facts = ", ".join(f"{k} {drill[k]}" for k in ("recovery_s", "steps_lost", "goodput", "max_loss_diff")
                      if k in drill)
    try:
        passed = json_field(drill, "passed", bool, source=run.run_dir / DRILL_FILE, default=False)
    except UserInputError as err:  # the drill's verdict cannot be read: it did not pass
        return Check("fault tolerance", "fault drill", "FAIL", f"{err}; {facts}")
    if passed:
        return Check("fault tolerance", "fault drill", "PASS", f"drill passed: {facts}")
    reason = drill.get("reason") or drill.get("message") or "drill.json says passed: false"
    return Check("fault tolerance", "fault drill", "FAIL", f"{reason}; {facts}")


def validate_run(
    run_dir: Path, *, plan_file: Path | None = None, baseline: Path | None = None, rules: AlertRules | None = None
) -> list[Check]:
    """Every check of the go-live list for one run dir."""
    run_dir = Path(run_dir)
    run = load_run(run_dir) if (run_dir / METRICS_FILE).is_file() else None
    if run is None or not (run.metrics or run.events or run.spec or run.lineage):  # e.g. a file of garbage lines
        what = f"{run_dir / METRICS_FILE} is missing" if run is None else (
            f"{run_dir}: no step record, event, spec.yaml or lineage.json" + "".join(
                f" ({len(run.bad_lines)} unreadable: {line})" for line in run.bad_lines[:1]))
        raise UserInputError(f"{what}: validate needs a run dir written by train/launch")
    plan = load_plan_targets(run, plan_file)
    base, rules = None, rules or AlertRules()
    if baseline is not None:
        if not (Path(baseline) / METRICS_FILE).is_file():
            raise UserInputError(f"--baseline {baseline}: no {METRICS_FILE} there")
        base = load_run(Path(baseline))
        if not np.isfinite(base.series("loss")[1]).any():  # nothing to compare with: an input error, not a FAIL
            raise UserInputError(f"--baseline {baseline}: {Path(baseline) / METRICS_FILE} holds no metric records "
                                 "with a loss; give the run dir of a run that logged training steps")
    return [
        *health_checks(run, rules),
        *convergence_checks(run, base, rules),
        *throughput_checks(run, plan),
        memory_check(run, plan),
        *rehearsal_checks(run),
        comm_check(run),
        drill_check(run),
    ]


def verdict(checks: list[Check], *, strict: bool = False) -> Status:
    if any(c.status == "FAIL" for c in checks) or (strict and any(c.status == "WARN" for c in checks)):
        return "FAIL"
    return "PASS"


def render(checks: list[Check], *, console: Any, result: Status) -> None:
    from rich.table import Table

    colour = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    table = Table(title="go-live validation")
    for column in ("category", "check", "status", "evidence"):
        table.add_column(column, overflow="fold")
    for check in checks:
        table.add_row(check.category, check.name, f"[{colour[check.status]}]{check.status}[/]", check.evidence)
    console.print(table)
    warnings = sum(c.status == "WARN" for c in checks)
    console.print(f"verdict: [{colour[result]}]{result}[/] ({len(checks)} checks, {warnings} warning(s))")


def run(
    *, console: Any, run_dir: Path, plan_file: Path | None = None, baseline: Path | None = None,
    json_out: Path | None = None, strict: bool = False, rules_file: Path | None = None,
) -> list[Check]:
    """CLI entry: print the table, write --json, raise CheckFailed (exit 1) unless the verdict is PASS."""
    checks = validate_run(run_dir, plan_file=plan_file, baseline=baseline, rules=load_rules(rules_file))
    result = verdict(checks, strict=strict)
    render(checks, console=console, result=result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps({"verdict": result, "run_dir": str(run_dir),
                                              "checks": [asdict(c) for c in checks]}, indent=2), encoding="utf-8")
    if result != "PASS":
        failed = [f"{c.category}/{c.name}" for c in checks if c.status == "FAIL" or (strict and c.status == "WARN")]
        raise CheckFailed(f"validation failed: {', '.join(failed)}")
    return checks


def demo_stage(ctx: Any) -> str:
    """Demo: validate the demo's run and report the verdict (the demo goes on either way, and says so)."""
    run_dir = ctx.out_dir / "run"
    checks = validate_run(run_dir)
    result = verdict(checks)
    render(checks, console=ctx.console, result=result)
    failed = [c.name for c in checks if c.status == "FAIL"]
    warned = sum(c.status == "WARN" for c in checks)
    return f"go-live verdict {result}" + (f" (failed: {', '.join(failed)})" if failed else "") + \
        f", {warned} warning(s)"
