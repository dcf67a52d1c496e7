"""`leantrain plan` and the demo's plan stage."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from leantrain.errors import UserInputError, check_output_file
from leantrain.plan.planner import build_plan, make_plan, what_if_rows
from leantrain.plan.render import check_plot_path, plot_what_if, render_calibration, render_plan, render_what_if
from leantrain.spec import JobSpec, load_spec

__all__ = ["demo_stage", "make_plan", "parse_what_if", "run"]


def parse_what_if(text: str) -> tuple[list[int], Path | None]:
    """`gpus=64,128,256` (optionally `,plot=FILE.png`) → GPU counts and the plot path."""
    key, counts, plot = None, [], None
    for item in (part.strip() for part in text.split(",")):
        if "=" in item:
            key, item = (s.strip() for s in item.split("=", 1))
        elif key is None:
            raise UserInputError(f"--what-if {text!r}: start with a key, e.g. gpus=64,128,256[,plot=FILE.png]")
        if key == "plot" and plot is not None:
            raise UserInputError(f"--what-if {text!r}: plot= is given more than once")
        if key == "gpus":
            if not item.isdigit() or int(item) < 1:
                raise UserInputError(f"--what-if: GPU counts are positive integers, got {item!r} "
                                     "(e.g. gpus=64,128,256)")
            counts.append(int(item))
        elif key == "plot":
            plot = Path(item)
            check_output_file(plot, "--what-if plot=")
            check_plot_path(plot, "--what-if plot=")
        else:
            raise UserInputError(f"--what-if: unknown key {key!r}; use gpus=64,128,256[,plot=FILE.png]")
    if not counts:
        raise UserInputError("--what-if needs GPU counts, e.g. gpus=64,128,256")
    return counts, plot


def write_plan_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def run(*, console: Console, spec: JobSpec, json_out: Path | None, top: int, what_if: str | None,
        plot: Path | None = None, calibrate: list[Path] | None = None) -> None:
    """Print the plan; write plan.json with --json; --what-if adds a table (and a PNG with plot=, drawn after
    plan.json is written, so a plot that fails loses nothing); --calibrate fits the step-time constants to earlier
    runs first (plan/calibrate.py). The flags are checked before any of it."""
    start = time.perf_counter()
    check_plot_path(plot, "--plot")
    counts, plot_from_flag = parse_what_if(what_if) if what_if else ([], None)
    plot = plot or plot_from_flag
    calibration = None
    if calibrate:
        from leantrain.plan.calibrate import apply
        from leantrain.plan.calibrate import calibrate as fit

        calibration = fit(spec, list(calibrate))
        spec = apply(spec, calibration)
        render_calibration(calibration, console=console)
    plan = build_plan(spec)
    plan.calibration = calibration
    if counts:
        what_if_rows(plan, counts)
    render_plan(plan, console=console, top=max(1, top))
    if plan.what_if:
        render_what_if(plan.what_if, console=console, currency=spec.budget.currency)
    if spec.plan.trace:
        from leantrain.plan.trace import compare, render_comparison

        layout = plan.chosen.layout
        render_comparison(compare(spec, micro_batch=layout.micro_batch, recompute=layout.recompute),
                          console=console, micro_batch=layout.micro_batch, recompute=layout.recompute)
    if json_out is not None:
        write_plan_json(plan.to_json(), json_out)
        console.print(f"wrote {json_out}")
    if plan.what_if and plot is not None:
        console.print(f"what-if plot: {plot_what_if(plan.what_if, plot, currency=spec.budget.currency)}")
    console.print(f"planned in {time.perf_counter() - start:.2f} s")



def demo_stage(ctx: Any) -> str:
    """Plan the demo spec (plan.json into the demo dir) and the 10B example (examples/seed-10b.yaml) next to it."""
    from leantrain.demo_context import DEMO_SPEC

    demo_plan = build_plan(ctx.spec())
    render_plan(demo_plan, console=ctx.console, top=3)
    write_plan_json(demo_plan.to_json(), ctx.out_dir / "plan.json")
    seed = build_plan(load_spec(DEMO_SPEC.parent / "seed-10b.yaml"))
    seed_json = seed.to_json()
    write_plan_json(seed_json, ctx.out_dir / "plan-seed-10b.json")
    c, r = seed_json["compute"], seed_json["resources"]
    return (f"seed 10B/2T: {c['total_flops']:.2g} FLOPs → {r['num_gpus']} GPUs ({r['num_gpus_with_spare']} with "
            f"spare) for {seed_json['time']['days']:.0f} days; demo plan.json written, fits: "
            f"{demo_plan.fits}")
