"""Alert rules evaluated on every metrics record, plus a watchdog thread for hangs and low disk.

The engine is a metrics sink (`write(record)`, `close()`), so the trainer adds it beside the JSONL and
TensorBoard sinks without touching its loop. Each alert has a rule, severity, message, first/last seen and
a count; it is emitted when it starts firing and again when it resolves, to every output (alerts.jsonl,
console, webhook). `replay` runs the same rules over a finished run's metrics, so validate and doctor
judge a run by exactly the rules that watched it.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from leantrain.observe.alert_rules import (
    AlertRules,
    CheckpointFailureRule,
    DataWaitRule,
    GradNormRule,
    HangRule,
    LossSpikeRule,
    LowDiskRule,
    LowMfuRule,
    NonFiniteRule,
    Rule,
    Severity,
    StragglerRule,
    ThroughputDropRule,
    load_rules,
)
from leantrain.observe.disk import disk_report, watched_dirs
from leantrain.observe.report_data import ALERTS_FILE, EVENTS_FILE, append_jsonl, as_float

AlertOutput = Callable[[dict[str, Any]], None]
# (condition holds, message, rank, clear: past the threshold by the resolve margin; None: not condition)
Verdict = tuple[bool, str, "int | None", "bool | None"]
__all__ = [  # the rules file's models live in observe/alert_rules.py; importers keep finding them here
    "AlertRules", "CheckpointFailureRule", "DataWaitRule", "GradNormRule", "HangRule", "LossSpikeRule", "LowDiskRule",
    "LowMfuRule", "NonFiniteRule", "Rule", "Severity", "StragglerRule", "ThroughputDropRule", "load_rules",
    "Alert", "AlertEngine", "JsonlAlertOutput", "ConsoleAlertOutput", "engine_from_spec", "replay", "replay_engine",
]


@dataclass
class Alert:
    """One alert's life: first fired, last seen while firing, how many records kept it firing."""

    rule: str
    severity: str
    message: str
    state: str
    first_seen: float
    last_seen: float
    count: int = 1
    step: int | None = None
    rank: int | None = None

    def to_record(self) -> dict[str, Any]:
        return {"time": time.time(), **asdict(self)}


def spike_score(history: Sequence[float], value: float) -> tuple[float, float]:
    """(robust z-score, median) of `value` against `history`: (x - median) / (1.4826 × MAD)."""
    median = statistics.median(history)
    mad = statistics.median(abs(h - median) for h in history)
    # A flat history has MAD 0; a floor keeps one tiny wiggle from reading as an infinite z-score.
    scale = max(1.4826 * mad, 1e-3 * abs(median), 1e-12)
    return (value - median) / scale, median


