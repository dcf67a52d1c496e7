"""Plots for the HTML report: matplotlib PNGs (base64, so the report is one file), or interactive plotly charts
with plotly's JavaScript inlined once (zoom, hover; still one file, no network) when plotly is installed.

One plot per metric, in units people read (loss in nats, times in ms, MFU in %, memory in GiB). Against the
x axis of choice: `step`, `time` (minutes since the run's first record) or `tokens` (tokens seen, in
billions). Each attempt after a restart is its own colour and labelled; resumes are dashed red lines and
committed checkpoints grey ticks; tokens/s and MFU carry the plan's value as a dotted reference line. Several
runs (`leantrain report RUN_A RUN_B`) are overlaid, one colour per run.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from leantrain.observe.report_data import RunData, as_float

XAxis = Literal["step", "time", "tokens"]
X_LABELS = {"step": "step", "time": "minutes since start", "tokens": "tokens seen (billions)"}
# (metrics key, title, unit, scale factor, log y)
PLOTS: list[tuple[str, str, str, float, bool]] = [
    ("loss", "Loss", "nats", 1.0, False),
    ("grad_norm", "Gradient norm", "L2 norm", 1.0, True),
    ("lr", "Learning rate", "lr", 1.0, False),
    ("tokens_per_s", "Throughput", "tokens/s", 1.0, False),
    ("mfu", "MFU", "%", 100.0, False),
    ("step_time_s", "Step time", "ms", 1000.0, False),
    ("mem_bytes", "Peak memory", "GiB", 1 / 2**30, False),
    ("data_wait_s", "Data wait", "ms / step", 1000.0, False),
    ("comm_s", "Communication", "ms / step", 1000.0, False),
]
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


@dataclass(frozen=True)
class Plot:
    """One rendered plot: its key, title, and either PNG bytes as base64 or an HTML fragment (plotly)."""

    key: str
    title: str
    png_base64: str = ""
    html: str = ""


@dataclass(frozen=True)
class Line:
    """One drawn line: a run's attempt of one metric, in display units."""

    label: str
    colour: str
    x: np.ndarray
    y: np.ndarray
    dashed: bool = False


def x_values(run: RunData, steps: np.ndarray, x: XAxis) -> np.ndarray:
    """The x coordinate of each training record of `run` (records aligned with run.series)."""
    if x == "step":
        return steps
    key = "time" if x == "time" else "tokens_seen"
    _, values = run.series(key)
    if x == "time":
        finite = values[np.isfinite(values)]
        return (values - (finite.min() if finite.size else 0.0)) / 60.0
    if not np.any(np.isfinite(values)):  # older runs: steps × the spec's global batch
        batch = as_float(run.spec_get("training.global_batch_tokens"))
        values = steps * (batch if math.isfinite(batch) else math.nan)
    return values / 1e9


