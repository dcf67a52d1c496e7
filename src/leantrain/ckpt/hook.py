"""Adapter from `CheckpointManager` to the trainer's `Checkpointer` protocol (train/trainer.py).

    trainer = Trainer(spec, run_dir=run_dir, checkpointer_factory=TrainerCheckpointer)

The trainer calls `load_latest(trainer)` once after setup, `maybe_save(trainer, force=last)` after every step on
every rank, and `close()`. This module reads the trainer's attributes by name (duck typing, no import of
leantrain.train): model, optimizer, scheduler, sampler (Stateful with the global sample index), the counters
step / tokens_seen / skipped_steps, runtime.rank / runtime.world_size, spec and run_dir.

Restarts: a worker that torchrun restarted (the job's attempt > 0, agreed once per start by every rank,
ckpt/attempt.py: `leantrain train` agrees on it before the lease and passes it in as `attempt`) records a
`restart` event after its resume (rank 0): the attempt, the step it resumed from, its cause (`hang`, `drill`,
`membership change` or `worker failure`) and `recovery_s`, the wall time from the failure to the end of the
load. The failure time is the kill time a drill's fault marker recorded (then `planned`), or else the last sign
of life in the run dir (the newest write to metrics.jsonl / events.jsonl), which bounds it from below. Every
successful resume records a `resume` event (`from_step`). A restart goes on from a checkpoint the job committed
(`record_job_start`), else repeats the first start's request. The drill hook (ckpt/fault.py) is armed from the
environment; without its variables it costs nothing.

Checkpoint requests (Slurm's time limit, launch/slurm.py): the batch shell's USR1 trap creates
RUN_DIR/checkpoint.request, waits until it is gone, then runs `scontrol requeue`, which ends this allocation.
Rank 0 looks for the file every step; the ranks agree on it like on a preemption signal; the step is saved
blocking, rank 0 deletes the file once the save is committed, and the loop then stops (`preempt_requested`):
steps after the checkpoint would be lost to the requeue anyway. A failed save keeps the file, so the next
agreed step tries again until the trap's deadline.

Failures: every failed save goes to the trainer's metrics logger as {"event": "checkpoint_failed", "step",
"error"} (rank 0), which fans it to the alert engine (observe/alerts.py); the next good save sends
{"event": "checkpoint_saved"} to resolve the alert. After `checkpoint.max_consecutive_failures` failed saves
in a row the run stops with CheckpointSaveError (exit 1): training on without a way back is worse.

Lineage: each checkpoint carries lineage.json (ckpt/provenance.py); on local storage rank 0 indexes it in the
run registry after the commit (`leantrain runs RUN_DIR`)."""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from pathlib import Path
from typing import Any

import leantrain.ckpt.integrity as integ
import leantrain.ckpt.memory_tier as fast_tier
from leantrain.ckpt.attempt import JobAttempt, agree_job_attempt, own_good_steps, steps_before_job
from leantrain.ckpt.control import checkpoint_requested, clear_checkpoint_request
from leantrain.ckpt.dcp_io import apply_state_dict, build_state_dict
from leantrain.ckpt.errors import CheckpointLoadError
from leantrain.ckpt.fault import FaultInjector, FaultPlan, read_marker
from leantrain.ckpt.identity import MODEL_KEY, model_identity
from leantrain.ckpt.manager import CheckpointManager, CheckpointSaveError
from leantrain.ckpt.provenance import CheckpointProvenance
from leantrain.ckpt.resume import (
    SCHEDULE_KEY,
    ResumeRequest,
    changed_schedule_message,
    finished_message,
    same_store,
    schedule_changes,
    schedule_settings,
    source_location,
)
from leantrain.ckpt.rng import RankRNGState
from leantrain.ckpt.storage import LocalStore
from leantrain.ckpt.watchdog import HangWatchdog, read_hangs, under_elastic_agent

log = logging.getLogger("leantrain.ckpt")
COUNTERS = ("step", "tokens_seen", "skipped_steps")
LIFE_SIGN_FILES = ("metrics.jsonl", "events.jsonl")


def last_sign_of_life_s(run_dir: Path) -> float | None:
    """Wall time of the run dir's newest metrics/events write: a failed attempt was alive until then."""
    times = [p.stat().st_mtime for p in (Path(run_dir) / n for n in LIFE_SIGN_FILES) if p.is_file()]
    return max(times) if times else None


