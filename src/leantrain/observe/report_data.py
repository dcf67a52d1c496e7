"""Reading a run dir: the file contract (metrics, alerts, events, plan, checkpoints, drill, logs) as one object.

`report`, `validate` and `doctor` read runs only through here, so the contract in docs/observe.md is parsed
in one place, and a malformed line is counted and shown instead of crashing a diagnosis. The writers
(`append_jsonl`, `append_event`) are here too, so the checkpoint and launch code write what this reads.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from leantrain.observe.logs import LogFile, log_paths, read_logs

METRICS_FILE = "metrics.jsonl"
RANK_METRICS_RE = re.compile(r"^metrics-rank(\d+)\.jsonl$")
ALERTS_FILE = "alerts.jsonl"
EVENTS_FILE = "events.jsonl"
PLAN_FILE = "plan.json"
DRILL_FILE = "drill.json"
LINEAGE_FILE = "lineage.json"
TRAIN_INFO_FILE = "train_info.json"  # the trainer's run facts: world_size, device, peak_flops, ...
SPEC_FILES = ("spec.yaml", "spec.json")
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_RE = re.compile(r"^step-(\d+)$")

# Event kinds that docs/observe.md defines; writers may add others (they are shown, not interpreted).
EVENT_KINDS = (
    "start", "rank_joined", "resume", "restart", "checkpoint_saved", "checkpoint_failed",
    "oom", "node_lost", "error", "preempted", "finish",
)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line and flush, so a crash right after loses nothing already written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
        handle.flush()


def append_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Record a run event (restart, checkpoint save, OOM, ...) in run_dir/events.jsonl; returns the record."""
    record = {"time": time.time(), "kind": kind, **fields}
    append_jsonl(Path(run_dir) / EVENTS_FILE, record)
    return record


def as_float(value: Any) -> float:
    """A metric value as float; missing or unparsable values become NaN so series keep their length."""
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _step_problem(record: dict[str, Any]) -> str | None:
    """Why a metrics record cannot be placed on a step axis (a hand-edited or foreign file), else None. Event
    records that reach metrics.jsonl through the logger are not steps and are left to `load_run`."""
    step = record.get("step")
    if "event" in record or (isinstance(step, int | float) and not isinstance(step, bool) and math.isfinite(step)):
        return None
    return "no step" if "step" not in record else f"step is not a number ({json.dumps(step)[:40]})"


# World-size-long lists on every metrics record; only the newest record's are read whole (validate, doctor), so
# the reader keeps them there alone: 4,096 ranks × 90k records would otherwise be tens of GB. Earlier records keep
# `rank_step_time_s` as {slowest rank: its time, -1: the other ranks' median}, all the straggler rule reads.
PER_RANK_KEYS = ("rank_step_time_s", "rank_mem_bytes")


def absent_ranks(world: int, present: set[Any], limit: int = 10) -> list[int]:
    """The first `limit` ranks below `world` not in `present` (a world size read from a file may be huge)."""
    return list(itertools.islice((r for r in range(world) if r not in present), limit))


def slowest_rank(value: Any) -> dict[int, float]:
    """Per-rank step times (a list by rank or a {rank: seconds} mapping) as {slowest rank: seconds, -1: the median
    of the others}; {} when fewer than two ranks have a number."""
    pairs = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else ()
    times = {int(r): v for r, v in ((as_float(r), as_float(s)) for r, s in pairs) if math.isfinite(r + v)}
    if len(times) < 2:
        return {}
    slow = max(times, key=lambda r: times[r])
    return {slow: times[slow], -1: float(np.median([v for r, v in times.items() if r != slow]))}


