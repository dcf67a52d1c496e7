"""`leantrain train SPEC` and the demo's train stage.

`--max-steps N` sets the run length (the LR schedule is laid over N steps, as if training.max_steps were N).
Under torchrun each process is one rank (see train.runtime); rank 0 writes the run dir.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from leantrain.errors import UserInputError
from leantrain.spec.schema import JobSpec
from leantrain.train.run_setup import finish_run, prepare_run

if TYPE_CHECKING:
    from leantrain.demo_context import DemoContext
    from leantrain.train.trainer import Checkpointer, Trainer


def _check_data_dir(spec: JobSpec) -> None:
    if not (Path(spec.data.dir) / "manifest.json").is_file():
        raise UserInputError(
            f"data.dir {spec.data.dir} has no manifest.json: run `leantrain prepare SPEC` first (or set data.dir)"
        )


def _checkpointer_factory() -> Callable[[Trainer], Checkpointer] | None:
    """The checkpoint manager's adapter (issue #7) when this version has it; training without it otherwise."""
    try:
        from leantrain.ckpt.hook import TrainerCheckpointer
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("leantrain.ckpt"):
            return None
        raise
    return TrainerCheckpointer


def train(
    spec: JobSpec, *, run_dir: Path | None, max_steps: int | None, console: Console | None
) -> list[dict[str, Any]]:
    """Build a trainer for the spec, train to the end, close it; returns the logged records."""
    from leantrain.train.trainer import Trainer

    if max_steps is not None and max_steps <= 0:
        raise UserInputError(f"--max-steps must be positive, got {max_steps}")
    _check_data_dir(spec)
    target = Path(run_dir or spec.run.dir)
    context = prepare_run(spec, run_dir=target, rank=int(os.environ.get("RANK", "0")), console=console)
    status = "failed"
    try:
        trainer = Trainer(
            spec, run_dir=target, max_steps=max_steps, console=console, extra_sinks=context.sinks,
            checkpointer_factory=_checkpointer_factory(),
        )
    except BaseException:
        for sink in context.sinks:  # the trainer never took them over: stop the alert watchdog here
            sink.close()
        finish_run(context, status=status)
        raise
    try:
        records = trainer.train()
        stop_reason = getattr(trainer.checkpointer, "stop_reason", None)
        status = {None: "finished", "preempted": "preempted"}.get(stop_reason, "requeued")
        return records
    finally:
        trainer.close()
        finish_run(context, status=status)


def run(*, console: Console, spec: JobSpec, run_dir: Path | None, max_steps: int | None) -> None:
    """The CLI entry point."""
    records = train(spec, run_dir=run_dir, max_steps=max_steps, console=console)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 speaks for the job
        target = Path(run_dir or spec.run.dir)
        console.print(f"[green]trained[/green]: {summary(records)}; metrics in {target / 'metrics.jsonl'}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun worker can abort at interpreter exit after destroy_process_group ("terminate called
        # without an active exception", seen here about 1 run in 8): everything is written, so leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def summary(records: list[dict[str, Any]]) -> str:
    """First/last training loss, last held-out loss and throughput, in one line."""
    steps = [r for r in records if "loss" in r and not math.isnan(r["loss"])]
    if not steps:
        return "no training step logged"
    first, last = steps[0], steps[-1]
    line = f"{last['step']} steps, loss {first['loss']:.3f} (step {first['step']}) → {last['loss']:.3f}"
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        line += f", held-out loss {evals[-1]['eval_loss']:.3f} (ppl {evals[-1]['eval_perplexity']:.1f})"
    return line + f", {last['tokens_per_s']:,.0f} tok/s"


def demo_stage(ctx: DemoContext) -> str:
    """Train the demo spec (its own training.max_steps) on the data dir the prepare stage wrote."""
    spec = ctx.spec()
    records = train(spec, run_dir=Path(spec.run.dir), max_steps=None, console=ctx.console)
    return summary(records)