def restart_cause(*, hangs: bool, planned: bool, membership_change: bool) -> str:
    """A restart event's cause: the earlier attempt's hang records first, then a drill's kill, then a change of
    the rendezvous with no failure counted; otherwise a worker failed."""
    return ("hang" if hangs else "drill" if planned else "membership change" if membership_change
            else "worker failure")


class _Counters:
    """The trainer's loop counters as a Stateful, so they load straight back into its attributes."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, int]:
        return {name: int(getattr(self.trainer, name)) for name in COUNTERS if hasattr(self.trainer, name)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name, value in state.items():
            setattr(self.trainer, name, int(value))


class TrainerCheckpointer:
    """Saves on the spec's interval (or when preempted, or at the last step) and resumes at start-up."""

    def __init__(self, trainer: Any, *, resume: ResumeRequest | None = None, attempt: JobAttempt | None = None,
                 **manager_options: Any) -> None:
        """`attempt`: the job's agreed attempt (train/command.py's job_attempt); None agrees on it here, for
        callers that build a trainer themselves (tests, the rehearsal)."""
        self.started_s = time.time()
        self.resume = resume or ResumeRequest()
        self.finished = False  # the run had reached its last step already (nothing to train)
        # Read before the manager writes anything: after a restart this is the dead attempt's last write.
        last_alive_s = last_sign_of_life_s(trainer.run_dir)
        self.provenance: CheckpointProvenance | None = None
        if "extra_files" not in manager_options:
            manager_options["extra_files"] = self._lineage_files
        self.manager = CheckpointManager(
            trainer.spec, run_dir=trainer.run_dir, rank=trainer.runtime.rank, world_size=trainer.runtime.world_size,
            **manager_options,
        )
        job = attempt if attempt is not None else agree_job_attempt(self.manager.highest)
        self.attempt, self.membership_change = job.number, job.membership_change
        self.last_alive_s = last_alive_s if self.attempt > 0 else None
        store = self.manager.store
        self.provenance = CheckpointProvenance(
            run_dir=trainer.run_dir, registry=trainer.spec.run.registry, describe=store.describe,
            local_root=store.root if isinstance(store, LocalStore) else None,
        )
        if self.manager.rank == 0:
            self.manager.after_commit = self.provenance.register
        self.schedule = schedule_settings(trainer.spec, max_steps=int(getattr(trainer, "max_steps", 0) or 0))
        self.manager.model_identity = model_identity(trainer.spec)
        self.manager.manifest_extra = lambda _step: {SCHEDULE_KEY: self.schedule,
                                                     MODEL_KEY: self.manager.model_identity}
        self.metrics = getattr(trainer, "metrics", None)  # the trainer's logger: its sinks include the alert engine
        self.max_consecutive_failures = trainer.spec.checkpoint.max_consecutive_failures
        self.num_consecutive_failures = 0
        self.last_error: CheckpointSaveError | None = None
        self.fatal_error: CheckpointSaveError | None = None  # the max_consecutive_failures stop, once raised
        self._seen_saved_step: int | None = None
        self.stop_reason: str | None = None  # why the loop should stop: "preempted" or "checkpoint requested"
        plan = FaultPlan.from_env()
        self.fault = None if plan is None else FaultInjector(plan, run_dir=trainer.run_dir, rank=trainer.runtime.rank,
                                                             attempt=self.attempt)
        self.memory = _memory_tier(trainer, self.manager)
        if self.fault is not None and self.memory is not None:
            self.fault.node_files = self.memory.node_folders()
        fault = trainer.spec.fault
        self.watchdog = HangWatchdog(
            timeout_s=trainer.spec.monitoring.hang_timeout_s, run_dir=trainer.run_dir, rank=trainer.runtime.rank,
            attempt=self.attempt,
        ).start() if fault.auto_restart and fault.hang_action == "abort" and under_elastic_agent() else None

    def app_state(self, trainer: Any) -> dict[str, Any]:
        return {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            "scheduler": trainer.scheduler,
            "train": _Counters(trainer),
            "sampler": trainer.sampler,
            "rng": RankRNGState(trainer.runtime.rank),
        }

    def _lineage_files(self, step: int) -> dict[str, bytes]:
        return self.provenance.files(step) if self.provenance is not None else {}

    def load_latest(self, trainer: Any) -> bool:
        """Resume as `--resume` asks (ckpt/resume.py); a restarted worker resumes this run's newest checkpoint.
        A restart before this run saved one (a usable durable checkpoint or a fast-tier snapshot; a save cut
        short does not count) repeats the first attempt's request: it resumes (or takes the weights of) the other
        run's checkpoint again, or is refused again, never starts over silently."""
        request = self.resume
        if not self.attempt:  # the job's first start: what is there now is not the job's own (restarts below)
            self._first_start(request)
        if self.attempt > 0 and self._restart_has_own_state():  # the first attempt chose; a restart goes on
            request = ResumeRequest(extend_schedule=request.extend_schedule)  # (its newest may predate the new one)
        step = self._load_weights(trainer, request) if request.weights_only else self._load_full(trainer, request)
        self._seen_saved_step = self.manager.last_saved_step
        if step is not None and not request.weights_only:
            self.manager.events.emit("resume", from_step=step, world_size=trainer.runtime.world_size,
                                     attempt=self.attempt, folder=self.manager.loaded_from)
            self._say(trainer, f"resuming from step {step}, checkpoint {self.manager.loaded_from}")
            if int(trainer.step) >= int(getattr(trainer, "max_steps", 0) or 0) > 0:
                self.finished = True
                self._say(trainer, finished_message(trainer.run_dir, step=step, where=self.manager.loaded_from))
        if self.attempt > 0:
            self._record_restart(resumed_from=step)
        return step is not None

    def _load_full(self, trainer: Any, request: ResumeRequest) -> int | None:
        source, step = None, request.step
        if request.mode == "path":
            source, step = source_location(trainer.spec, str(request.path))
            if same_store(source, self.manager.store):
                source = None
        own_steps = self._own_steps() if request.mode == "none" or source is not None else []  # refused again
        if own_steps:
            what = "--resume none starts over" if request.mode == "none" else f"--resume {request.path} is another run"
            raise CheckpointLoadError(
                f"{what}, but {self.manager.store.url} already holds this run's checkpoints (steps "
                f"{', '.join(map(str, own_steps))}), which its saves would overwrite: use a new --run-dir (and a "
                "new checkpoint.url when it is set), or move them away", user_input=True)
        if request.mode == "none":
            return None
        extend = request.extend_schedule

        def check(entry: Any, manifest: dict) -> str | None:
            changes = schedule_changes(manifest.get(SCHEDULE_KEY), self.schedule)
            if not changes:
                return None
            if extend:
                self.manager.events.emit("schedule_extended", step=entry.step, changes=changes)
                return None
            where = (source or self.manager.store).describe(entry.name)
            return changed_schedule_message(trainer.run_dir, step=entry.step, where=where, changes=changes)

        trains = self.schedule["max_steps"] > 0  # `--max-steps 0` only builds and loads: no schedule to keep
        if self.memory is not None and request.mode in ("auto", "latest") and source is None:
            fast = self._load_memory(trainer, check=check if trains else None)
            if fast is not None:
                return fast
        loaded = self.manager.load_latest(self.app_state(trainer), step=step, source=source,
                                          check=check if trains else None)
        if loaded is None and request.mode in ("latest", "path"):
            where = (source or self.manager.store).url
            raise CheckpointLoadError(f"--resume {request.path or request.mode}: no checkpoint in {where}",
                                      user_input=True)
        if loaded is not None and extend:
            _apply_new_lr(trainer)
        return loaded

    def _load_weights(self, trainer: Any, request: ResumeRequest) -> int | None:
        """--weights-only: the model's weights from another run's checkpoint; None (this run starts at step 0)."""
        source, step = source_location(trainer.spec, str(request.path))
        own_steps = self._own_steps()
        if same_store(source, self.manager.store) or own_steps:
            raise CheckpointLoadError(
                f"--weights-only starts a new run, but {self.manager.store.url} holds checkpoints (steps "
                f"{', '.join(map(str, own_steps)) or 'the source itself'}): use a new --run-dir", user_input=True)
        loaded = self.manager.load_latest({"model": trainer.model}, step=step, source=source)
        if loaded is None:
            raise CheckpointLoadError(f"--resume {request.path} --weights-only: no checkpoint in {source.url}",
                                      user_input=True)
        self.manager.events.emit("weights_loaded", from_step=loaded, folder=self.manager.loaded_from)
        self._say(trainer, f"starting a new run from the weights of step {loaded}, checkpoint "
                           f"{self.manager.loaded_from}")
        return None

    def _maybe_save_memory(self, trainer: Any, step: int, *, durable_started: bool) -> None:
        """The fast tier every memory_interval_steps, not on a step the durable tier saves. Decided from what
        every rank knows the same on the main thread (the step, the agreed save decision, the agreed stop),
        never from `last_saved_step`, which an async save's thread sets at its own time."""
        interval = trainer.spec.checkpoint.memory_interval_steps
        if self.memory is None or step % interval or durable_started or self.stop_reason:
            return
        start = time.perf_counter()
        with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
            outcome = self.memory.save(step, build_state_dict(self.app_state(trainer)),
                                       meta={SCHEDULE_KEY: self.schedule})
        if outcome.ok:
            self.manager.events.emit("memory_checkpoint_saved", step=step, bytes=outcome.num_bytes,
                                     duration_s=time.perf_counter() - start, peer=self.memory.peer)
            return
        self.manager.events.emit("memory_checkpoint_failed", step=step, failed_ranks=outcome.failed_ranks,
                                 error=outcome.error, action="the job goes on with the durable tier")
        if self.memory.disabled:
            self.memory = None

    def _load_memory(self, trainer: Any, *, check: Any) -> int | None:
        """Resume from the fast tier when its newest complete step is newer than the durable tier's newest."""
        assert self.memory is not None
        fast = self.memory.best_step()
        durable = [e.step for e in integ.list_steps(self.manager.store) if e.good_candidate] \
            if self.manager.rank == 0 else None
        durable = self.manager.agree(durable)
        if fast is None or (durable and fast <= durable[-1]):
            return None
        start = time.perf_counter()
        app_state = self.app_state(trainer)
        entry = integ.StepEntry(step=fast, name=f"memory step {fast}", committed=True, corrupt=False)
        filled = self.memory.load(fast, build_state_dict(app_state),
                                  check=None if check is None else lambda meta: check(entry, meta))
        if filled is None:
            self.manager.events.emit("checkpoint_invalid", step=fast, reason="fast tier incomplete", tier="memory")
            return None
        if "refusal" in filled:
            raise CheckpointLoadError(filled["refusal"], user_input=True)
        apply_state_dict(app_state, filled)
        self.manager.loaded_from = f"memory tier {self.memory.root} (step {fast})"
        self.manager.events.emit("checkpoint_loaded", step=fast, tier="memory", duration_s=time.perf_counter() - start,
                                 durable_step=durable[-1] if durable else None, folder=self.manager.loaded_from)
        return fast

    def _first_start(self, request: ResumeRequest) -> None:  # the run's snapshots are not the job's own
        if self.memory is not None and (request.weights_only or request.mode not in ("auto", "latest")):
            self.memory.clear()

    def _restart_has_own_state(self) -> bool:
        """Whether this job has state of its own to go on from: a committed, uncondemned checkpoint it saved
        (agreed), else a snapshot in the fast tier every rank can restore (agreed by `best_step`)."""
        good = own_good_steps(self.manager.store, self.manager.run_dir) if self.manager.rank == 0 else None
        if self.manager.agree(good):
            return True
        return self.memory is not None and self.memory.best_step() is not None

    def _own_steps(self) -> list[int]:
        """The run's step folders a first start will not overwrite; on a restart the good checkpoints older than
        the job (its own, and its saves cut short, it goes on over)."""
        store, older = self.manager.store, self.attempt > 0
        steps = (steps_before_job(store, self.manager.run_dir) if older else [e.step for e in integ.list_steps(store)]
                 ) if self.manager.rank == 0 else None
        return list(self.manager.agree(steps))

    def _say(self, trainer: Any, line: str) -> None:
        if self.manager.rank != 0:
            return
        log.info("%s", line)
        console = getattr(trainer, "console", None)
        if console is not None:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _record_restart(self, *, resumed_from: int | None) -> None:
        """The `restart` event of a worker group torchrun restarted (rank 0 reads the records and writes it)."""
        if self.manager.rank != 0:
            return
        marker = read_marker(self.manager.run_dir)
        planned = marker is not None and int(marker.get("attempt", -1)) == self.attempt - 1
        failed_at = float(marker["time"]) if planned and marker else self.last_alive_s
        hangs = read_hangs(self.manager.run_dir, attempt=self.attempt - 1)
        last_steps = [float(h["last_step_time"]) for h in hangs if h.get("last_step_time") is not None]
        if last_steps:  # lost: from the last step, not the abort
            failed_at = min(min(last_steps), failed_at or math.inf)
        recovery_s = None if failed_at is None else max(0.0, time.time() - failed_at)
        aborted = sorted({int(h["rank"]) for h in hangs})
        hang_fields = {} if not hangs else {
            "hang_ranks": aborted, "last_step": max(int(h.get("last_step") or 0) for h in hangs),
            "frozen_ranks": sorted(set(range(self.manager.world_size)) - set(aborted))}
        self.manager.events.emit(
            "restart", attempt=self.attempt, resumed_from=resumed_from, recovery_s=recovery_s, planned=planned,
            cause=restart_cause(hangs=bool(hangs), planned=planned, membership_change=self.membership_change),
            host=socket.gethostname(),
            killed_step=marker.get("step") if planned and marker else None,
            startup_s=time.time() - self.started_s, **hang_fields,
        )
        if self.manager.rank == 0:
            log.warning("restart %d: resumed from step %s, %s s after the failure", self.attempt, resumed_from,
                        "?" if recovery_s is None else f"{recovery_s:.1f}")

    def maybe_save(self, trainer: Any, *, force: bool = False) -> None:
        """`force` (the last step) saves blocking unless this step is saved already; `force` must agree on ranks.

        Raises CheckpointSaveError (exit 1) once `checkpoint.max_consecutive_failures` saves failed in a row."""
        step = int(trainer.step)
        asked = self.manager.rank == 0 and checkpoint_requested(self.manager.run_dir)
        due = self.manager.should_save(step, requested=asked)
        requested = self.manager.save_requested
        drill_save = self.fault is not None and self.fault.forced_save_step == step
        durable_started = bool(due or drill_save or (force and step != self.manager.last_saved_step))
        if durable_started:
            if self.fault is not None:
                self.fault.before_save(step, self.manager)
            try:
                with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
                    self.manager.save(step, self.app_state(trainer), blocking=True if force or requested else None)
            except CheckpointSaveError as err:  # already in events.jsonl; the alert engine hears of it below
                self._save_failed(err)
        if requested:
            self._serve_request(step)
        self._maybe_save_memory(trainer, step, durable_started=durable_started)
        if force and self.memory is not None and self.manager.last_saved_step == step:
            self.memory.clear()  # the run's end is durable: give the node's memory back
        self._note_saves()
        if self.watchdog is not None:
            self.watchdog.tick(step)
        if self.fault is not None:
            self.fault.after_step(step, self.manager)

    def _serve_request(self, step: int) -> None:
        """After the requested save: once this step is committed, rank 0 deletes the request, and the loop
        stops (the batch shell requeues the job when the file is gone)."""
        try:
            self.manager.wait()  # the step may have been saved asynchronously just before the request
        except CheckpointSaveError as err:
            self._save_failed(err)
        if self.manager.last_saved_step != step:
            return  # failed: the request stays, the next agreed step tries again
        if self.manager.rank == 0:
            clear_checkpoint_request(self.manager.run_dir)
            self.manager.events.emit("checkpoint_request_done", step=step, action="stop; the job requeues itself")
        self.stop_reason = "checkpoint requested"

    def _save_failed(self, err: CheckpointSaveError) -> None:
        self.last_error = err
        self.num_consecutive_failures += 1
        log.error("%s", err)
        self._alert({"event": "checkpoint_failed", "step": err.step, "error": str(err),
                     "consecutive_failures": self.num_consecutive_failures})
        if self.num_consecutive_failures >= self.max_consecutive_failures:
            newest = self._seen_saved_step
            self.fatal_error = CheckpointSaveError(
                err.step, f"{self.num_consecutive_failures} saves in a row failed "
                f"(checkpoint.max_consecutive_failures={self.max_consecutive_failures}), so the run stops rather "
                "than train on without a checkpoint to come back to ("
                + ("none was saved yet" if newest is None else f"the newest good one is step {newest}")
                + f"). Last error: {err}", where=f"run dir {self.manager.run_dir}")
            raise self.fatal_error from err

    def _note_saves(self) -> None:
        """A newly committed save (async ones finish later) resets the failure count and resolves the alert."""
        saved = self.manager.last_saved_step
        if saved is None or saved == self._seen_saved_step:
            return
        self._seen_saved_step = saved
        if self.num_consecutive_failures:
            self.num_consecutive_failures = 0
            self._alert({"event": "checkpoint_saved", "step": saved})

    def _alert(self, record: dict[str, Any]) -> None:
        """Rank 0: through the trainer's metrics logger, whose sinks include the alert engine."""
        if self.manager.rank != 0 or self.metrics is None:
            return
        try:
            self.metrics.log(record)
        except Exception as err:  # noqa: BLE001 - a broken sink must not turn an alert into a crash
            log.warning("could not report %s: %s", record.get("event"), err)

    @property
    def stop_signal(self) -> str | None:
        """The signal this process received when the loop stopped on one (SIGINT, SIGTERM, ...), else None."""
        return self.manager.preemption.received if self.stop_reason == "preempted" else None

    @property
    def preempt_requested(self) -> bool:
        """True once the loop should stop after this step's save: an agreed preemption signal, or a served
        checkpoint request (the job is about to be requeued)."""
        if self.manager.preempt_requested and self.stop_reason is None:
            self.stop_reason = "preempted"
        return self.stop_reason is not None

    def close(self) -> None:
        """Finish a pending save. When the run already stopped on `max_consecutive_failures`, that reason is
        kept: the pending save's own failure is logged and counted, not raised over it."""
        if self.watchdog is not None:
            self.watchdog.stop()
        try:
            self.manager.close()
        except CheckpointSaveError as err:
            if self.fatal_error is None:
                raise
            log.error("after the run stopped: %s", err)
        finally:
            self._note_saves()


