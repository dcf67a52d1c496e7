"""Terminal tables for a plan (rich) and the what-if plot (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.errors import UserInputError
from leantrain.hardware import GiB
from leantrain.plan.budget import FAST_TIER_COPIES
from leantrain.plan.planner import Plan
from leantrain.render import human_count, human_days, human_money, plural


def _gib(value: float) -> str:
    return f"{value / GiB:,.1f} GiB"


def _gib_number(value: float) -> str:
    """GiB with 3 significant digits below 100, whole GiB above, "<0.01" for a tiny model's share (not 0.0)."""
    gib = value / GiB
    if 0 < abs(gib) < 0.01:
        return "<0.01"
    return f"{gib:,.0f}" if abs(gib) >= 100 else f"{gib:.3g}"


def _si(value: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {prefix}{unit}"
    return f"{value:,.2f} {unit}".strip()


def render_plan(plan: Plan, *, console: Console, top: int) -> None:
    """Budget, memory, top layouts, storage and checkpoint tables."""
    data = plan.to_json()
    c, r, t, cost = data["compute"], data["resources"], data["time"], data["cost"]
    budget = Table(title="budget", show_header=False)
    budget.add_column("item", style="bold")
    budget.add_column("value")
    model = data["model"]
    budget.add_row("model", f"{human_count(model['total_params'])} params ({human_count(model['active_params'])} "
                   f"active, nominal {human_count(model['nominal_params'])})")
    budget.add_row("FLOPs (sizes the GPU count)", f"{c['total_flops']:.3g} = {c['flops_per_token']:.3g}/token × "
                   f"{c['tokens']:.3g} tokens ({c['sizing']})")
    budget.add_row("FLOPs (detailed, for MFU)", f"{c['model_total_flops']:.3g} ({c['model_flops_per_token']:.3g}"
                   f"/token, attention {c['attention_flops_per_token']:.3g})")
    budget.add_row("effective FLOP/s per GPU", f"{c['peak_flops_per_gpu'] * c['assumed_mfu']:.3g} "
                   f"({c['peak_flops_per_gpu']:.3g} peak × {c['assumed_mfu']:.0%} assumed MFU)")
    budget.add_row("GPUs", f"{r['num_gpus']} ({r['num_gpus_exact']:.1f} exact) → {r['num_gpus_with_spare']} with "
                   f"spare, {plural(r['num_nodes'], 'node')} of {r['accelerator']}; layout on {r['layout_gpus']}")
    budget.add_row("time", f"{human_days(t['days'])}, {t['gpu_hours']:,.3g} GPU-hours at the assumed MFU; "
                   f"{human_days(t['predicted_days'])} predicted by the step-time model")
    budget.add_row("whole run", f"{human_days(t['whole_run_days'])}, {t['whole_run_gpu_hours']:,.3g} GPU-hours with "
                   f"{t['expected_goodput']:.1%} expected goodput, {t['eval_share']:.1%} evaluation and "
                   f"{t['whole_run_efficiency']:.0%} whole-run efficiency")
    a = data["assumptions"]
    power = (f"; {a['power_w']:g} W ({a['power_from']}: {a['power_factor']:.0%} of the matmul rate at the "
             f"{a['tdp_w']:g} W TDP)" if a["power_w"] is not None and a["power_factor"] < 1
             else f"; {a['power_w']:g} W ({a['power_from']})" if a["power_w"] is not None else "")
    budget.add_row("assumed", f"{a['kernels']} kernels ({a['kernels_from']}), "
                   f"{'fused' if a['fused_loss'] else 'unfused'} loss, {a['mlp']} MLP, {a['compute']}{power}")
    budget.add_row("whole run P10–P90", f"{human_days(t['days_p10'])} – {human_days(t['days_p90'])}, "
                   f"{t['gpu_hours_p10']:,.3g} – {t['gpu_hours_p90']:,.3g} GPU-hours (from {t['range_basis']}); "
                   f"step {data['throughput']['step_s_p10']:.3g} – {data['throughput']['step_s_p90']:.3g} s")
    money = cost["currency"]
    budget.add_row("cost", f"{human_money(cost['total'], money)} at the assumed MFU "
                   f"({human_money(cost['per_million_tokens'], money)} per million tokens); whole run "
                   f"{human_money(cost['whole_run'], money)}, P10–P90 {human_money(cost['total_p10'], money)} – "
                   f"{human_money(cost['total_p90'], money)}")
    console.print(budget)

    mem = data["memory"]
    per = mem["per_gpu"]
    where = f" (pipeline stage {mem['stage']}, the heaviest)" if data["layout"]["pp"] > 1 else ""
    # The unit in the title, not in every cell: eight columns fit 80 characters without cutting a word.
    memory = Table(title=f"memory per GPU, GiB{where} — {'fits' if mem['fits'] else 'DOES NOT FIT'}")
    for col in ("params", "grads", "optim", "activ", "buffers", "total", "capacity", "headroom"):
        memory.add_column(col, justify="right", no_wrap=True)
    parts = ("params", "grads", "optimizer", "activations", "buffers", "total")
    memory.add_row(*(_gib_number(per[k]) for k in parts), _gib_number(mem["capacity"]), _gib_number(mem["headroom"]))
    console.print(memory)
    console.print("optim: optimizer states, activ: activations", style="dim")

    layouts = Table(title=f"layouts on {plan.layout_gpus} GPUs (chosen: {plan.layout_source}); "
                    f"{plan.search.num_evaluated} evaluated")
    for col in ("#", "layout", "tokens/s", "MFU", "step", "why"):
        layouts.add_column(col)
    layouts.add_row("→", plan.chosen.layout.describe(), _si(plan.chosen.time.tokens_per_s),
                    f"{plan.chosen.time.mfu:.1%}", f"{plan.chosen.time.step_s:.2f} s", plan.chosen.why)
    others = [cand for cand in plan.search.ranked if cand.layout != plan.chosen.layout]
    for i, cand in enumerate(others[:top], start=1):
        layouts.add_row(str(i), cand.layout.describe(), _si(cand.time.tokens_per_s), f"{cand.time.mfu:.1%}",
                        f"{cand.time.step_s:.2f} s", cand.why)
    console.print(layouts)
    for note in plan.notes:
        console.print(f"note: {note}")
    for warning in data["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    if plan.search.rejected:
        console.print("rejected: " + "; ".join(f"{n} × {why}" for why, n in plan.search.rejected.items()))
    if not plan.fits:
        console.print(f"[bold red]does not fit[/] on {plan.layout_gpus} × {r['accelerator']}. What would:")
        for line in plan.search.suggestions:
            console.print(f"  • {line}")

    _render_storage(data, console=console)


def _render_storage(data: dict[str, Any], *, console: Console) -> None:
    s, k = data["storage"], data["checkpoint"]
    other = Table(title="storage and checkpoints", show_header=False)
    other.add_column("item", style="bold")
    other.add_column("value")
    other.add_row("data", f"{_si(s['data_bytes'], 'B')} (tokenized {_si(s['tokenized_bytes'], 'B')} × "
                  f"{s['replicas']} + raw {_si(s['raw_bytes'], 'B')})")
    other.add_row("checkpoint", f"{_si(s['checkpoint_bytes'], 'B')} each, {_si(s['checkpoints_kept_bytes'], 'B')} kept")
    wait = f", of which {k['write_wait_s']:.3g} s waiting for the previous write" if k.get("write_wait_s") else ""
    other.add_row("checkpoint interval", f"{k['interval_steps']} steps = {k['interval_s'] / 60:.1f} min "
                  f"(recommended: {k['recommended_interval_s'] / 60:.1f} min); save {k['save_s']:.3g} s, "
                  f"blocks {k['blocking_s']:.3g} s{wait}")
    other.add_row("failures", f"MTBF {k['mtbf_s'] / 3600:.1f} h at {k['failures_per_gpu_day']:.2e}/GPU-day; "
                  f"expected goodput {k['expected_goodput']:.1%}")
    tier = data.get("fast_tier") or {}
    if tier.get("enabled"):
        where = {True: "fits", False: "DOES NOT FIT", None: "disk: checked by launch --preflight"}[tier["fits"]]
        other.add_row("fast tier", f"{_si(tier['bytes_per_node'], 'B')} per node in {tier['memory_dir']} "
                      f"({FAST_TIER_COPIES} × {_si(tier['shard_bytes_per_rank'], 'B')} × {tier['local_ranks']} "
                      f"ranks): {where}")
    host = data.get("host_memory") or {}
    if host:
        files = f" + {_si(host['fast_tier_bytes_per_node'], 'B')} fast tier" if host["fast_tier_bytes_per_node"] else ""
        other.add_row("host memory", f"{_si(host['bytes_per_node'], 'B')} per node ({host['local_ranks']} × "
                      f"{_si(host['per_process']['total'], 'B')} per process{files}) of "
                      f"{_si(host['host_memory_bytes_per_node'], 'B')}: {'fits' if host['fits'] else 'DOES NOT FIT'}")
    console.print(other)


def render_calibration(calibration: dict[str, Any], *, console: Console) -> None:
    table = Table(title=f"calibrated on {len(calibration['runs'])} run(s): compute efficiency "
                  f"{calibration['compute_efficiency']:.3f}, dp overlap {calibration['dp_overlap']:.1f}")
    for col in ("run dir", "layout", "measured step", "fitted efficiency"):
        table.add_column(col)
    for row in calibration["runs"]:
        table.add_row(row["run_dir"], row["layout"], f"{row['measured_step_s']:.3f} s",
                      f"{row['fitted_efficiency']:.3f}")
    console.print(table)


def _short(value: float) -> str:
    """265,448 → "265K", 94,546,724 → "94.5M", 999,700 → "1M" (3 significant digits): a what-if cost."""
    rounded = float(f"{value:.3g}")  # round first, so that 999,700 is 1.00M, not 1e+03K
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(rounded) >= scale:
            return f"{rounded / scale:.3g}{suffix}"
    return f"{rounded:.3g}"


def render_what_if(rows: list[dict[str, Any]], *, console: Console, currency: str) -> None:
    """The what-if table: the budget at the assumed MFU beside the whole run as the plan predicts it (P50 over
    P10–P90), on the layout the plan would choose at each GPU count (listed below the table: with the layouts
    in it the ranges would not fit 80 characters)."""
    cells, layouts = [], []
    for row in rows:
        if row["fits"]:
            days = "{:.1f}\n{:.1f}–{:.1f}".format(*(row[f"whole_run_days_{p}"] for p in ("p50", "p10", "p90")))
            cost = "{}\n{}–{}".format(*(_short(row[f"whole_run_cost_{p}"]) for p in ("p50", "p10", "p90")))
            mfu = f"{row['predicted_mfu']:.1%}"
            layouts.append(f"{row['gpus']} GPUs: {row['layout']} ({row['layout_source']})")
        else:
            days, cost, mfu = "no fit", "-", "-"
        cells.append((str(row["gpus"]), f"{row['days']:.1f}", _short(row["cost"]), days, cost, mfu))
    table = Table(title="what if", caption=f"whole run: P50 over P10–P90; costs in {currency}; MFU: predicted")
    headers = ("GPUs", "days at assumed MFU", "cost at assumed MFU", "whole run days", "whole run cost", "MFU")
    for i, col in enumerate(headers):  # numbers are never cut: each column is as wide as its longest figure
        table.add_column(col, min_width=max((len(line) for cell in cells for line in cell[i].split("\n")),
                                            default=4))
    for cell in cells:
        table.add_row(*cell)
    console.print(table)
    for line in layouts:
        console.print(f"  {line}")


# The formats the what-if plot is written in, chosen by the file's suffix: matplotlib's own writers and Pillow's
# (a dependency of matplotlib); not pgf (needs LaTeX), AVIF (needs a Pillow built with it) or raw pixel buffers.
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")


def check_plot_path(path: Path | None, option: str) -> None:
    """Refuse, before any work, a plot path whose suffix names no format the plot is written in."""
    if path is not None and Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise UserInputError(f"{option} {path}: the plot's format comes from the file suffix; use one of "
                             f"{', '.join(PLOT_SUFFIXES)} (e.g. {Path(path).with_suffix('.png')})")


def plot_what_if(rows: list[dict[str, Any]], path: Path, *, currency: str = "USD") -> Path:
    """Days (top) and cost (bottom) against GPU count, as a PNG, SVG, PDF, ... by the suffix (Agg backend: no display
    needed): the budget at the assumed MFU and the predicted whole run's P50 with its P10–P90 band."""
    check_plot_path(path, "--plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (days_ax, cost_ax) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    fitting = [row for row in rows if row["fits"]]
    for ax, assumed, predicted, unit in ((days_ax, "days", "whole_run_days", "days"),
                                         (cost_ax, "cost", "whole_run_cost", f"cost ({currency})")):
        ax.plot([row["gpus"] for row in rows], [row[assumed] for row in rows], marker="o", linestyle="--",
                label="assumed MFU")
        if fitting:
            gpus = [row["gpus"] for row in fitting]
            ax.plot(gpus, [row[f"{predicted}_p50"] for row in fitting], marker="s", label="whole run, P50")
            ax.fill_between(gpus, [row[f"{predicted}_p10"] for row in fitting],
                            [row[f"{predicted}_p90"] for row in fitting], alpha=0.25, label="whole run, P10–P90")
        ax.set_ylabel(unit)
        ax.legend(loc="best", fontsize="small")
    days_ax.set_yscale("log")  # days fall as 1/GPUs: a straight line where scaling is linear
    cost_ax.set_xscale("log", base=2)
    cost_ax.set_xticks([row["gpus"] for row in rows], [str(row["gpus"]) for row in rows])
    cost_ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    cost_ax.set_xlabel("GPUs")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise UserInputError(f"--plot {path}: cannot be written ({err.strerror or err})") from None
    finally:
        plt.close(fig)
    return path
