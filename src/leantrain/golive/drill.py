"""`leantrain drill SPEC`: kill a rank on purpose and check that the job heals itself without a trace in the loss.

Two short runs of the spec under torchrun (`launch.torchrun.launch_local`, 2 ranks on this machine):
  1. reference — no fault, no restarts;
  2. faulted — `fault.max_restarts` (at least 1) restarts allowed, and the fault hook (ckpt/fault.py) armed
     through the environment: rank 1 is SIGKILLed after step k (given, or drawn at random after the first
     checkpoint), or while the checkpoint of step k is being written (`--during-save`); with
     `--corrupt-latest` it first flips a byte in the newest committed checkpoint, so the resume must detect
     that and fall back to the one before.
torchrun restarts the workers, they resume from the newest good checkpoint and train to the end. The drill
then compares every logged loss of the faulted run (the steps logged before the kill and the ones redone after
it included) with the reference: bit for bit when `training.deterministic` (same world size, so the same
reduction order), else within `LOSS_TOLERANCE_NONDETERMINISTIC`.

A finished run of the same training (`reference_run`: the sections that decide the losses equal, same world
size and steps, no restart, no fault) can stand in for the reference run: `make demo` drills right after its
own 2-rank training, so it reuses that run instead of training it a second time (one launch less: the drill's
time is mostly process start-up and imports). Anything that does not match is said and the reference is run.

Output: RUN_DIR/drill.json (docs/observe.md: passed, reason, recovery_s, steps_lost, goodput, max_loss_diff,
num_kills, plus the drill's settings and `reference_dir`), the runs under RUN_DIR/drill/{reference,faulted}/
(cleared at start). The faulted run's events.jsonl holds the `restart` event (planned: true). Each run has its own
checkpoint location (`drill_checkpoint_url`): with `checkpoint.url` set, the drill never reads or writes the
job's checkpoints.

Goodput = useful step time / (useful step time + recovery time + time to redo the lost steps), with the
median step time of the faulted run: the share of the drill's training time that advanced the model.
When the data dir has no manifest yet the drill runs the prepare pipeline first (`leantrain prepare`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from leantrain.ckpt.fault import MARKER_FILE, FaultPlan
from leantrain.errors import CheckFailed, UserInputError, check_output_dir
from leantrain.launch.resources import TrainCommand
from leantrain.launch.torchrun import launch_local
from leantrain.provenance.lineage import trained_by_other_code
from leantrain.spec.schema import JobSpec

if TYPE_CHECKING:
    from leantrain.demo_context import DemoContext

DRILL_FILE = "drill.json"
DRILL_DIR = "drill"
RUNS = ("reference", "faulted")
MEMORY_RUN = "faulted-memory"  # with checkpoint.memory_interval_steps: the same kill, the node's memory lost too
TIER_KEYS = ("recovery_s", "steps_lost", "goodput", "resumed_from", "max_loss_diff")
NUM_RANKS = 2
KILL_RANK = 1  # not rank 0: the survivor that writes metrics must be torn down and restarted too
LOSS_TOLERANCE_NONDETERMINISTIC = 1e-2  # relative, for specs without training.deterministic
LAUNCH_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 15.0  # a drill run trains for minutes on a CPU: say where it is
# The spec sections that decide a run's losses: a reused reference must equal the drill's in all of them
# (checkpoint cadence, fault handling, monitoring, run dir and cluster do not change a loss: the drill itself
# proves that a resumed run matches bit for bit).
LOSS_SECTIONS = ("task", "model", "finetune", "parallelism", "precision", "data", "training", "hardware")


def run(
    *, console: Console, spec: JobSpec, spec_path: Path, overrides: list[str], profile: str | None,
    run_dir: Path | None, kill_at: int | None, during_save: bool, corrupt_latest: bool,
    reference_run: Path | None = None,
) -> dict[str, Any]:
    """The CLI entry point: run the drill, print the verdict, raise CheckFailed when it did not pass."""
    result = run_drill(spec, spec_path=spec_path, overrides=overrides, profile=profile,
                       run_dir=Path(run_dir or spec.run.dir), kill_at=kill_at, during_save=during_save,
                       corrupt_latest=corrupt_latest, console=console, reference_run=reference_run)
    render(result, console=console)
    if not result["passed"]:
        raise CheckFailed(f"fault drill failed: {result['reason']} (details in {result['drill_file']})")
    return result


def demo_stage(ctx: DemoContext) -> str:
    """Drill the demo spec: kill rank 1 at a random step after the first checkpoint, against the run the demo's
    train stage just finished (the same spec on the same 2 ranks) as the reference."""
    spec = ctx.spec()
    result = run(console=ctx.console, spec=spec, spec_path=ctx.spec_path, overrides=list(ctx.overrides),
                 profile=None, run_dir=Path(spec.run.dir), kill_at=None, during_save=False, corrupt_latest=False,
                 reference_run=Path(spec.run.dir))
    return summary(result)


def summary(result: dict[str, Any]) -> str:
    verdict = "passed" if result["passed"] else f"FAILED ({result['reason']})"
    return (f"drill {verdict}: killed rank {result['kill_rank']} at step {result['kill_at']}, recovered in "
            f"{_fmt(result.get('recovery_s'), 's')}, {result.get('steps_lost')} step(s) lost, goodput "
            f"{_fmt(result.get('goodput'), '')}, max loss diff {result.get('max_loss_diff')}")


def _fmt(value: Any, unit: str) -> str:
    return "?" if value is None else f"{float(value):.3g}{(' ' + unit) if unit else ''}"


# ---- setup ----------------------------------------------------------------------------------------------------
def _ensure_data(spec: JobSpec, console: Console) -> None:
    if (Path(spec.data.dir) / "manifest.json").is_file():
        return
    from leantrain.data.command import build

    console.print(f"drill: {spec.data.dir} has no manifest.json; running the prepare pipeline first")
    build(spec, data_dir=Path(spec.data.dir), console=console)


def _interval_steps(spec: JobSpec, max_steps: int) -> tuple[int, list[str]]:
    """A fixed checkpoint interval for the drill (an `auto` one would not save at all in a short run), and a
    logging cadence whose windows start at every checkpoint (`drill_log_every`)."""
    interval = spec.checkpoint.interval_steps
    if isinstance(interval, int) and interval < max_steps:
        chosen, sets = interval, []
    else:
        chosen = max(1, max_steps // 4)
        sets = [f"checkpoint.interval_steps={chosen}"]
    log_every = drill_log_every(spec, interval=chosen)
    if log_every != spec.log_every:
        sets.append(f"monitoring.log_every={log_every}")
    return chosen, sets


def drill_log_every(spec: JobSpec, *, interval: int) -> int:
    """Steps between the drill runs' metric records. A record's loss is the mean since the previous record, so a
    run resumed from a checkpoint inside a logging window logs a shorter window than the reference at the same step
    (kill at 2, checkpoint every 2, log every 5: the reference's step-4 loss covers steps 1-4, the resumed run's
    steps 3-4, a false mismatch). Logging every gcd(log_every, checkpoint intervals) steps makes every checkpoint
    a window boundary (`monitoring.log_every`, which no loss depends on)."""
    return math.gcd(spec.log_every, interval, spec.checkpoint.memory_interval_steps or 0)


def choose_kill_step(
    *, kill_at: int | None, max_steps: int, interval: int, corrupt_latest: bool, rng: random.Random
) -> int:
    """The given step (checked), or a random one after the first checkpoint (after the second when the
    newest is to be corrupted, so there is an older one to fall back to)."""
    if kill_at is not None:
        if not 1 <= kill_at < max_steps:
            raise UserInputError(f"--kill-at {kill_at}: must be between 1 and {max_steps - 1} (the run has "
                                 f"{max_steps} steps, and the drill needs steps after the kill)")
        return kill_at
    first = (2 if corrupt_latest else 1) * interval + 1
    if first >= max_steps:
        first = interval + 1 if interval + 1 < max_steps else 1
    return rng.randint(first, max_steps - 1)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables for the child processes of one launch; the previous values come back afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def drill_checkpoint_url(spec: JobSpec, *, drill_dir: Path, name: str) -> str | None:
    """Where one drill run keeps its checkpoints: under the drill's run dir, or for an object store a sibling
    prefix of the job's (`<url>.drill/<run dir name>/<run>`), never the job's own location. None: the spec
    has no checkpoint.url, so each run's default (its run dir's checkpoints/) is isolated already."""
    url = spec.checkpoint.url
    if not url:
        return None
    if spec.checkpoint.storage == "object_store":
        return f"{url.rstrip('/')}.drill/{drill_dir.parent.name}/{name}"
    return str(drill_dir / name / "checkpoints")


def isolated_checkpoints(spec: JobSpec, *, drill_dir: Path, name: str) -> list[str]:
    """The --set override giving a drill run its own checkpoint location (cleared first: an earlier drill's
    checkpoints there would be resumed from)."""
    url = drill_checkpoint_url(spec, drill_dir=drill_dir, name=name)
    if url is None:
        return []
    if spec.checkpoint.storage == "object_store":
        from leantrain.ckpt.storage import open_store

        drill_spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"url": url})})
        open_store(drill_spec, run_dir=drill_dir).remove_tree("")
    return [f"checkpoint.url={url}"]


def _tier_overrides(spec: JobSpec, *, drill_dir: Path, name: str) -> list[str]:
    """The durable-tier runs train without the fast tier; the memory run starts with an empty one."""
    if spec.checkpoint.memory_interval_steps is None:
        return []
    if name != MEMORY_RUN:
        return ["checkpoint.memory_interval_steps=null"]
    from leantrain.ckpt.memory_tier import memory_root

    shutil.rmtree(memory_root(spec.checkpoint.memory_dir, drill_dir / name), ignore_errors=True)
    return []


def _add_memory_tier(result: dict[str, Any], **analysis: Any) -> None:
    """Both tiers' recovery numbers side by side; the drill passes only when both runs pass."""
    runs = analysis.pop("runs")
    memory = analyse(runs={"reference": runs["reference"], "faulted": runs[MEMORY_RUN]}, **analysis)
    result["tiers"] = {"durable": {k: result.get(k) for k in TIER_KEYS},
                       "memory": {**{k: memory.get(k) for k in TIER_KEYS}, "passed": memory["passed"],
                                  "reason": memory["reason"], "faulted_wall_s": memory["faulted_wall_s"]}}
    if not memory["passed"]:
        result["passed"] = False
        result["reason"] = "; ".join(r for r in (result["reason"], f"memory tier: {memory['reason']}") if r)