def _read_jsonl(path: Path, bad_lines: list[str], *, metrics: bool = False, limit: int | None = None
                ) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; a line that is not one is named in `bad_lines` and left out, and so is
    (with `metrics`) a record whose step is not a number. With `metrics` the per-rank lists (PER_RANK_KEYS) stay
    on the newest record that has them only; with `limit`, reading stops after that many records."""
    records: list[dict[str, Any]] = []
    newest: tuple[dict[str, Any], dict[str, Any]] | None = None  # (record, its per-rank lists)
    if not path.is_file():
        return records
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                # A torn last line is what a killed writer leaves; keep reading, but say so.
                bad_lines.append(f"{path.name}:{number}: not JSON ({err.msg})")
                continue
            if not isinstance(record, dict):
                bad_lines.append(f"{path.name}:{number}: not a JSON object")
            elif metrics and (problem := _step_problem(record)):
                bad_lines.append(f"{path.name}:{number}: {problem}; left out")
            else:
                lists = {key: record.pop(key) for key in PER_RANK_KEYS if metrics and key in record}
                if lists:
                    newest = (record, lists)
                    if summary := slowest_rank(lists.get("rank_step_time_s")):
                        record["rank_step_time_s"] = summary
                records.append(record)
                if limit is not None and len(records) >= limit:
                    break
    if newest is not None:
        newest[0].update(newest[1])
    return records


def _read_json(path: Path, bad_lines: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        bad_lines.append(f"{path.name}: unreadable ({err})")
        return None
    if not isinstance(data, dict):
        bad_lines.append(f"{path.name}: not a JSON object (a {type(data).__name__}); left out")
        return None
    return data


def _read_spec(run_dir: Path, bad_lines: list[str]) -> dict[str, Any] | None:
    for name in SPEC_FILES:
        path = run_dir / name
        if path.is_file():
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
            except yaml.YAMLError as err:
                bad_lines.append(f"{name}: unreadable ({err})")
                return None
            return data if isinstance(data, dict) else None
    return None


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder: its step, whether it was committed, and when it was written."""

    step: int
    path: Path
    committed: bool
    has_manifest: bool
    time_s: float


def _is_commit_marker(path: Path) -> bool:
    return "commit" in path.name.lower()


def _read_checkpoints(run_dir: Path) -> list[Checkpoint]:
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if not match or not child.is_dir():
            continue
        markers = [p for p in child.iterdir() if _is_commit_marker(p)]
        stamp = max((p.stat().st_mtime for p in markers), default=child.stat().st_mtime)
        found.append(Checkpoint(
            step=int(match.group(1)), path=child, committed=bool(markers),
            has_manifest=(child / "manifest.json").is_file(), time_s=stamp,
        ))
    return sorted(found, key=lambda c: c.step)