class AlertEngine:
    """Evaluate rules on metric records and events; emit firing/resolved alerts to the outputs."""

    def __init__(
        self,
        *,
        rules: AlertRules | None = None,
        outputs: Sequence[AlertOutput] = (),
        plan_mfu: float | None = None,
        hang_timeout_s: float = 600.0,
        disk_path: Path | None = None,
        disk_paths: Sequence[Path] = (),
        clock: Callable[[], float] = time.time,
        on_close: Sequence[Callable[[], None]] = (),
        events_path: Path | None = None,
    ) -> None:
        self.rules = rules or AlertRules()
        self.outputs = list(outputs)
        self.plan_mfu = plan_mfu
        self.hang_timeout_s = self.rules.hang.timeout_s or hang_timeout_s
        # Every folder the run writes to (run dir, checkpoint location, staged data): low_disk watches each.
        self.disk_paths = list(dict.fromkeys([*([disk_path] if disk_path is not None else []), *disk_paths]))
        self.clock = clock
        self.on_close = list(on_close)  # e.g. the webhook sender's close: deliver what is queued
        self.firing: dict[str, Alert] = {}
        self.history: list[Alert] = []
        self._lock = threading.Lock()
        self._losses: deque[float] = deque(maxlen=self.rules.loss_spike.window)
        self._grad_norms: deque[float] = deque(maxlen=self.rules.grad_norm_explosion.window)
        self._tokens_per_s: deque[float] = deque(maxlen=self.rules.throughput_drop.window)
        self._pending: dict[str, float] = {}  # rule → since when its condition holds (not yet firing)
        self._num_records = 0
        self._last_step: int | None = None
        # The hang clock: armed by the first step's record (model build and checkpoint load are not steps); the
        # next record is due `_due_s` later (steps per record × step time); checkpoint saves do not count.
        self._last_record_s: float | None = None
        self._due_s = 0.0
        self._paused_s = 0.0
        self._save_started_s: float | None = None
        # The live engine learns of saves from events.jsonl (the checkpoint manager writes there, not here).
        self.events_path = events_path
        self._events_offset = events_path.stat().st_size if events_path is not None and events_path.is_file() else 0
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._last_disk_check_s = -math.inf

    # -- the sink protocol -------------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Evaluate one metrics record (or an event record, which has an `event` key). Never raises."""
        if "event" in record:
            self.event(str(record["event"]), **{k: v for k, v in record.items() if k not in ("event", "kind")})
            return
        if "eval_loss" in record and "loss" not in record:
            return  # a held-out evaluation, not a training step
        now = self._now(record)
        with self._lock:
            self._arm_hang_clock(record, now)
            self._update("hang", False, "", now, record)
            for name, (condition, message, rank, clear) in self._evaluate(record).items():
                self._update(name, condition, message, now, record, rank=rank, clear=clear)
            self._num_records += 1

    def _arm_hang_clock(self, record: dict[str, Any], now: float) -> None:
        """A step record: restart the hang clock; the next record is due after its steps at this step time."""
        step, last = as_float(record.get("step")), as_float(self._last_step)
        steps = step - last if math.isfinite(step) and math.isfinite(last) and step > last else 1.0
        step_s = as_float(record.get("step_time_s"))
        self._due_s = steps * step_s if math.isfinite(step_s) and step_s > 0 else 0.0
        self._last_record_s, self._paused_s = now, 0.0
        self._last_step = record.get("step", self._last_step)

    def new_process(self) -> None:
        """A new process (restart, resume, preemption): fresh histories, no hang clock until its first step."""
        with self._lock:
            self._last_record_s, self._last_step, self._save_started_s = None, None, None
            for history in (self._losses, self._grad_norms, self._tokens_per_s):
                history.clear()
            self._pending.clear()
            self._num_records = 0

    def _note_save(self, kind: str, now: float) -> None:
        """checkpoint_save_started … checkpoint_saved/failed: the time between is not counted toward a hang."""
        if kind == "checkpoint_save_started":
            self._save_started_s = now
        elif kind in ("checkpoint_saved", "checkpoint_failed") and self._save_started_s is not None:
            if self._last_record_s is not None:
                self._paused_s += max(0.0, now - max(self._save_started_s, self._last_record_s))
            self._save_started_s = None

    def _poll_events(self) -> None:
        """Read the save events appended to events.jsonl since the last poll (whole lines only)."""
        if self.events_path is None:
            return
        try:
            with self.events_path.open("rb") as handle:
                if handle.seek(0, 2) < self._events_offset:
                    self._events_offset = 0  # the file was replaced
                handle.seek(self._events_offset)
                chunk = handle.read()
        except OSError:
            return
        chunk = chunk[:chunk.rfind(b"\n") + 1]
        self._events_offset += len(chunk)
        for line in chunk.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._note_save(str(event.get("kind")), self._now(event))

    def event(self, kind: str, **fields: Any) -> None:
        """A run event: checkpoint saves pause the hang clock; checkpoint_failed/saved drive checkpoint_failure."""
        now = self._now(fields)
        with self._lock:
            self._note_save(kind, now)
            if kind == "checkpoint_failed":
                error = fields.get("error", "unknown error")
                message = f"checkpoint write failed at step {fields.get('step')}: {error}"
                self._update("checkpoint_failure", True, message, now, fields)
            elif kind == "checkpoint_saved":
                self._update("checkpoint_failure", False, "", now, fields)

    def close(self) -> None:
        """Stop the watchdog; firing alerts stay as they are (a hang at exit is still a hang)."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
        for close in self.on_close:
            close()

    # -- watchdog ------------------------------------------------------------------------------------------
    def start_watchdog(self) -> None:
        """A daemon thread that reports a hang while it happens and checks free disk space."""
        period = self.rules.hang.check_every_s
        if self.rules.low_disk.enabled:
            period = min(period, self.rules.low_disk.check_every_s)

        def loop() -> None:
            while not self._stop.wait(period):
                self.check_idle(self.clock())

        self._watchdog = threading.Thread(target=loop, name="leantrain-alert-watchdog", daemon=True)
        self._watchdog.start()

    def hang_idle_s(self, now: float) -> float:
        """Seconds past the next record's due time, saves not counted; -inf before the first step."""
        if self._last_record_s is None:
            return -math.inf
        saving = now - max(self._save_started_s, self._last_record_s) if self._save_started_s is not None else 0.0
        return now - self._last_record_s - self._paused_s - max(0.0, saving) - self._due_s

    def check_idle(self, now: float) -> None:
        """Fire `hang` when no step came for the timeout, and `low_disk` when space is short."""
        with self._lock:
            self._poll_events()
            idle_s = self.hang_idle_s(now)
            if self.rules.hang.enabled and idle_s > self.hang_timeout_s:
                message = (f"no step for {idle_s:.0f} s after the next record was due (last step {self._last_step}; "
                           f"timeout {self.hang_timeout_s:.0f} s, checkpoint saves not counted)")
                self._update("hang", True, message, now, {"step": self._last_step})
            if self.disk_paths and now - self._last_disk_check_s >= self.rules.low_disk.check_every_s:
                self._last_disk_check_s = now
                self._check_disk(now)

    def _check_disk(self, now: float) -> None:
        """One `low_disk` alert naming every watched folder that is short of space (or cannot be read)."""
        low, message = disk_report(self.disk_paths, self.rules.low_disk)
        self._update("low_disk", low, message, now, {"step": self._last_step})

    # -- rules ---------------------------------------------------------------------------------------------
    def _evaluate(self, record: dict[str, Any]) -> dict[str, Verdict]:
        rules = self.rules
        out: dict[str, Verdict] = {}
        step = record.get("step")
        loss, grad_norm = as_float(record.get("loss")), as_float(record.get("grad_norm"))
        # Live records hold float NaN/inf; the JSONL sink writes them as null and lists them under `nonfinite`.
        listed = record.get("nonfinite") if isinstance(record.get("nonfinite"), list) else []
        bad = [n for n, v in (("loss", loss), ("grad_norm", grad_norm))
               if n in listed or (record.get(n) is not None and not math.isfinite(v))]
        out["nonfinite_loss"] = (bool(bad), f"non-finite {' and '.join(bad)} at step {step}", None, None)
        if math.isfinite(loss):
            rule = rules.loss_spike
            if len(self._losses) >= rule.min_history:
                z, median = spike_score(self._losses, loss)
                spike = z > rule.z and loss > median * (1 + rule.min_rel_increase)
                out["loss_spike"] = (spike, f"loss {loss:.4g} at step {step} vs median {median:.4g} "
                                            f"of the last {len(self._losses)} (robust z {z:.1f})", None, None)
            self._losses.append(loss)
        if math.isfinite(grad_norm):
            rule_g = rules.grad_norm_explosion
            if len(self._grad_norms) >= rule_g.min_history:
                median = statistics.median(self._grad_norms)
                out["grad_norm_explosion"] = (
                    grad_norm > rule_g.factor * median,
                    f"grad_norm {grad_norm:.4g} at step {step} is {grad_norm / max(median, 1e-12):.1f}× "
                    f"the running median {median:.4g}", None, None)
            self._grad_norms.append(grad_norm)
        out.update(self._throughput_rules(record, step))
        return out

    def _throughput_rules(self, record: dict[str, Any], step: Any) -> dict[str, Verdict]:
        rules = self.rules
        out: dict[str, Verdict] = {}
        tokens_per_s = as_float(record.get("tokens_per_s"))
        if math.isfinite(tokens_per_s):
            rule = rules.throughput_drop
            if len(self._tokens_per_s) >= rule.min_history:
                # The run's own robust baseline: the median of its post-warm-up values.
                base = statistics.median(self._tokens_per_s)
                floor = (1 - rule.drop_fraction) * base
                out["throughput_drop"] = (
                    tokens_per_s < floor,
                    f"tokens/s {tokens_per_s:.4g} at step {step} is {tokens_per_s / max(base, 1e-12):.0%} "
                    f"of the run's baseline {base:.4g} (median after warm-up)", None,
                    tokens_per_s >= floor * (1 + rule.resolve_margin))
            # A drop (pending or firing) stays out of the baseline, so a lasting drop does not become normal.
            dropping = "throughput_drop" in self._pending or "throughput_drop" in self.firing or (
                out.get("throughput_drop", (False,))[0])
            if self._num_records >= rule.warmup_records and not dropping:
                self._tokens_per_s.append(tokens_per_s)
        mfu = as_float(record.get("mfu"))
        if self.plan_mfu and math.isfinite(mfu) and self._num_records >= rules.low_mfu.skip_first:
            floor = rules.low_mfu.fraction_of_plan * self.plan_mfu
            out["low_mfu"] = (mfu < floor, f"MFU {mfu:.1%} at step {step} is below {floor:.1%} "
                                           f"({rules.low_mfu.fraction_of_plan:.0%} of the plan's {self.plan_mfu:.1%})",
                              None, mfu >= floor * (1 + rules.low_mfu.resolve_margin))
        wait_s, step_s = as_float(record.get("data_wait_s")), as_float(record.get("step_time_s"))
        if math.isfinite(wait_s) and math.isfinite(step_s) and step_s > 0:
            share, limit = wait_s / step_s, rules.data_wait.max_share
            out["data_wait"] = (share > limit,
                                f"data wait {wait_s:.3g} s is {share:.0%} of the {step_s:.3g} s step at step {step} "
                                f"(limit {limit:.0%})", None, share <= limit * (1 - rules.data_wait.resolve_margin))
        per_rank = _rank_times(record.get("rank_step_time_s"))
        if len(per_rank) >= 2:
            slow_rank, slow_s = max(per_rank.items(), key=lambda kv: kv[1])
            # Against the other ranks' median: with two ranks the median of all would include the straggler.
            median = statistics.median(v for r, v in per_rank.items() if r != slow_rank)
            ratio, limit = slow_s / max(median, 1e-12), rules.straggler.max_ratio
            out["straggler"] = (ratio > limit,
                                f"rank {slow_rank} step time {slow_s:.3g} s is {ratio:.2f}× the median {median:.3g} s "
                                f"at step {step}", slow_rank,
                                ratio <= 1 + (limit - 1) * (1 - rules.straggler.resolve_margin))
        return out

    # -- state ---------------------------------------------------------------------------------------------
    def _update(
        self, name: str, condition: bool, message: str, now: float, record: dict[str, Any], *,
        rank: int | None = None, clear: bool | None = None,
    ) -> None:
        """Hysteresis: fire once the condition has held `for_s`; resolve only when `clear` (the value past the
        threshold by the rule's resolve margin; default: the condition no longer holds)."""
        rule: Rule = getattr(self.rules, name)
        if not rule.enabled:
            return
        current = self.firing.get(name)
        step = record.get("step") if isinstance(record.get("step"), int) else None
        if current is None:
            if not condition:
                self._pending.pop(name, None)
                return
            since = self._pending.setdefault(name, now)
            if now - since < rule.for_s:
                return
            del self._pending[name]
            alert = Alert(rule=name, severity=rule.severity, message=message, state="firing",
                          first_seen=since, last_seen=now, step=step, rank=rank)
            self.firing[name] = alert
            self._emit(alert)
        elif condition:
            current.last_seen, current.count = now, current.count + 1
        elif clear if clear is not None else True:
            del self.firing[name]
            resolved = Alert(**{**asdict(current), "state": "resolved", "last_seen": now})
            self._emit(resolved)

    def _emit(self, alert: Alert) -> None:
        self.history.append(alert)
        record = alert.to_record()
        for output in self.outputs:
            try:
                output(record)
            except Exception as err:  # an alert output must never stop training
                print(f"leantrain: alert output {output!r} failed: {err}")

    def _now(self, record: dict[str, Any]) -> float:
        stamp = as_float(record.get("time"))
        return stamp if math.isfinite(stamp) else self.clock()


