"""`leantrain report RUN_DIR [RUN_B ...]`: one self-contained HTML file about a run (or several, compared).

Plots of loss, grad norm, LR, tokens/s, MFU, step time, memory, data wait and communication (observe/
report_plots.py: PNG, or interactive plotly with `--interactive`; x axis step, time or tokens); plan vs
actual; cost and idle time; alerts; events in words; checkpoints and restarts on a timeline. With more run
dirs, their curves are overlaid and a table compares them. It reads only the run dirs' files
(docs/observe.md), so it works on a copied run dir, on another machine, after the fact.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from leantrain.errors import NUMBER, UserInputError, json_field
from leantrain.observe.report_card import drill_section, fields_text, human_bytes, run_card
from leantrain.observe.report_cost import CostSummary, cost_and_idle
from leantrain.observe.report_data import METRICS_FILE, RunData, as_float, load_run, steady
from leantrain.observe.report_plots import (
    XAxis,
    malformed_by_source,
    metric_plots,
    plotly_available,
    source_loss_plot,
    timeline_plot,
)

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1b1f24;max-width:1600px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #d0d7de}
.muted{color:#57606a;font-size:13px} table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top} th{background:#f6f8fa}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:14px}
.grid img{width:100%;border:1px solid #eee}
.cards{display:flex;gap:12px;flex-wrap:wrap} .card{border:1px solid #d0d7de;border-radius:6px;padding:8px 14px}
.card b{display:block;font-size:18px} #run-card th{width:140px}
.critical{color:#cf222e;font-weight:600} .warning{color:#9a6700}
.resolved{color:#1a7f37} td.num{text-align:right;font-variant-numeric:tabular-nums}
"""


def _fmt(value: Any, unit: str = "", digits: int = 4) -> str:
    number = as_float(value)
    if not math.isfinite(number):
        return "—" if value is None or isinstance(value, int | float) else str(value)
    if unit == "%":
        return f"{number * 100:.1f} %"
    if unit == "GiB":
        return f"{number / 2**30:.2f} GiB"
    if unit == "s":
        return f"{number:.3g} s"
    return f"{number:.{digits}g}{(' ' + unit) if unit else ''}"


def _table(headers: list[str], rows: list[list[str]], *, raw: bool = False) -> str:
    """An HTML table; cells are escaped unless `raw` (callers that pass markup escape it themselves)."""
    cell: Callable[[str], str] = (lambda s: s) if raw else html.escape
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _median(run: RunData, key: str) -> float:
    _, values = run.series(key)
    tail = steady(values)
    return float(np.median(tail)) if tail.size else math.nan


def plan_vs_actual(run: RunData) -> list[list[str]]:
    """Rows (quantity, plan, actual, actual / plan) for what the plan predicts and the run measures."""
    num_gpus = run.world_size()
    plan_gpus = run.plan_get("resources.num_gpus")
    tokens_s, plan_tokens_s = _median(run, "tokens_per_s"), as_float(run.plan_get("throughput.tokens_per_s"))
    plan_gpu_count = as_float(plan_gpus) if plan_gpus else math.nan
    saves = [as_float(e.get("duration_s")) for e in run.events_of("checkpoint_saved")]
    saves = [s for s in saves if math.isfinite(s)]
    ckpt_steps = [c.step for c in run.checkpoints if c.committed]
    interval = float(np.median(np.diff(ckpt_steps))) if len(ckpt_steps) >= 2 else math.nan
    _, mem = run.series("mem_bytes")
    peak_mem = float(np.nanmax(mem)) if np.any(np.isfinite(mem)) else math.nan
    rows_spec: list[tuple[str, Any, float, str]] = [
        ("GPUs", plan_gpus, float(num_gpus), ""),
        ("tokens/s (job)", plan_tokens_s, tokens_s, ""),
        ("tokens/s per GPU", plan_tokens_s / plan_gpu_count, tokens_s / num_gpus, ""),
        ("MFU", run.plan_get("throughput.mfu"), _median(run, "mfu"), "%"),
        ("memory per GPU (peak)", run.plan_get("memory.per_gpu.total"), peak_mem, "GiB"),
        ("checkpoint interval (steps)", run.plan_get("checkpoint.interval_steps"), interval, ""),
        ("checkpoint save time", run.plan_get("checkpoint.save_s"), float(np.median(saves)) if saves else math.nan,
         "s"),
    ]
    rows = []
    for name, planned, actual, unit in rows_spec:
        plan_value = as_float(planned)
        if not (math.isfinite(actual) and math.isfinite(plan_value) and plan_value):
            ratio = "—"
        elif unit == "s" and plan_value < MEANINGFUL_SAVE_S:  # a tiny save is all fixed costs: no ratio to read
            ratio = f"— (plan under {MEANINGFUL_SAVE_S:g} s: fixed costs dominate)"
        else:
            ratio = f"{actual / plan_value:.2f}×"
        rows.append([name, _fmt(planned, unit), _fmt(actual, unit), ratio])
    return rows


