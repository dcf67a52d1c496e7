"""`leantrain demo`: the whole chain on the bundled corpus (examples/tiny-cpu.yaml), on the CPU.

Each stage is one function of the module that owns it; it takes the demo context and returns a one-line
summary. A stage that fails stops the demo with its error: the demo never fakes a result.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from leantrain.demo_context import DEMO_SPEC, DemoContext
from leantrain.errors import UserInputError, check_output_dir


def _stage_spec(ctx: DemoContext) -> str:
    from leantrain.render import render_spec_summary

    spec = ctx.spec()
    render_spec_summary(spec, console=ctx.console)
    return f"spec valid; {len(spec.data.sources)} sources, outputs under {ctx.out_dir}"


# (stage, module that owns it, its demo function): each takes the demo context, returns a one-line summary.
STAGES: list[tuple[str, str, str]] = [
    ("spec", "leantrain.demo", "_stage_spec"),
    ("plan", "leantrain.plan.command", "demo_stage"),
    ("job files", "leantrain.launch.command", "demo_stage"),
    ("prepare", "leantrain.data.command", "demo_stage"),
    ("train (2 ranks)", "leantrain.launch.command", "demo_train_stage"),
    ("drill", "leantrain.golive.drill", "demo_stage"),
    ("report", "leantrain.observe.report", "demo_stage"),
    ("validate", "leantrain.golive.validate", "demo_stage"),
    ("doctor", "leantrain.golive.doctor", "demo_stage"),
]


def run_demo(*, out_dir: Path, console: Console, spec_path: Path = DEMO_SPEC) -> list[tuple[str, str, str]]:
    """Run every stage in order; returns (stage, status, summary) rows. A failing stage raises."""
    if not spec_path.is_file():
        raise UserInputError(
            f"the demo spec {spec_path} is missing: run the demo from a source checkout (make demo)"
        )
    out_dir = out_dir.resolve()
    check_output_dir(out_dir, "--dir")  # a file there: one line naming the option, not mkdir's "File exists"
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = DemoContext(
        spec_path=spec_path,
        out_dir=out_dir,
        console=console,
        overrides=[f"data.dir={out_dir / 'data'}", f"run.dir={out_dir / 'run'}"],
    )
    rows: list[tuple[str, str, str]] = []
    for number, (name, module, function) in enumerate(STAGES, start=1):
        console.rule(f"[bold]{number}/{len(STAGES)} {name}")
        start = time.perf_counter()
        stage: Callable[[DemoContext], str] = getattr(importlib.import_module(module), function)
        summary = stage(ctx)
        rows.append((name, f"done ({time.perf_counter() - start:.1f} s)", summary))
    table = Table(title="leantrain demo")
    for column in ("stage", "status", "result"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for name, _, summary in rows:  # the two lines a user looks for: the verdict and where the report is
        if name == "validate":
            console.print(f"[bold]{escape(summary)}[/]")
        elif name == "report":
            console.print(escape(summary))
    return rows
