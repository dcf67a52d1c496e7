"""`leantrain train SPEC` and the demo's train stage.

`--max-steps N` sets the run length (the LR schedule is laid over N steps, as if training.max_steps were N);
`--max-steps 0` builds, shards and initialises (or loads) the model, records `model_ready` and stops.
`--resume` / `--weights-only` / `--extend-schedule` choose the starting point (ckpt/resume.py). SIGINT and
SIGTERM save a checkpoint at the current step and exit 130/143 with one line saying so; a rerun resumes.
Under torchrun each process is one rank (see train.runtime); rank 0 writes the run dir.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from leantrain.ckpt.attempt import JOB_START_FILE, JobAttempt, agree_job_attempt, record_job_start
from leantrain.ckpt.integrity import step_dir
from leantrain.ckpt.resume import ResumeRequest, precheck
from leantrain.data.layout import check_not_data_dir
from leantrain.errors import Interrupted, LeantrainError, UserInputError
from leantrain.spec.schema import JobSpec
from leantrain.train.run_setup import description_snapshot, finish_run, prepare_run, restore_description
from leantrain.train.startup_signals import INTERRUPT_SIGNALS, StartupSignals

if TYPE_CHECKING:
    from leantrain.demo_context import DemoContext
    from leantrain.train.trainer import Checkpointer, Trainer


SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # launch.resources.TORCHRUN_ENV sets it to 1
log = logging.getLogger("leantrain.train")


def check_trainable(spec: JobSpec) -> None:
    """What the spec rules accept for planning but the trainer does not run (also `leantrain rehearse`'s check)."""
    if spec.parallelism.pipeline_parallel > 1 and spec.parallelism.pipeline_schedule == "dualpipe":
        raise UserInputError(
            "parallelism.pipeline_schedule: dualpipe is planning only (`leantrain plan` prices DeepSeek-V3's "
            "schedule); to train, use 1f1b or interleaved_1f1b"
        )


def _check_data_dir(spec: JobSpec) -> None:
    if not (Path(spec.data.dir) / "manifest.json").is_file():
        raise UserInputError(
            f"data.dir {spec.data.dir} has no manifest.json: run `leantrain prepare SPEC` first (or set data.dir)"
        )


def _checkpointer_factory(resume: ResumeRequest | None, *, attempt: JobAttempt) -> Callable[[Trainer], Checkpointer]:
    """The checkpoint manager's adapter, resuming as `--resume` asks, with the job's agreed attempt."""
    from leantrain.ckpt.hook import TrainerCheckpointer

    return functools.partial(TrainerCheckpointer, resume=resume, attempt=attempt)


@dataclass
class TrainOutcome:
    """What a `train` call did: the logged records, and how the loop ended."""

    records: list[dict[str, Any]] = field(default_factory=list)
    finished_already: bool = False  # the run had reached its last step before this call
    interrupted: Interrupted | None = None


def train(
    spec: JobSpec, *, run_dir: Path | None, max_steps: int | None, console: Console | None,
    resume: ResumeRequest | None = None,
) -> TrainOutcome:
    """Build a trainer for the spec, train to the end (or a signal), close it; rank 0 holds the run dir's lease
    (ckpt/lease.py) throughout, so a second job into the same run dir exits 2 naming this one. A signal before
    or after the training loop is one line and exit 130/143 (StartupSignals)."""
    signals = StartupSignals()
    try:
        return _train(spec, run_dir=run_dir, max_steps=max_steps, console=console, resume=resume, signals=signals)
    finally:
        signals.restore()


def _train(
    spec: JobSpec, *, run_dir: Path | None, max_steps: int | None, console: Console | None,
    resume: ResumeRequest | None, signals: StartupSignals,
) -> TrainOutcome:
    from leantrain.ckpt.lease import acquire_lease
    from leantrain.ckpt.preflight import preflight_storage

    target = Path(run_dir or spec.run.dir)
    attempt = job_attempt(spec)
    if int(os.environ.get("RANK", "0")) != 0:
        return _train_leased(spec, run_dir=run_dir, max_steps=max_steps, console=console, resume=resume,
                             attempt=attempt, signals=signals)
    check_not_data_dir(target, given=run_dir is not None)
    existed = target.exists()
    lease = acquire_lease(target, command="train", owner_only=spec.security.owner_only, attempt=attempt.number)
    signals.on_stuck = lease.release  # a signal the blocked main thread cannot take still frees the run dir
    try:
        if attempt.number == 0:  # before any refusal: a restart of a refused start must be refused again
            record_job_start(target)
        preflight_storage(spec, run_dir=target)
        return _train_leased(spec, run_dir=run_dir, max_steps=max_steps, console=console, resume=resume,
                             attempt=attempt, signals=signals)
    except BaseException:
        if not existed:  # a start refused before it wrote anything leaves no empty run dir behind
            lease.release()
            with contextlib.suppress(OSError):
                (target / JOB_START_FILE).unlink(missing_ok=True)
                target.rmdir()
        raise
    finally:
        lease.release()


def job_attempt(spec: JobSpec) -> JobAttempt:
    """The job's restart attempt (0 on a first start), agreed by every rank once per start (ckpt/attempt.py).

    torchrun counts a restart only on the agent whose workers failed; an agent that restarts its workers because
    the rendezvous changed keeps its count, so after a failure on one node the other nodes' ranks see a lower
    one, and after a membership change alone every rank sees the count of the start before. The first-start
    check, the lease's takeover rule and the checkpoint hook (its resume choice and `restart` event) all use this
    one agreed attempt, so a rank 0 on a node that did not fail neither refuses its own job's checkpoints
    (`--resume none`) nor waits for its own job's old lease. With several ranks this starts the process group
    (the trainer reuses it) and all-reduces, before rank 0 takes the lease.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return agree_job_attempt()
    from leantrain.ckpt.manager import all_reduce_max
    from leantrain.train.runtime import init_runtime

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("RANK", "0")) == 0:
        # torch's rendezvous then keeps one store for every round, unprefixed: a restarted group can read the
        # previous round's gloo addresses and time out connecting (measured: 2 of 3 restarts failed so).
        log.warning("torchrun shares its rendezvous store with the workers: restarts of this job can time out "
                    "connecting; set %s=1 in torchrun's environment (`leantrain launch` does)", SHARED_STORE_OFF)
    runtime = init_runtime(spec)
    return agree_job_attempt(functools.partial(all_reduce_max, device=runtime.device))


def _train_leased(
    spec: JobSpec, *, run_dir: Path | None, max_steps: int | None, console: Console | None,
    resume: ResumeRequest | None, attempt: JobAttempt, signals: StartupSignals,
) -> TrainOutcome:
    from leantrain.train.trainer import Trainer

    if max_steps is not None and max_steps < 0:
        raise UserInputError(f"--max-steps must be 0 (build the model, record model_ready, stop) or more: {max_steps}")
    check_trainable(spec)
    _check_data_dir(spec)
    target = Path(run_dir or spec.run.dir)
    rank = int(os.environ.get("RANK", "0"))
    if attempt.number == 0 and rank == 0:  # refusals that need no model, before anything is written; rank 0 alone
        precheck(spec, run_dir=target, request=resume or ResumeRequest(), max_steps=max_steps)  # lists the store
    before = description_snapshot(target) if rank == 0 else {}
    context = prepare_run(spec, run_dir=target, rank=rank, console=console)
    status = "failed"
    try:
        trainer = Trainer(
            spec, run_dir=target, max_steps=max_steps, console=console, extra_sinks=context.sinks,
            checkpointer_factory=_checkpointer_factory(resume, attempt=attempt),
        )
    except BaseException as err:
        for sink in context.sinks:  # the trainer never took them over: stop the alert watchdog here
            sink.close()
        finish_run(context, status="interrupted" if isinstance(err, Interrupted) else status)
        if isinstance(err, LeantrainError) and err.exit_code == 2:  # refused (e.g. every checkpoint invalid):
            restore_description(target, before)  # the run dir describes the run that was, not the refused one
        raise
    outcome = TrainOutcome()
    signals.phase = None  # the checkpointer's PreemptionHandler has the signals now
    try:
        outcome.records = trainer.train()
        hook = trainer.checkpointer
        outcome.finished_already = bool(getattr(hook, "finished", False))
        stop_reason = getattr(hook, "stop_reason", None)
        status = {None: "finished", "preempted": "preempted"}.get(stop_reason, "requeued")
        outcome.interrupted = _interrupted(trainer)
        if outcome.interrupted is not None:
            status = "interrupted"
        return outcome
    except Interrupted:
        status = "interrupted"
        raise
    finally:
        signals.phase = "shutdown"
        trainer.close()
        finish_run(context, status=status)


def _interrupted(trainer: Trainer) -> Interrupted | None:
    """The one-line report of a SIGINT/SIGTERM stop (other preemption signals keep exit 0)."""
    hook: Any = trainer.checkpointer
    name = getattr(hook, "stop_signal", None)
    if name not in INTERRUPT_SIGNALS:
        return None
    manager = hook.manager
    with contextlib.suppress(LeantrainError):  # reported through the checkpoint_failed alert
        manager.wait()
    saved = manager.last_saved_step
    if saved == trainer.step:
        what = f"checkpoint saved at step {saved} ({manager.store.describe(step_dir(saved))}); run the same " \
               "command again to resume from it"
    else:
        what = (f"the checkpoint at step {trainer.step} could not be saved (newest good: "
                f"{'none' if saved is None else f'step {saved}'}); see events.jsonl")
    return Interrupted(f"stopped by {name} at step {trainer.step}: {what}", signal_name=name)


def run(
    *, console: Console, spec: JobSpec, run_dir: Path | None, max_steps: int | None,
    resume: ResumeRequest | None = None,
) -> None:
    """The CLI entry point."""
    outcome = train(spec, run_dir=run_dir, max_steps=max_steps, console=console, resume=resume)
    code = 0 if outcome.interrupted is None else outcome.interrupted.exit_code
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 speaks for the job
        target = Path(run_dir or spec.run.dir)
        if outcome.interrupted is not None:
            console.print(f"[yellow]{escape(str(outcome.interrupted))}", highlight=False, soft_wrap=True)
        elif max_steps == 0:
            console.print(f"[green]model ready[/green]: built, sharded, initialised; see {target / 'events.jsonl'}")
        elif not outcome.finished_already:
            console.print(f"[green]trained[/green]: {summary(outcome.records)}; metrics in {target / 'metrics.jsonl'}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun worker can abort at interpreter exit after destroy_process_group ("terminate called
        # without an active exception", seen here about 1 run in 8): everything is written, so leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


def summary(records: list[dict[str, Any]]) -> str:
    """First/last training loss, last held-out loss and throughput, in one line."""
    steps = [r for r in records if "loss" in r and not math.isnan(r["loss"])]
    if not steps:
        return "no training step logged"
    first, last = steps[0], steps[-1]
    line = f"{last['step']} steps, loss {first['loss']:.3f} (step {first['step']}) → {last['loss']:.3f}"
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ppl = f" (ppl {evals[-1]['eval_perplexity']:.1f})" if "eval_perplexity" in evals[-1] else ""
        line += f", held-out loss {evals[-1]['eval_loss']:.3f}{ppl}"
    return line + f", {last['tokens_per_s']:,.0f} tok/s"


def demo_stage(ctx: DemoContext) -> str:
    """Train the demo spec (its own training.max_steps) on the data dir the prepare stage wrote."""
    spec = ctx.spec()
    outcome = train(spec, run_dir=Path(spec.run.dir), max_steps=None, console=ctx.console)
    if outcome.interrupted is not None:
        raise outcome.interrupted
    return summary(outcome.records)