MEANINGFUL_SAVE_S = 1.0  # below this the planned save time is bandwidth-bound noise next to per-file costs


def _cost_section(cost: CostSummary) -> str:
    price = "no price (add spec.yaml or plan.json to the run dir)" if cost.price_per_gpu_hour is None else (
        f"{cost.price_per_gpu_hour:.4g} per GPU-hour ({cost.price_source})")
    total = "—" if cost.total_cost is None else f"{cost.total_cost:.4g}"
    idle_cost = cost.idle_cost
    rows = [[i.name + ("" if i.counted else " *"), _fmt(i.seconds, "s"), f"{i.share:.1%}", f"{i.gpu_hours:.4g}",
             "—" if i.cost is None else f"{i.cost:.4g}", i.evidence] for i in cost.items]
    return (
        f"<p>{cost.num_gpus} GPU(s) × {cost.wall_s:.4g} s wall = {cost.gpu_hours:.4g} GPU-hours; "
        f"price {html.escape(price)};"
        f" run cost {total}. Idle share <b>{cost.idle_share:.1%}</b>"
        f"{'' if idle_cost is None else f', costing {idle_cost:.4g}'}.</p>"
        + _table(["lost to", "seconds", "share of wall", "GPU-hours", "cost", "how measured"], rows)
        + "<p class='muted'>* shown for context, not summed as idle.</p>"
    )


def _alerts_section(run: RunData) -> str:
    if not run.alerts:
        return "<p>No alerts were recorded in alerts.jsonl.</p>"
    rows = []
    for alert in run.alerts:
        state = str(alert.get("state", "firing"))
        severity = str(alert.get("severity", ""))
        css = "resolved" if state == "resolved" else severity
        first, last = as_float(alert.get("first_seen")), as_float(alert.get("last_seen"))
        duration = f"{last - first:.0f} s" if math.isfinite(first) and math.isfinite(last) else "—"
        when = _utc(first, "%Y-%m-%d %H:%M:%S")
        rows.append([f"<span class='{css}'>{html.escape(severity)}</span>", html.escape(state),
                     html.escape(str(alert.get("rule", ""))), html.escape(str(alert.get("step", "—"))),
                     html.escape(when), duration, html.escape(str(alert.get("message", "")))])
    return _table(["severity", "state", "rule", "step", "first seen (UTC)", "lasted", "message"], rows, raw=True)