def _rank_times(value: Any) -> dict[int, float]:
    """`rank_step_time_s` as {rank: seconds}; it may be a list indexed by rank or a mapping."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return {}
    out = {}
    for rank, seconds in items:
        number = as_float(seconds)
        if math.isfinite(number):
            out[int(rank)] = number
    return out


class JsonlAlertOutput:
    """Append alert records to run_dir/alerts.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, record: dict[str, Any]) -> None:
        append_jsonl(self.path, record)


class ConsoleAlertOutput:
    """One coloured line per alert on the console."""

    COLOURS = {"critical": "bold red", "warning": "yellow", "info": "cyan"}

    def __init__(self, console: Any) -> None:
        self.console = console

    def __call__(self, record: dict[str, Any]) -> None:
        from rich.markup import escape

        colour = "green" if record["state"] == "resolved" else self.COLOURS.get(record["severity"], "white")
        self.console.print(
            f"[{colour}]alert {record['state']}[/] {record['severity']} {record['rule']}: {escape(record['message'])}"
        )


def engine_from_spec(
    spec: Any, *, run_dir: Path, console: Any = None, plan: dict[str, Any] | None = None, watchdog: bool = True
) -> AlertEngine:
    """The trainer's alert sink: rules from the spec, outputs alerts.jsonl + console + webhook (when set)."""
    from leantrain.observe.webhook import WebhookSender

    monitoring = spec.monitoring
    outputs: list[AlertOutput] = [JsonlAlertOutput(Path(run_dir) / ALERTS_FILE)]
    if console is not None and getattr(monitoring, "alert_console", True):
        outputs.append(ConsoleAlertOutput(console))
    sender = WebhookSender.from_monitoring(monitoring)
    if sender is not None:
        outputs.append(sender.send)
    plan_mfu = ((plan or {}).get("throughput") or {}).get("mfu")
    engine = AlertEngine(
        rules=load_rules(monitoring.alert_rules), outputs=outputs, plan_mfu=plan_mfu,
        hang_timeout_s=monitoring.hang_timeout_s, disk_paths=watched_dirs(spec, run_dir=Path(run_dir)),
        on_close=[sender.close] if sender is not None else [], events_path=Path(run_dir) / EVENTS_FILE,
    )
    if watchdog:
        engine.start_watchdog()
    return engine


