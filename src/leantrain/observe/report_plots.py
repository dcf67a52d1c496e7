"""Plots for the HTML report: matplotlib figures rendered to base64 PNG, so the report is one file.

Uses `matplotlib.figure.Figure` directly (no pyplot): no global figure state, no GUI backend, safe from any
thread. Resumes are drawn as dashed red lines and committed checkpoints as grey ticks on every plot, so a
jump in a curve can be read against what happened to the run.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from leantrain.observe.report_data import RunData, as_float

# (metrics key, title, y label, scale factor, log y)
PLOTS: list[tuple[str, str, str, float, bool]] = [
    ("loss", "Loss", "loss", 1.0, False),
    ("grad_norm", "Gradient norm", "norm", 1.0, True),
    ("lr", "Learning rate", "lr", 1.0, False),
    ("tokens_per_s", "Throughput", "tokens/s", 1.0, False),
    ("mfu", "MFU", "%", 100.0, False),
    ("mem_bytes", "Peak memory", "GiB", 1 / 2**30, False),
    ("data_wait_s", "Data wait", "s / step", 1.0, False),
    ("comm_s", "Communication", "s / step", 1.0, False),
]


@dataclass(frozen=True)
class Plot:
    """One rendered plot: its key, title and PNG bytes as base64."""

    key: str
    title: str
    png_base64: str


def _to_base64(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _mark_run_events(ax: object, run: RunData, resume_steps: list[float]) -> None:
    for step in resume_steps:
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1)  # type: ignore[attr-defined]
    for ckpt in run.checkpoints:
        if ckpt.committed:
            ax.axvline(ckpt.step, color="0.75", linewidth=0.8, zorder=0)  # type: ignore[attr-defined]


def metric_plots(run: RunData) -> list[Plot]:
    """One small line plot per metric present in the run (absent metrics are skipped, not drawn empty)."""
    steps_all, _ = run.series("loss")
    resume_steps = [float(steps_all[i]) for i in range(1, len(steps_all)) if steps_all[i] <= steps_all[i - 1]]
    plots = []
    for key, title, ylabel, scale, logy in PLOTS:
        steps, values = run.series(key)
        if not np.any(np.isfinite(values)):
            continue
        fig = Figure(figsize=(5.2, 2.8))
        ax = fig.subplots()
        # Split at resumes so a restarted segment does not draw a line back across the earlier one.
        cuts = [0, *[i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]], len(steps)]
        for start, end in zip(cuts[:-1], cuts[1:], strict=True):
            ax.plot(steps[start:end], values[start:end] * scale, color="tab:blue", linewidth=1.6)
        if key == "loss" and run.evals:
            eval_steps, eval_losses = run.series("eval_loss", run.evals)
            ax.plot(eval_steps, eval_losses, "o", color="tab:orange", markersize=4, label="held-out eval")
            ax.legend(loc="upper right", fontsize=7)
        bad = ~np.isfinite(values)
        if key in ("loss", "grad_norm") and np.any(bad):
            ymin = np.nanmin(values[np.isfinite(values)] * scale)
            ax.scatter(steps[bad], np.full(int(bad.sum()), ymin), marker="x", color="tab:red", label="non-finite")
            ax.legend(loc="upper right", fontsize=7)
        shown = values[np.isfinite(values)]
        if logy and np.all(shown > 0) and shown.max() > 10 * shown.min():  # log only when it spans a decade
            ax.set_yscale("log")
        _mark_run_events(ax, run, resume_steps)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        plots.append(Plot(key=key, title=title, png_base64=_to_base64(fig)))
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
    fig = Figure(figsize=(10.5, 2.4))
    ax = fig.subplots()
    colours = ["tab:green", "tab:red", "tab:orange", "tab:purple", "black"]
    for lane, (points, colour) in enumerate(zip(lanes.values(), colours, strict=True)):
        ax.scatter(points, [lane] * len(points), marker="|", s=300, color=colour)
    if steps_all.size:
        ax.set_xlim(0, float(np.nanmax(steps_all)) * 1.02 + 1)
    ax.set_yticks(range(len(lanes)), list(lanes), fontsize=8)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("step", fontsize=8)
    ax.set_title("Run timeline", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return Plot(key="timeline", title="Run timeline", png_base64=_to_base64(fig))