def describe_event(event: dict[str, Any]) -> str:
    """An event in words: `saved in 2.0 s (0.5 s stall, async)`, `restart after a planned drill kill, recovered
    in 3.1 s`; other kinds list their fields."""
    kind = str(event.get("kind", "?"))
    f = {k: v for k, v in event.items() if k not in ("time", "kind", "step", "event")}
    seconds = {k: _fmt(f.get(k), "s") for k in ("duration_s", "stall_s", "recovery_s")}
    if kind == "checkpoint_saved":
        extra = ", ".join(x for x in (f"{seconds['stall_s']} stall" if "stall_s" in f else "",
                                      "async" if f.get("async") else "") if x)
        return f"checkpoint saved in {seconds['duration_s']}" + (f" ({extra})" if extra else "")
    if kind == "restart":
        why = "a planned drill kill" if f.get("planned") or f.get("cause") == "drill" else str(f.get("cause")
                                                                                                 or "a failure")
        where = f" on {f['host']}" if f.get("host") else ""
        return f"restart after {why}{where}" + (f", recovered in {seconds['recovery_s']}" if "recovery_s" in f else "")
    if kind == "resume":
        return f"resumed from step {f.get('from_step', event.get('step'))}" + (
            f" ({f['checkpoint']})" if f.get("checkpoint") else "")
    if kind == "rank_joined":
        return f"rank {f.get('rank')} joined" + (f" on {f['host']}" if f.get("host") else "")
    if kind == "checkpoint_failed":
        return f"checkpoint FAILED: {f.get('error', 'unknown error')}"
    if kind == "start":
        return f"training started on {f.get('world_size', '?')} rank(s)"
    if kind == "checkpoint_save_started":
        return f"checkpoint save started ({'async' if f.get('async') else 'blocking'})"
    if kind == "checkpoint_deleted":
        return f"checkpoint {f.get('folder', '?')} deleted" + (f": {f['reason']}" if f.get("reason") else "")
    if kind == "model_ready":
        ranks = [r for r in f.get("ranks") or [] if isinstance(r, dict)]
        peak = max((as_float(r.get("device_mem_peak_bytes")) for r in ranks), default=math.nan)
        total = as_float(f.get("param_bytes_total"))
        return (f"model built and sharded: {human_bytes(total) if math.isfinite(total) else '?'} of parameters over "
                f"{len(ranks) or f.get('world_size', '?')} rank(s)"
                + (f", peak memory {human_bytes(peak)} on the fullest rank" if math.isfinite(peak) else "")
                + (f", layout {f['layout']}" if f.get("layout") else "")
                + (f", resuming at step {f['resumed_step']}" if f.get("resumed_step") else ""))
    return fields_text(f)


def _utc(stamp: float, layout: str) -> str:
    """A Unix time from a run file as UTC text; "—" when it is not one (NaN, or out of the calendar's range)."""
    try:
        return dt.datetime.fromtimestamp(stamp, tz=dt.UTC).strftime(layout)
    except (ValueError, OverflowError, OSError):
        return "—"


def _events_table(run: RunData) -> str:
    rows = []
    for event in run.events:
        stamp = as_float(event.get("time"))
        when = _utc(stamp, "%H:%M:%S")
        rows.append([when, str(event.get("kind", "?")), str(event.get("step", "—")), describe_event(event)])
    checkpoints = [[f"step-{c.step:08d}", "committed" if c.committed else "NOT committed",
                    "yes" if c.has_manifest else "no"] for c in run.checkpoints]
    out = _table(["time (UTC)", "event", "step", "what happened"], rows) if rows else "<p>No events.jsonl.</p>"
    if checkpoints:
        out += _table(["checkpoint", "state", "manifest"], checkpoints)
    return out


def _eval_section(run: RunData) -> str:
    """The results of `leantrain eval` (eval.json): held-out loss per source and multiple-choice accuracy. A
    hand-edited eval.json (a missing key, a wrong type) is named in the section, as an unreadable one is listed
    at the end: the rest of the report is still written."""
    result = run.eval_results
    if not result:
        return ""
    try:
        rows = eval_rows(result, source=run.run_dir / "eval.json")
    except UserInputError as err:
        return f"<h2>Evaluation</h2><p class='warning'>{html.escape(str(err))}</p>"
    return f"<h2>Evaluation (step {html.escape(str(result.get('step')))})</h2>" + _table(["what", "result"], rows)