def _apply_new_lr(trainer: Any) -> None:
    """--extend-schedule: the loaded scheduler keeps the old peak LR in base_lrs; scale it to the spec's."""
    scheduler = getattr(trainer, "scheduler", None)
    saved = getattr(scheduler, "base_lrs", None)
    new_lr = trainer.spec.training.lr
    if not saved or not getattr(scheduler, "lr_lambdas", None):
        return
    ratio = new_lr / max(max(saved), 1e-30)
    scheduler.base_lrs = [lr * ratio for lr in saved]


def _memory_tier(trainer: Any, manager: CheckpointManager) -> fast_tier.MemoryTier | None:
    """The fast tier when checkpoint.memory_interval_steps is set (its own gloo group: saves may overlap an
    async durable save on the manager's groups)."""
    import os

    import torch.distributed as dist

    from leantrain.parallel.comm import control_backend

    ck = trainer.spec.checkpoint
    if ck.memory_interval_steps is None:
        return None
    world = int(trainer.runtime.world_size)
    group = dist.new_group(backend=control_backend()) if world > 1 and dist.is_initialized() else None
    if group is not None:
        manager.adopt_group(group)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    offset = ck.memory_peer_offset or local_ranks
    layout = f"world {world} {trainer.spec.parallelism.model_dump_json()}"  # what a shard is a piece of
    fast_tier.forget_other_layouts(root := fast_tier.memory_root(ck.memory_dir, trainer.run_dir, layout=layout))
    tier = fast_tier.MemoryTier(root=root, rank=int(trainer.runtime.rank), world_size=world, peer_offset=offset,
                      process_group=group)
    # Sized before the first step, on every rank, and agreed: the tier is on everywhere or nowhere.
    shard_bytes = fast_tier.estimate_shard_bytes(trainer.model)
    problem = fast_tier.capacity_problem(ck.memory_dir, shard_bytes=shard_bytes, local_ranks=min(local_ranks, world))
    short = tier.agree_failures(problem)
    if short:
        reason = problem or f"checkpoint.memory_dir {ck.memory_dir} is too small on rank(s) {short}"
        manager.events.emit("memory_tier_disabled", reason=reason, ranks=short, shard_bytes=shard_bytes)
        if manager.rank == 0:
            log.warning("fast tier off: %s; the job uses the durable tier only", reason)
        return None
    return tier