def _segments(steps: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each attempt: a new one begins where the step goes back (a resume)."""
    cuts = [0, *[i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]], len(steps)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def metric_lines(runs: list[RunData], key: str, scale: float, *, x: XAxis) -> list[Line]:
    """Every line of one metric: one colour per run when comparing, else one colour per attempt."""
    lines = []
    for index, run in enumerate(runs):
        steps, values = run.series(key)
        if not np.any(np.isfinite(values)):
            continue
        xs = x_values(run, steps, x)
        segments = _segments(steps)
        for attempt, (start, end) in enumerate(segments):
            colour = COLOURS[(index if len(runs) > 1 else attempt) % len(COLOURS)]
            label = run.run_dir.name if len(runs) > 1 else ""
            if len(segments) > 1:
                label = f"{label} attempt {attempt + 1}".strip()
            lines.append(Line(label, colour, xs[start:end], values[start:end] * scale, dashed=len(runs) > 1
                              and attempt > 0))
    return lines


def plan_reference(run: RunData, key: str) -> float | None:
    """The plan's value in the run's units: tokens/s for this run's GPU count, MFU in %; None without a plan."""
    if key == "mfu":
        mfu = as_float(run.plan_get("throughput.mfu"))
        return mfu * 100 if math.isfinite(mfu) else None
    if key == "tokens_per_s":
        tokens = as_float(run.plan_get("throughput.tokens_per_s"))
        gpus = as_float(run.plan_get("resources.layout_gpus") or run.plan_get("resources.num_gpus"))
        if math.isfinite(tokens) and math.isfinite(gpus) and gpus > 0:
            return tokens / gpus * max(1, run.world_size())
    return None


def _resume_xs(run: RunData, x: XAxis) -> list[float]:
    steps, _ = run.series("loss")
    xs = x_values(run, steps, x)
    return [float(xs[i]) for i in range(1, len(steps)) if steps[i] <= steps[i - 1] and math.isfinite(xs[i])]


def _to_base64(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _matplotlib_plot(runs: list[RunData], spec: tuple[str, str, str, float, bool], lines: list[Line],
                     *, x: XAxis) -> Plot:
    key, title, unit, _, logy = spec
    fig = Figure(figsize=(7.0, 3.5))
    ax = fig.subplots()
    for line in lines:
        ax.plot(line.x, line.y, color=line.colour, linewidth=1.6, linestyle="--" if line.dashed else "-",
                label=line.label or None)
    main = runs[0]
    if key == "loss" and main.evals and len(runs) == 1:
        eval_steps, eval_losses = main.series("eval_loss", main.evals)
        if x == "step" and np.any(np.isfinite(eval_losses)):
            ax.plot(eval_steps, eval_losses, "o", color="tab:orange", markersize=4, label="held-out loss")
            _label_last(ax, eval_steps, eval_losses, "held-out")
    reference = plan_reference(main, key)
    if reference is not None:
        ax.axhline(reference, color="0.3", linestyle=":", linewidth=1.4, label=f"plan {reference:.4g} {unit}")
    for resume in _resume_xs(main, x) if len(runs) == 1 else []:
        ax.axvline(resume, color="tab:red", linestyle="--", linewidth=1)
    if x == "step" and len(runs) == 1:
        for ckpt in main.checkpoints:
            if ckpt.committed:
                ax.axvline(ckpt.step, color="0.8", linewidth=0.8, zorder=0)
    shown = np.concatenate([line.y[np.isfinite(line.y)] for line in lines]) if lines else np.array([])
    if logy and shown.size and np.all(shown > 0) and shown.max() > 10 * shown.min():
        ax.set_yscale("log")
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(X_LABELS[x], fontsize=9)
    ax.set_ylabel(unit, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if any(line.label for line in lines) or reference is not None:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return Plot(key=key, title=title, png_base64=_to_base64(fig))


def _label_last(ax: Axes, xs: np.ndarray, ys: np.ndarray, name: str) -> None:
    """Write the newest finite point's value beside it (held-out points would otherwise be bare dots)."""
    finite = np.flatnonzero(np.isfinite(ys) & np.isfinite(xs))
    if finite.size:
        i = int(finite[-1])
        ax.annotate(f"{name} {ys[i]:.3f} (step {xs[i]:.0f})", (float(xs[i]), float(ys[i])),
                    textcoords="offset points", xytext=(-6, 8), ha="right", fontsize=8)


BY_SOURCE_KEYS = ("loss_by_source", "eval_loss_by_source")  # {source name: loss} in a metrics record


def by_source(record: dict[str, object], key: str) -> dict[str, object]:
    """A record's {source: loss} map; {} when absent or not an object (malformed_by_source names those)."""
    value = record.get(key)
    return value if isinstance(value, dict) else {}


def malformed_by_source(run: RunData) -> list[str]:
    """`metrics.jsonl: step 12: loss_by_source is not an object {source: loss} (['en'])...` for each record whose
    per-source map the plots had to leave out (a hand-edited file)."""
    found = []
    for record in [*run.metrics, *run.evals]:
        for key in BY_SOURCE_KEYS:
            value = record.get(key)
            if value is not None and not isinstance(value, dict):
                found.append(f"metrics.jsonl: step {record.get('step', '?')}: {key} is not an object "
                             f"{{source: loss}} ({str(value)[:40]!r}): left out of the plots")
    return found


def held_out_by_source(run: RunData) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Source name → (steps, held-out loss) from the eval records' eval_loss_by_source (every source, every eval)."""
    names: list[str] = []
    for record in run.evals:
        for name in by_source(record, "eval_loss_by_source"):
            if name not in names:
                names.append(name)
    out = {}
    for name in names:
        points = [(as_float(r.get("step")), as_float(by_source(r, "eval_loss_by_source").get(name)))
                  for r in run.evals]
        steps, losses = (np.array(v, dtype=float) for v in zip(*points, strict=True))
        out[name] = (steps, losses)
    return out


def source_loss_plot(run: RunData) -> Plot | None:
    """Held-out loss per source over steps (lines with points, each labelled with its newest value); training
    loss per source thin behind them. None when the run has neither."""
    held = held_out_by_source(run)
    steps, _ = run.series("loss")
    trained: dict[str, np.ndarray] = {}
    for record in run.metrics:
        for name in by_source(record, "loss_by_source"):
            trained.setdefault(name, np.full(len(run.metrics), np.nan))
    for i, record in enumerate(run.metrics):
        for name, value in by_source(record, "loss_by_source").items():
            trained[name][i] = as_float(value)
    if not held and len(trained) < 2:
        return None
    fig = Figure(figsize=(7.0, 3.5))
    ax = fig.subplots()
    names = list(dict.fromkeys([*held, *trained]))
    for index, name in enumerate(names):
        colour = COLOURS[index % len(COLOURS)]
        if name in trained:
            ax.plot(steps, trained[name], color=colour, linewidth=0.8, alpha=0.45, label=f"{name} (training)")
        if name in held:
            xs, ys = held[name]
            ax.plot(xs, ys, "o-", color=colour, markersize=4, linewidth=1.6, label=f"{name} (held-out)")
            _label_last(ax, xs, ys, name)
    ax.set_title("Held-out loss per source" if held else "Training loss per source", fontsize=11)
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel("nats", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return Plot(key="loss_by_source", title="Held-out loss per source", png_base64=_to_base64(fig))


def _plotly_plot(runs: list[RunData], spec: tuple[str, str, str, float, bool], lines: list[Line], *,
                 x: XAxis, include_js: bool) -> Plot:
    import plotly.graph_objects as go
    import plotly.io as pio

    key, title, unit, _, logy = spec
    fig = go.Figure()
    for line in lines:
        fig.add_trace(go.Scatter(x=line.x, y=line.y, mode="lines", name=line.label or title,
                                 line={"color": line.colour, "dash": "dash" if line.dashed else "solid"},
                                 hovertemplate=f"%{{x:.4g}}: %{{y:.4g}} {unit}<extra>{line.label}</extra>"))
    main = runs[0]
    if key == "loss" and main.evals and len(runs) == 1 and x == "step":
        eval_steps, eval_losses = main.series("eval_loss", main.evals)
        fig.add_trace(go.Scatter(x=eval_steps, y=eval_losses, mode="markers+text", name="held-out loss",
                                 marker={"color": "orange", "size": 7},
                                 text=[f"{v:.3f}" for v in eval_losses], textposition="top center"))
    reference = plan_reference(runs[0], key)
    if reference is not None:
        fig.add_hline(y=reference, line_dash="dot", line_color="#555", annotation_text=f"plan {reference:.4g}")
    for resume in _resume_xs(runs[0], x) if len(runs) == 1 else []:
        fig.add_vline(x=resume, line_dash="dash", line_color="red")
    fig.update_layout(title=title, xaxis_title=X_LABELS[x], yaxis_title=unit, height=360,
                      margin={"l": 50, "r": 20, "t": 40, "b": 40}, showlegend=any(line.label for line in lines))
    if logy:
        fig.update_yaxes(type="log")
    fragment = pio.to_html(fig, full_html=False, include_plotlyjs=include_js, div_id=f"plot-{key}")
    return Plot(key=key, title=title, html=fragment)


def plotly_available() -> bool:
    try:
        import plotly  # noqa: F401
    except ImportError:
        return False
    return True


def metric_plots(runs: RunData | list[RunData], *, x: XAxis = "step", interactive: bool = False) -> list[Plot]:
    """One plot per metric present in any run (absent metrics are skipped, not drawn empty)."""
    runs = [runs] if isinstance(runs, RunData) else runs
    plots: list[Plot] = []
    for spec in PLOTS:
        lines = metric_lines(runs, spec[0], spec[3], x=x)
        if not lines:
            continue
        if interactive:
            plots.append(_plotly_plot(runs, spec, lines, x=x, include_js=not plots))
        else:
            plots.append(_matplotlib_plot(runs, spec, lines, x=x))
    return plots


def timeline_plot(run: RunData) -> Plot | None:
    """Checkpoints, restarts/resumes, alerts and other events on one step axis, one lane each."""
    lanes: dict[str, list[float]] = {
        "checkpoints": [float(c.step) for c in run.checkpoints if c.committed],
        "checkpoint failed": [as_float(e.get("step")) for e in run.events_of("checkpoint_failed")],
        "restarts / resumes": [as_float(e.get("step")) for e in run.events_of("restart", "resume")],
        "alerts": [as_float(a.get("step")) for a in run.alerts if a.get("state", "firing") == "firing"],
        "OOM / errors": [as_float(e.get("step")) for e in run.events_of("oom", "error", "node_lost")],
    }
    steps_all, _ = run.series("loss")
    lanes["restarts / resumes"] += [float(steps_all[i]) for i in range(1, len(steps_all))
                                    if steps_all[i] <= steps_all[i - 1]]
    lanes = {name: [s for s in points if np.isfinite(s)] for name, points in lanes.items()}
    if not any(lanes.values()) and steps_all.size == 0:
        return None
    fig = Figure(figsize=(12, 2.6))
    ax = fig.subplots()
    colours = ["tab:green", "tab:red", "tab:orange", "tab:purple", "black"]
    for lane, (points, colour) in enumerate(zip(lanes.values(), colours, strict=True)):
        ax.scatter(points, [lane] * len(points), marker="|", s=300, color=colour)
    if steps_all.size:
        ax.set_xlim(0, float(np.nanmax(steps_all)) * 1.02 + 1)
    ax.set_yticks(range(len(lanes)), list(lanes), fontsize=9)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("step", fontsize=9)
    ax.set_title("Run timeline", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return Plot(key="timeline", title="Run timeline", png_base64=_to_base64(fig))