def eval_rows(result: dict[str, Any], *, source: object) -> list[list[str]]:
    """(what, result) rows of an eval.json; a missing key or a wrong type is a UserInputError naming it."""
    def number(*key: str, required: bool = True) -> Any:
        return json_field(result, key, NUMBER, source=source, **({} if required else {"default": None}))

    rows = []
    for name in json_field(result, "held_out", dict, source=source, default={}):
        perplexity = number("held_out", name, "perplexity", required=False)
        rows.append([f"held-out {name}", f"loss {number('held_out', name, 'loss'):.4f}, " + (
            f"perplexity {perplexity:.2f}" if perplexity is not None else  # DPO: preference pairs
            f"reward margin {number('held_out', name, 'rewards/margin'):.3f}, "
            f"accuracy {number('held_out', name, 'rewards/accuracy'):.3f}")])
    for name in json_field(result, "tasks", dict, source=source, default={}):
        rows.append([f"task {name}", f"acc {number('tasks', name, 'acc'):.3f}, acc_norm "
                     f"{number('tasks', name, 'acc_norm'):.3f} ({number('tasks', name, 'num_questions'):g} questions)"])
    return rows


def compare_rows(runs: list[RunData]) -> list[list[str]]:
    """One row per run: steps, final loss, median tokens/s and MFU, peak memory, restarts, alerts."""
    rows = []
    for run in runs:
        steps, losses = run.series("loss")
        finite = losses[np.isfinite(losses)]
        _, mem = run.series("mem_bytes")
        rows.append([run.run_dir.name, f"{int(np.nanmax(steps))}" if steps.size else "—",
                     f"{finite[-1]:.4g}" if finite.size else "—", _fmt(_median(run, "tokens_per_s")),
                     _fmt(_median(run, "mfu"), "%"), _fmt(float(np.nanmax(mem)) if np.any(np.isfinite(mem))
                                                          else None, "GiB"),
                     str(len(run.events_of("restart"))),
                     str(sum(1 for a in run.alerts if a.get("state", "firing") == "firing"))])
    return rows


def _cards(run: RunData) -> str:
    steps, losses = run.series("loss")
    finite = losses[np.isfinite(losses)]
    cards = [
        ("last step", f"{int(np.nanmax(steps))}" if steps.size else "—"),
        ("final loss", f"{finite[-1]:.4g}" if finite.size else "—"),
        ("tokens/s", _fmt(_median(run, "tokens_per_s"))),
        ("MFU", _fmt(_median(run, "mfu"), "%")),
        ("alerts", str(sum(1 for a in run.alerts if a.get("state", "firing") == "firing"))),
        ("restarts", str(len(run.events_of("restart")))),
        ("checkpoints", str(sum(c.committed for c in run.checkpoints))),
    ]
    return "<div class='cards'>" + "".join(
        f"<div class='card'><span class='muted'>{html.escape(k)}</span><b>{html.escape(v)}</b></div>" for k, v in cards
    ) + "</div>"


def _figure(plot: Any) -> str:
    if plot.html:
        return f"<figure>{plot.html}</figure>"
    return (f"<figure><img id='plot-{plot.key}' class='plot' alt='{html.escape(plot.title)}' "
            f"src='data:image/png;base64,{plot.png_base64}'></figure>")