# Events the replay interleaves with the records: saves (the checkpoint rule, hang pauses) and new processes.
REPLAY_EVENTS = ("checkpoint_save_started", "checkpoint_saved", "checkpoint_failed", "preempted", "restart", "resume")


def replay(records: Iterable[dict[str, Any]], **options: Any) -> list[Alert]:
    """Run the rules over a finished run (metrics + events, in time order); returns every alert. `options`: those
    of `replay_engine` (rules, plan_mfu, events, hang_timeout_s)."""
    return replay_engine(records, **options).history


def replay_engine(
    records: Iterable[dict[str, Any]],
    *,
    rules: AlertRules | None = None,
    plan_mfu: float | None = None,
    events: Iterable[dict[str, Any]] = (),
    hang_timeout_s: float = 600.0,
) -> AlertEngine:
    """`replay`, returning the engine: its `history`, and in `firing` what still fires at the end of the run.

    Hangs are found from gaps between record `time` stamps, since no watchdog ran over the files, as the live
    engine judges them: from the first step on, past the next record's due time, checkpoint saves not counted.
    A new process (a `restart`, `resume` or `preempted` event, or the step going back: a resume from an earlier
    checkpoint) starts its histories (loss, grad norm, tokens/s) and its hang clock afresh, as the live engine of
    the new process does; alerts that fire stay firing until the new process's records clear them.
    """
    engine = AlertEngine(rules=rules, plan_mfu=plan_mfu, hang_timeout_s=hang_timeout_s, clock=lambda: 0.0)
    stream: list[tuple[float, int, dict[str, Any]]] = []
    for order, record in enumerate(records):
        stream.append((as_float(record.get("time")), order, record))
    for order, event in enumerate(events):
        if isinstance(event, dict) and event.get("kind") in REPLAY_EVENTS:
            stream.append((as_float(event.get("time")), order, {**event, "event": event["kind"]}))
    timed = all(math.isfinite(t) for t, _, _ in stream)
    if timed:
        stream.sort(key=lambda item: (item[0], item[1]))
    last_step = math.nan
    for stamp, _, record in stream:
        kind = record.get("event")
        if kind in ("preempted", "restart", "resume"):
            if timed and kind == "preempted":
                engine.check_idle(stamp)  # a stall before the preemption is still one
            engine.new_process()
            continue
        step = as_float(record.get("step"))
        if kind is None and step <= last_step:
            engine.new_process()  # the step went back: a resume from an earlier checkpoint
        if timed and kind is None:
            engine.check_idle(stamp - 1e-6)  # the gap before this record, seen just before it ends it
        engine.write(record)
        if kind is None and math.isfinite(step):
            last_step = step
    return engine