# ---- the drill ------------------------------------------------------------------------------------------------
def run_drill(
    spec: JobSpec, *, spec_path: Path, overrides: list[str], profile: str | None, run_dir: Path,
    kill_at: int | None, during_save: bool, corrupt_latest: bool, console: Console, nproc: int = NUM_RANKS,
    seed: int | None = None, reference_run: Path | None = None,
) -> dict[str, Any]:
    """Run reference and faulted trainings, compare them, write RUN_DIR/drill.json; returns its content.
    `reference_run`: a finished run to use as the reference when it is the same training (`reusable_reference`)."""
    check_output_dir(run_dir, "run dir")  # a file there: refused before two launches fail on it
    _ensure_data(spec, console)
    max_steps = spec.training.max_steps or max(1, round(spec.data.tokens_total / spec.training.global_batch_tokens))
    if max_steps < 3:
        raise UserInputError(f"training.max_steps is {max_steps}: the drill needs at least 3 steps")
    interval, extra_sets = _interval_steps(spec, max_steps)
    rng = random.Random(seed)
    step = choose_kill_step(kill_at=kill_at, max_steps=max_steps, interval=interval, corrupt_latest=corrupt_latest,
                            rng=rng)
    plan = FaultPlan(kill_at_step=step, kill_rank=min(KILL_RANK, nproc - 1), during_save=during_save,
                     corrupt_latest=corrupt_latest)
    run_dir = Path(run_dir).resolve()
    drill_dir = run_dir / DRILL_DIR
    shutil.rmtree(drill_dir, ignore_errors=True)  # old checkpoints here would be resumed from
    names = (*RUNS, MEMORY_RUN) if spec.checkpoint.memory_interval_steps is not None else RUNS
    trains = {name: TrainCommand(spec_path=Path(spec_path), profile=profile, overrides=(
        *overrides, *extra_sets, *isolated_checkpoints(spec, drill_dir=drill_dir, name=name),
        *_tier_overrides(spec, drill_dir=drill_dir, name=name))) for name in names}
    faults = {"reference": None, "faulted": plan, MEMORY_RUN: dataclasses.replace(plan, lose_node=True)}
    max_restarts = max(1, spec.fault.max_restarts)
    reference_dir = drill_dir / "reference"
    runs: dict[str, dict[str, Any]] = {}
    if reference_run is not None:
        why_not = reusable_reference(Path(reference_run), spec=spec, nproc=nproc, max_steps=max_steps,
                                     log_every=drill_log_every(spec, interval=interval))
        if why_not is None:
            reference_dir = Path(reference_run).resolve()
            runs["reference"] = {"exit_code": 0, "wall_s": None, "reused": str(reference_dir)}
            names = tuple(n for n in names if n != "reference")
            console.print(f"drill: reference = the finished run in {reference_dir} (same training, {nproc} ranks, "
                          f"{max_steps} steps, no restart)", highlight=False)
        else:
            console.print(f"drill: {reference_run} cannot be the reference ({why_not}); running one", highlight=False)
    console.print(f"drill: {nproc} ranks, {max_steps} steps, checkpoint every {interval}; kill rank "
                  f"{plan.kill_rank} at step {step}{' mid-save' if during_save else ''}"
                  f"{', corrupting the newest checkpoint first' if corrupt_latest else ''}; up to {max_restarts} "
                  f"restart(s)")
    logs = Console(file=io.StringIO(), width=160)
    for name in names:
        start, fault = time.monotonic(), faults[name]
        restarts = 0 if fault is None else max_restarts
        with environment({} if fault is None else fault.to_env()), _progress(
                console, name=name, run_dir=drill_dir / name, max_steps=max_steps):
            code = launch_local(spec, train=trains[name], run_dir=drill_dir / name, nproc=nproc, nnodes=None,
                                max_restarts=restarts, console=logs, timeout_s=LAUNCH_TIMEOUT_S)
        runs[name] = {"exit_code": code, "wall_s": time.monotonic() - start}
        console.print(f"drill: {name} run exit code {code} in {runs[name]['wall_s']:.1f} s")
    result = analyse(reference_dir=reference_dir, faulted_dir=drill_dir / "faulted", plan=plan,
                     max_steps=max_steps, deterministic=spec.training.deterministic, runs=runs,
                     corrupt_latest=corrupt_latest)
    if MEMORY_RUN in runs:
        _add_memory_tier(result, reference_dir=reference_dir, faulted_dir=drill_dir / MEMORY_RUN,
                         plan=plan, max_steps=max_steps, deterministic=spec.training.deterministic, runs=runs,
                         corrupt_latest=corrupt_latest)
    result.update({"kill_at": step, "kill_rank": plan.kill_rank, "during_save": during_save,
                   "corrupt_latest": corrupt_latest, "num_ranks": nproc, "max_steps": max_steps,
                   "interval_steps": interval, "max_restarts": max_restarts, "drill_dir": str(drill_dir),
                   "reference_dir": str(reference_dir), "reference_reused": "reused" in runs["reference"],
                   "drill_file": str(Path(run_dir) / DRILL_FILE), "time": time.time()})
    if not result["passed"]:
        tail = logs.file.getvalue().splitlines()[-30:]  # type: ignore[attr-defined]
        console.print("drill: last lines of the launches:\n" + "\n".join(tail), markup=False, highlight=False)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / DRILL_FILE).write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return result