def render_html(run: RunData | list[RunData], *, x: XAxis = "step", interactive: bool = False) -> str:
    """The whole report as one HTML string (images or plotly's JavaScript inline). With several runs the first
    is the subject (plan, cost, alerts, events) and the others are overlaid on its curves."""
    runs = [run] if isinstance(run, RunData) else run
    run = runs[0]
    plots = metric_plots(runs, x=x, interactive=interactive)
    by_source = source_loss_plot(run) if len(runs) == 1 else None
    if by_source is not None:
        plots.insert(1, by_source)
    timeline = timeline_plot(run)
    images = "".join(_figure(p) for p in plots)
    timeline_img = "" if timeline is None else (
        f"<img id='plot-timeline' class='plot' alt='Run timeline' style='width:100%' "
        f"src='data:image/png;base64,{timeline.png_base64}'>")
    bad = [*run.bad_lines, *malformed_by_source(run)]
    problems = "" if not bad else (
        "<h2>Unreadable lines</h2><ul>" + "".join(f"<li>{html.escape(b)}</li>" for b in bad[:50]) + "</ul>")
    name = (run.lineage or {}).get("run_name") or run.run_dir.name
    title = name if len(runs) == 1 else f"{name} vs " + ", ".join(r.run_dir.name for r in runs[1:])
    generated = dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    plan_note = "" if run.plan else "<p class='muted'>No plan.json in the run dir: plan columns are empty.</p>"
    compare = "" if len(runs) == 1 else "<h2>Runs compared</h2>" + _table(
        ["run", "last step", "final loss", "tokens/s", "MFU", "peak memory", "restarts", "alerts"], compare_rows(runs))
    legend = ("Colours: one per run; dashed: a later attempt." if len(runs) > 1 else
              "Colours: one per attempt (a restart starts a new one); dashed red: resume from a checkpoint; "
              "grey: committed checkpoints; dotted: the plan.")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>leantrain report: {html.escape(str(title))}</title>
<style>{CSS}</style></head><body>
<h1>leantrain run report: {html.escape(str(title))}</h1>
<p class="muted">{html.escape(str(run.run_dir))} · {len(run.metrics)} metric records · generated {generated}</p>
{_cards(run)}
<h2 id="run">Run</h2>
{run_card(run)}
{compare}
<h2>Training curves</h2>
<p class="muted">{legend}</p>
<div class="grid">{images}</div>
<h2>Plan vs actual</h2>{plan_note}
{_table(["quantity", "plan", "actual", "actual / plan"], plan_vs_actual(run))}
<h2>Cost and idle time</h2>
{_cost_section(cost_and_idle(run))}
<h2>Alerts</h2>
{_alerts_section(run)}
<h2>Checkpoints and restarts</h2>
{timeline_img}
{_events_table(run)}
<h2>Fault drill</h2>
{drill_section(run)}
{_eval_section(run)}
{problems}
</body></html>
"""


def _load_for_report(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(f"run dir {run_dir} does not exist (no {run_dir / METRICS_FILE} to report on)")
    if not (run_dir / METRICS_FILE).is_file():
        raise UserInputError(f"{run_dir / METRICS_FILE} is missing: report needs a run dir written by train/launch")
    run = load_run(run_dir)
    if not run.metrics:
        unreadable = [line for line in run.bad_lines if line.startswith(f"{METRICS_FILE}:")]
        raise UserInputError(f"{run_dir / METRICS_FILE} holds no metric records " + (
            f"({len(unreadable)} unreadable line(s), e.g. {unreadable[0]})" if unreadable
            else "(train logs every log_every steps)"))
    return run


def write_report(
    run_dir: Path | list[Path], out: Path | None = None, *, x: XAxis = "step", interactive: bool = False
) -> Path:
    """Read the run dir(s) and write the HTML report; returns its path. A run dir without metrics is an error."""
    dirs = [Path(d) for d in run_dir] if isinstance(run_dir, list) else [Path(run_dir)]
    if x not in ("step", "time", "tokens"):
        raise UserInputError(f"--x {x!r}: allowed: step, time, tokens")
    if interactive and not plotly_available():
        raise UserInputError('--interactive needs plotly: pip install -e ".[report]"')
    runs = [_load_for_report(d) for d in dirs]
    out = Path(out) if out is not None else dirs[0] / ("report.html" if len(dirs) == 1 else "compare.html")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(runs, x=x, interactive=interactive), encoding="utf-8")
    return out


def run(
    *, console: Any, run_dir: Path | list[Path], out: Path | None = None, x: XAxis = "step", interactive: bool = False
) -> Path:
    """CLI entry: write the report and print its path."""
    path = write_report(run_dir, out, x=x, interactive=interactive)
    console.print(f"report written: {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return path


def demo_stage(ctx: Any) -> str:
    """Demo: the report of the demo's training run."""
    path = write_report(ctx.out_dir / "run")
    return f"report: {path}"