@dataclass
class RunData:
    """Everything a run dir holds that observe/validate/doctor read; missing files are empty, not errors."""

    run_dir: Path
    metrics: list[dict[str, Any]]  # the per-rank lists (PER_RANK_KEYS) only on the newest record that had them
    rank_metrics: dict[int, list[dict[str, Any]]]  # each rank's first record: only who reported is read
    alerts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    plan: dict[str, Any] | None
    spec: dict[str, Any] | None
    drill: dict[str, Any] | None
    lineage: dict[str, Any] | None
    checkpoints: list[Checkpoint]
    logs: list[LogFile]  # every process log (observe/logs.py): tail and error lines
    bad_lines: list[str] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_info: dict[str, Any] | None = None
    eval_results: dict[str, Any] | None = None  # eval.json written by `leantrain eval`

    def series(self, key: str, records: list[dict[str, Any]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) for one metric in file order (not sorted: a resume jump must stay visible)."""
        rows = [r for r in (self.metrics if records is None else records) if "step" in r]
        steps = np.array([as_float(r.get("step")) for r in rows], dtype=float)
        values = np.array([as_float(r.get(key)) for r in rows], dtype=float)
        return steps, values

    def has(self, key: str) -> bool:
        return any(key in r and r[key] is not None for r in self.metrics)

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") in kinds]

    def plan_get(self, dotted: str) -> Any:
        return _get(self.plan, dotted)

    def spec_get(self, dotted: str) -> Any:
        return _get(self.spec, dotted)

    def world_size(self) -> int:
        """Ranks of the run: from the metrics, then the start event, then the plan's layout, else 1."""
        for record in reversed(self.metrics):
            if isinstance(record.get("world_size"), int):
                return int(record["world_size"])
        for event in reversed(self.events_of("start")):
            if isinstance(event.get("world_size"), int):
                return int(event["world_size"])
        if isinstance((self.train_info or {}).get("world_size"), int):
            return int(self.train_info["world_size"])  # type: ignore[index]
        if self.rank_metrics:
            return max(self.rank_metrics) + 1
        layout = self.plan_get("layout") or {}
        product = 1
        for axis in ("dp", "tp", "pp"):
            if isinstance(layout.get(axis), int):
                product *= layout[axis]
        return product

    def price_per_gpu_hour(self) -> tuple[float | None, str]:
        """Price and where it came from: the spec copy in the run dir, else plan cost / GPU-hours."""
        price = self.spec_get("budget.price_per_gpu_hour")
        currency = self.spec_get("budget.currency") or "USD"
        if isinstance(price, int | float):
            return float(price), f"{currency} (spec budget.price_per_gpu_hour)"
        cost, gpu_hours = self.plan_get("cost.total"), self.plan_get("time.gpu_hours")
        if isinstance(cost, int | float) and isinstance(gpu_hours, int | float) and gpu_hours > 0:
            return float(cost) / float(gpu_hours), "plan.json cost.total / time.gpu_hours"
        return None, "no spec.yaml or plan.json with a price in the run dir"

    def memory_limit_bytes(self) -> tuple[float | None, str]:
        """Per-device memory limit: metrics `mem_limit_bytes`, else the spec's accelerator from the catalog."""
        limits = [as_float(r.get("mem_limit_bytes")) for r in self.metrics]
        finite = [v for v in limits if math.isfinite(v) and v > 0]
        if finite:
            return max(finite), "metrics mem_limit_bytes"
        memory_gb = self.spec_get("hardware.memory_gb")
        if isinstance(memory_gb, int | float):
            return float(memory_gb) * 1e9, "spec hardware.memory_gb"
        name = self.spec_get("hardware.accelerator")
        if name is None and (self.train_info or {}).get("device") == "cpu":
            name = "cpu"
        if isinstance(name, str):
            from leantrain.hardware import canonical_name, get_accelerator, host_memory_bytes

            canon = canonical_name(name)
            if canon == "cpu":
                return host_memory_bytes(), "host memory (accelerator cpu)"
            if canon is not None:
                return get_accelerator(canon).memory_bytes, f"catalog memory of {canon}"
        return None, "no mem_limit_bytes in metrics, no spec.yaml and no device in train_info.json"


def _get(tree: dict[str, Any] | None, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _split_by_rank(
    records: list[dict[str, Any]], rank_files: dict[int, list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    by_rank: dict[int, list[dict[str, Any]]] = {k: list(v) for k, v in rank_files.items()}
    ranked = [r for r in records if isinstance(r.get("rank"), int)]
    ranks = {r["rank"] for r in ranked}
    if len(ranks) <= 1:
        return records, by_rank
    # Several ranks in one file: the main stream is the lowest rank (rank 0 logs the global view).
    main_rank = min(ranks)
    for record in ranked:
        if not by_rank.get(record["rank"]):
            by_rank[record["rank"]] = [record]
    main = [r for r in records if r.get("rank") in (None, main_rank)]
    return main, by_rank


def load_run(run_dir: Path) -> RunData:
    """Read a run dir. Raises nothing for missing files: callers decide what they need."""
    run_dir = Path(run_dir)
    bad: list[str] = []
    rank_files: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(run_dir.glob("metrics-rank*.jsonl")):
        match = RANK_METRICS_RE.match(path.name)
        if match:
            rank_files[int(match.group(1))] = _read_jsonl(path, bad, metrics=True, limit=1)
    records = _read_jsonl(run_dir / METRICS_FILE, bad, metrics=True)
    # Held-out evaluation records share the file ({"step", "eval_loss", ...}); they are not training steps.
    evals = [r for r in records if "eval_loss" in r and "loss" not in r]
    # Event records (checkpoint_failed, ...) reach metrics.jsonl through the same logger; they are not steps.
    records = [r for r in records if not ("eval_loss" in r and "loss" not in r) and "event" not in r]
    metrics, rank_metrics = _split_by_rank(records, rank_files)
    return RunData(
        run_dir=run_dir,
        metrics=metrics,
        rank_metrics=rank_metrics,
        alerts=_read_jsonl(run_dir / ALERTS_FILE, bad),
        events=_read_jsonl(run_dir / EVENTS_FILE, bad),
        plan=_read_json(run_dir / PLAN_FILE, bad),
        spec=_read_spec(run_dir, bad),
        drill=_read_json(run_dir / DRILL_FILE, bad),
        lineage=_read_json(run_dir / LINEAGE_FILE, bad),
        checkpoints=_read_checkpoints(run_dir),
        logs=read_logs(run_dir),
        bad_lines=bad,
        evals=evals,
        train_info=_read_json(run_dir / TRAIN_INFO_FILE, bad),
        eval_results=_read_json(run_dir / "eval.json", bad),
    )


RUN_DIR_FILES = (*SPEC_FILES, LINEAGE_FILE, PLAN_FILE, METRICS_FILE, EVENTS_FILE, ALERTS_FILE, TRAIN_INFO_FILE,
                 DRILL_FILE)


def is_run_dir(run_dir: Path) -> bool:
    """Whether a folder holds anything a run writes: its description files (written before the first step),
    metrics or events, checkpoints, or process logs, so a run that crashed before its first metric record counts."""
    run_dir = Path(run_dir)
    return (any((run_dir / name).is_file() for name in RUN_DIR_FILES) or (run_dir / CHECKPOINT_DIR).is_dir()
            or (run_dir / "logs").is_dir() or any(run_dir.glob("metrics-rank*.jsonl")) or bool(log_paths(run_dir)))


def plan_mismatch(plan: dict[str, Any], spec: Any) -> list[str]:
    """Where plan.json describes another job than `spec` (a JobSpec, or a run's spec.yaml as a dict): the model's
    layers, width and vocabulary and the accelerator, each as `field plan → spec`. [] when they agree, or when the
    spec cannot be read (an old run's spec.yaml: nothing to compare with)."""
    from leantrain.errors import LeantrainError
    from leantrain.spec import JobSpec, spec_from_dict
    from leantrain.spec.shapes import resolve_shape

    keys = ("n_layers", "d_model", "vocab_size")
    try:
        job = spec if isinstance(spec, JobSpec) else spec_from_dict(spec)
        shape = resolve_shape(job.model)
        ours = {key: getattr(shape, key) for key in keys} | {"accelerator": job.hardware.accelerator}
    except (LeantrainError, TypeError, ValueError):  # a partial or old spec.yaml: what it states
        raw = spec if isinstance(spec, dict) else {}
        ours = {key: (raw.get("model") or {}).get(key) for key in keys}
        ours["accelerator"] = (raw.get("hardware") or {}).get("accelerator")
    model, resources = plan.get("model") or {}, plan.get("resources") or {}
    pairs = [(f"model.{key}", model.get(key), ours[key]) for key in keys]
    pairs.append(("hardware.accelerator", resources.get("accelerator"), ours["accelerator"]))
    return [f"{name} {planned} → {mine}" for name, planned, mine in pairs
            if planned is not None and mine is not None and planned != mine]


def load_plan_file(path: Path, *, spec: Any = None) -> dict[str, Any]:
    """A plan.json given on the command line; errors name the file. With `spec` (a JobSpec or a run's spec.yaml
    dict): a plan made for another job (`plan_mismatch`) is refused too, as its targets would judge this one."""
    from leantrain.errors import UserInputError, read_json_object

    if not path.is_file():
        raise UserInputError(f"--plan {path}: no such file (write one with `leantrain plan SPEC --json FILE`)")
    data = read_json_object(path, option="--plan")
    if spec is not None and (differs := plan_mismatch(data, spec)):
        raise UserInputError(f"--plan {path}: planned for another job ({'; '.join(differs)}, plan → spec); write "
                             "one from this spec: leantrain plan SPEC --json FILE")
    return data


def resume_points(run: RunData) -> list[int]:
    """Indices into run.metrics where the step goes backwards or repeats: a resume from a checkpoint."""
    steps, _ = run.series("loss")
    return [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]


def median_finite(values: np.ndarray | list[float]) -> float:
    array = np.asarray(values, dtype=float)
    finite = array[np.isfinite(array)]
    return float(np.median(finite)) if finite.size else math.nan


def steady(values: np.ndarray, *, skip_fraction: float = 0.1, min_skip: int = 1) -> np.ndarray:
    """Finite values after the warm-up records (compile, cold caches), which would bias throughput low."""
    array = np.asarray(values, dtype=float)
    skip = max(min_skip, int(len(array) * skip_fraction)) if len(array) > 2 * min_skip else 0
    tail = array[skip:]
    return tail[np.isfinite(tail)]


# A run is data-bound above this share of the step spent waiting for data, communication-bound above the
# second; validate's bound diagnosis and doctor's low-utilisation finding share them so they never disagree.
DATA_BOUND_SHARE, COMM_BOUND_SHARE = 0.15, 0.3


# Measured in the one profiled step of each log window, so a share of that step (`profile_step_s`), not of the
# window's other steps (`step_time_s`): they can differ by several times on a noisy host.
PROFILED_KEYS = ("comm_s",)


def step_share(run: RunData, key: str) -> float:
    """Median over the steady part of the run of `key` (e.g. data_wait_s, comm_s) / the step it was measured in:
    `profile_step_s` for comm_s (when recorded), else step_time_s."""
    _, part = run.series(key)
    _, whole = run.series("step_time_s")
    if key in PROFILED_KEYS:
        _, profiled = run.series("profile_step_s")
        whole = np.where(np.isfinite(profiled) & (profiled > 0), profiled, whole)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = steady(part / np.where(whole > 0, whole, np.nan))
    return float(np.median(ratio)) if ratio.size else math.nan


def nonfinite_steps(run: RunData, key: str) -> list[int]:
    """Steps whose `key` was NaN/inf: a NaN value, or (as the JSONL sink writes it) null listed in `nonfinite`."""
    out = []
    for record in run.metrics:
        listed = record.get("nonfinite") if isinstance(record.get("nonfinite"), list) else []
        value = record.get(key)
        if key in listed or (value is not None and not math.isfinite(as_float(value))):
            out.append(int(as_float(record.get("step"))) if math.isfinite(as_float(record.get("step"))) else -1)
    return out