def reusable_reference(run_dir: Path, *, spec: JobSpec, nproc: int, max_steps: int,
                       log_every: int | None = None) -> str | None:
    """Why the finished run in `run_dir` cannot be the drill's reference, or None when it can: its spec.yaml
    equals `spec` in every LOSS_SECTIONS section, it ran on `nproc` ranks for `max_steps` steps, logged every
    `log_every` steps (when given) and a loss at the last one, it had no restart and no injected fault, and this
    code trained it in one attempt (`trained_by_other_code`). (A reference that still differed would fail the
    drill on the loss comparison, never pass it.)"""
    import yaml

    try:
        recorded = yaml.safe_load((run_dir / "spec.yaml").read_text(encoding="utf-8"))
        info = json.loads((run_dir / "train_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as err:
        return f"no finished run there: {type(err).__name__}: {err}"
    if not isinstance(recorded, dict) or not isinstance(info, dict):
        return "no finished run there: its spec.yaml or train_info.json is not a mapping"
    mine = spec.model_dump(mode="json")
    differs = [name for name in LOSS_SECTIONS if recorded.get(name) != mine.get(name)]
    if differs:
        return f"its spec differs in {', '.join(differs)}"
    if info.get("world_size") != nproc or info.get("max_steps") != max_steps:
        return f"it ran {info.get('max_steps')} steps on {info.get('world_size')} ranks, the drill needs " \
               f"{max_steps} on {nproc}"
    logged = (recorded.get("monitoring") or {}).get("log_every") or (recorded.get("training") or {}).get("log_every")
    if log_every is not None and logged != log_every:
        return f"it logged every {logged} step(s), the drill every {log_every} (each checkpoint starts a window)"
    losses = losses_by_step(_read_jsonl(run_dir / "metrics.jsonl"))
    if max(losses, default=0) != max_steps:
        return f"its last logged loss is at step {max(losses, default=0)}, not {max_steps}"
    if (run_dir / MARKER_FILE).exists() or any(e.get("kind") == "restart"
                                               for e in _read_jsonl(run_dir / "events.jsonl")):
        return "it restarted or had a fault injected"
    return trained_by_other_code(run_dir)


# ---- judging --------------------------------------------------------------------------------------------------
@contextmanager
def _progress(console: Console, *, name: str, run_dir: Path, max_steps: int) -> Iterator[None]:
    """A line every PROGRESS_EVERY_S while a drill run trains (its launch output goes to a buffer): the newest
    step in its metrics.jsonl, and a restart when the steps start again lower."""
    stop, start = threading.Event(), time.monotonic()

    def report() -> None:
        newest = 0
        while not stop.wait(PROGRESS_EVERY_S):
            steps = [r["step"] for r in _read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)]
            step = steps[-1] if steps else 0
            again = " (restarted from a checkpoint)" if step < newest else ""
            newest = step
            console.print(f"drill: {name} run at step {step} of {max_steps}{again}, "
                          f"{time.monotonic() - start:.0f} s", highlight=False)

    thread = threading.Thread(target=report, name=f"drill-progress-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from the killed attempt
    return out


def losses_by_step(metrics: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Every logged training loss per step, in order (a redone step appears once per attempt)."""
    out: dict[int, list[float]] = {}
    for record in metrics:
        try:  # a line that is no training record (an event, a hand-edited step) is not a loss
            step, loss = int(record["step"]), float(record["loss"])
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        out.setdefault(step, []).append(loss)
    return out


def compare_losses(
    reference: dict[int, list[float]], faulted: dict[int, list[float]], *, tolerance: float
) -> tuple[float, str | None]:
    """The largest |faulted − reference| over every record, and what is wrong (None when within tolerance)."""
    missing = sorted(set(reference) - set(faulted))
    if missing:
        return math.inf, f"steps {missing[:5]} were never logged after the restart"
    worst, where = 0.0, None
    for step, ref in reference.items():
        for value in faulted[step]:
            diff = abs(value - ref[-1])
            if math.isnan(diff):
                diff = math.inf
            if diff > worst:
                worst, where = diff, step
    limit = tolerance * max(abs(v[-1]) for v in reference.values()) if reference else 0.0
    if worst > limit:
        return worst, f"loss differs from the reference by {worst:.3g} at step {where} (allowed {limit:.3g})"
    return worst, None


def analyse(
    *, reference_dir: Path, faulted_dir: Path, plan: FaultPlan, max_steps: int, deterministic: bool,
    runs: dict[str, dict[str, Any]], corrupt_latest: bool,
) -> dict[str, Any]:
    """Turn the two run dirs into drill.json's verdict and numbers."""
    metrics = _read_jsonl(faulted_dir / "metrics.jsonl")
    events = _read_jsonl(faulted_dir / "events.jsonl")
    restarts = [e for e in events if e.get("kind") == "restart"]
    marker = faulted_dir / MARKER_FILE
    tolerance = 0.0 if deterministic else LOSS_TOLERANCE_NONDETERMINISTIC
    reference = losses_by_step(_read_jsonl(reference_dir / "metrics.jsonl"))
    max_diff, loss_problem = compare_losses(reference, losses_by_step(metrics), tolerance=tolerance)
    recovery = [float(e["recovery_s"]) for e in restarts if e.get("recovery_s") is not None]
    resumed_from = restarts[0].get("resumed_from") if restarts else None
    steps_lost = plan.kill_at_step - int(resumed_from or 0) if restarts else None
    step_times = [float(r["step_time_s"]) for r in metrics if r.get("step_time_s")]
    median_step_s = statistics.median(step_times) if step_times else None
    goodput = None
    if median_step_s is not None and steps_lost is not None:
        useful_s = max_steps * median_step_s
        goodput = useful_s / (useful_s + sum(recovery) + steps_lost * median_step_s)
    fallbacks = [e for e in events if e.get("kind") in ("checkpoint_fallback", "checkpoint_invalid")]
    reasons = []
    if runs["reference"]["exit_code"] != 0:
        reasons.append(f"the reference run failed (exit code {runs['reference']['exit_code']})")
    if runs["faulted"]["exit_code"] != 0:
        reasons.append(f"the faulted run did not recover (exit code {runs['faulted']['exit_code']})")
    if not marker.is_file():
        reasons.append("the fault never fired (no fault marker)")
    if not restarts:
        reasons.append("no restart event was recorded")
    if corrupt_latest and not fallbacks:
        reasons.append("the corrupted checkpoint was not detected (no checkpoint_invalid/fallback event)")
    if loss_problem and runs["reference"]["exit_code"] == 0:
        reasons.append(loss_problem)
    return {
        "passed": not reasons,
        "reason": "; ".join(reasons) or None,
        "recovery_s": sum(recovery) if recovery else None,
        "steps_lost": steps_lost,
        "goodput": goodput,
        "max_loss_diff": None if math.isinf(max_diff) else max_diff,
        "loss_tolerance": tolerance,
        "num_kills": 1 if marker.is_file() else 0,
        "num_restarts": len(restarts),
        "resumed_from": resumed_from,
        "fallback_events": len(fallbacks),
        "median_step_s": median_step_s,
        "reference_wall_s": runs["reference"]["wall_s"],
        "faulted_wall_s": runs["faulted"]["wall_s"],
    }


def render(result: dict[str, Any], *, console: Console) -> None:
    table = Table(title="fault drill")
    table.add_column("")
    table.add_column("value")
    rows = [
        ("verdict", "[green]PASS" if result["passed"] else f"[red]FAIL[/red]: {result['reason']}"),
        ("fault", f"SIGKILL rank {result['kill_rank']} after step {result['kill_at']}"
                  + (" mid-save" if result["during_save"] else "")
                  + (", newest checkpoint corrupted" if result["corrupt_latest"] else "")),
        ("restarts", f"{result['num_restarts']} (resumed from step {result['resumed_from']})"),
        ("recovery time", _fmt(result["recovery_s"], "s")),
        ("steps lost", str(result["steps_lost"])),
        ("goodput", _fmt(result["goodput"], "")),
        ("max loss diff", f"{result['max_loss_diff']} (allowed {result['loss_tolerance']} relative)"),
        ("wall time", ("reference reused" if result["reference_wall_s"] is None
                       else f"reference {result['reference_wall_s']:.1f} s") + f", faulted "
                      f"{result['faulted_wall_s']:.1f} s"),
        ("result file", result["drill_file"]),
    ]
    for tier, numbers in (result.get("tiers") or {}).items():
        rows.insert(-1, (f"{tier} tier", f"resumed from step {numbers['resumed_from']}, {numbers['steps_lost']} "
                                         f"step(s) lost, recovery {_fmt(numbers['recovery_s'], 's')}, goodput "
                                         f"{_fmt(numbers['goodput'], '')}"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
