"""The checkpoint manager the trainer calls: when to save, save (sync/async), resume from the newest good one.

    ckpt = CheckpointManager(spec, run_dir=run_dir, rank=rank, world_size=world_size)
    start = ckpt.load_latest(app_state) or 0          # every rank; None when there is no good checkpoint
    for step in range(start + 1, max_steps + 1):
        train_step(...)
        if ckpt.should_save(step):                    # every rank, every step: ranks agree on the answer
            try:
                ckpt.save(step, app_state)
            except CheckpointSaveError as err:        # the run stays alive; previous checkpoints are intact
                alert(err)
        if ckpt.preempt_requested:                    # SIGTERM/SIGUSR1: the save above was blocking
            break
    ckpt.close()

Collectives: with a process group, the manager makes two gloo groups of its own (all ranks must construct it
together): one for saves, which may run in a background thread (DCP's thread async save hangs on the default
group, docs/checkpoints.md), and one for the main thread's agreement on preemption and on which checkpoint
to load, so the two never interleave on one group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import leantrain.ckpt.integrity as integ
from leantrain.ckpt.crypto import ChunkCipher, parse_key
from leantrain.ckpt.dcp_io import (
    SealedFileSystem,
    build_state_dict,
    save_state,
    stage_to_cpu,
    write_sealed,
)
from leantrain.ckpt.errors import CheckpointLoadError, CheckpointSaveError, one_line
from leantrain.ckpt.events import AlertCallback, EventLog
from leantrain.ckpt.loading import ResumeCheck
from leantrain.ckpt.loading import load as load_checkpoint
from leantrain.ckpt.policy import AutoInterval, PreemptionHandler, job_mtbf_s, planned_auto_interval
from leantrain.ckpt.storage import Store, open_store
from leantrain.parallel.comm import control_backend
from leantrain.rank0 import from_rank0
from leantrain.security import AuditLog
from leantrain.spec import resolve_secret

if TYPE_CHECKING:
    from leantrain.spec import JobSpec

__all__ = ["CheckpointLoadError", "CheckpointManager", "CheckpointSaveError"]
log = logging.getLogger("leantrain.ckpt")
SAVE_GROUP_TIMEOUT_S = 1800.0
T = TypeVar("T")


class _AgreedFailure(OSError):
    """Rank 0's storage failure (already one line, naming the location), which every rank raises."""


class CheckpointManager:
    """Interval, save, commit, retention, resume point and preemption for one training process."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        run_dir: str | Path,
        rank: int = 0,
        world_size: int = 1,
        process_group: dist.ProcessGroup | None = None,
        store: Store | None = None,
        on_alert: AlertCallback | None = None,
        extra_files: Callable[[int], dict[str, bytes]] | None = None,
        expected_save_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.run_dir = Path(run_dir)
        self.store = store if store is not None else open_store(spec, run_dir=run_dir)
        self.cipher = _make_cipher(spec)
        audit = AuditLog(self.run_dir / "audit.log", spec=spec).append if spec.security.audit_log else None
        self.events = EventLog(self.run_dir / "events.jsonl" if rank == 0 else None, on_alert=on_alert, audit=audit)
        self.extra_files = extra_files
        self.clock = clock
        self._fs = SealedFileSystem(self.store, cipher=self.cipher)
        self._own_groups: list[dist.ProcessGroup] = []
        self._save_pg = self._control_pg = None
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            # Saves wait at their collectives for the slowest writer: at least SAVE_GROUP_TIMEOUT_S, not the
            # (short) fault.collective_timeout_s that the main thread's agreement group gets.
            save_timeout_s = max(spec.fault.collective_timeout_s, SAVE_GROUP_TIMEOUT_S)
            self._save_pg = process_group or self._new_group(ranks, timeout_s=save_timeout_s)
            self._control_pg = self._new_group(ranks, timeout_s=spec.fault.collective_timeout_s)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._pending: Future | None = None
        # Called with the step after this rank's files are written and before the commit (the fault drill's
        # mid-save kill: the checkpoint is then half-written on disk, deterministically).
        self.before_commit: Callable[[int], None] | None = None
        # Rank 0, with the step and the point inside the commit ("before_marker": manifest written, no COMMIT;
        # "before_retention": published, retention not run): the drill's kill inside the commit.
        self.commit_point: Callable[[int, str], None] | None = None
        # Rank 0, with the step and the published folder, after a commit (from the saving thread when async):
        # e.g. indexing the checkpoint in the run registry. Its errors are logged, never fail the save.
        self.after_commit: Callable[[int, str], None] | None = None
        self.loaded_step: int | None = None  # the checkpoint this run resumed from: its timeline is ours
        self.loaded_from: str | None = None  # where the loaded checkpoint is (also another store's)
        # Rank 0, with the step: more fields for the manifest (e.g. the schedule settings ckpt/resume.py checks).
        self.manifest_extra: Callable[[int], dict[str, Any]] | None = None
        # This run's model (ckpt/identity.py): a checkpoint whose manifest names another is skipped on load.
        self.model_identity: dict[str, Any] | None = None
        # Folders the load found not to be this run's (misnamed, another model): never counted, condemned or
        # deleted; a save of the same step moves such a folder aside instead of replacing it.
        self.foreign: dict[str, str] = {}
        self.save_requested = False  # the ranks agreed on an outside request (should_save's `requested`)
        self.last_saved_step: int | None = None
        self._committed_step: int | None = None  # rank 0: the step whose commit marker this process wrote last
        self._last_attempted_step: int | None = None
        self._last_save_clock = clock()
        ck = spec.checkpoint
        self.interval_steps = ck.interval_steps if isinstance(ck.interval_steps, int) else None
        self.auto: AutoInterval | None = None
        if self.interval_steps is None:
            self.auto = (
                AutoInterval(initial_save_s=expected_save_s, mtbf_s=job_mtbf_s(
                    failures_per_gpu_day=spec.fault.failures_per_gpu_day, num_gpus=world_size))
                if expected_save_s is not None else planned_auto_interval(spec, world_size=world_size)
            )
            self.events.emit("checkpoint_interval", interval_s=self.auto.interval_s, save_s=self.auto.save_s,
                             mtbf_s=self.auto.mtbf_s)
        self.preemption = PreemptionHandler(spec.fault.preempt_signals)
        self.preempt_requested = False

    def _new_group(self, ranks: list[int] | None, *, timeout_s: float) -> dist.ProcessGroup:
        group = dist.new_group(ranks=ranks, backend=control_backend(), timeout=timedelta(seconds=timeout_s))
        self._own_groups.append(group)
        return group

    # ---- when -------------------------------------------------------------------------------------------
    def should_save(self, step: int, *, requested: bool = False) -> bool:
        """Whether to save after `step`; call on every rank every step (it may run one tiny all-reduce).

        `requested`: this rank saw an outside request for a checkpoint now (Slurm's time-limit request file).
        It is agreed like a preemption signal (any rank → all ranks, on the same step); `save_requested`
        then holds the agreed answer, and the step is saved unless it is saved or being saved already.
        """
        fresh = step != self._last_attempted_step and step != self.last_saved_step
        if self.interval_steps is not None:
            want = fresh and step % self.interval_steps == 0
        else:
            assert self.auto is not None
            want = fresh and self.clock() - self._last_save_clock >= self.auto.interval_s
        preempt = self.preemption.received is not None
        if self._control_pg is not None:
            # Ranks see a signal at different steps and time-based decisions differ per rank: agree on both,
            # on the check steps only (a world-wide all-reduce every step costs 0.1-0.4 s at thousands of ranks).
            # A time-based save is therefore taken on the first check step after its interval has passed.
            if step % self.spec.fault.preempt_check_every == 0:
                flags = torch.tensor([int(preempt), int(want), int(requested)], dtype=torch.int32)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control_pg)
                preempt, want, requested = bool(flags[0]), bool(flags[1]), bool(flags[2])
            else:
                preempt = requested = False
                if self.auto is not None:
                    want = False
        if preempt and not self.preempt_requested:
            self.preempt_requested = True
            self.events.emit("preemption_requested", step=step, signal=self.preemption.received or "another rank")
        self.save_requested = requested
        if requested:
            self.events.emit("checkpoint_requested", step=step, already_saved=not fresh)
        return fresh and (want or preempt or requested)

    # ---- save -------------------------------------------------------------------------------------------
    def save(self, step: int, app_state: dict[str, Any], *, blocking: bool | None = None) -> None:
        """Save `app_state` as step `step` (all ranks). Async unless `blocking` or preempted.

        Raises CheckpointSaveError for a failed blocking save, or for the previous async save when it failed
        (the new save has been started by then).
        """
        blocking = (not self.spec.checkpoint.async_save) if blocking is None else blocking
        blocking = blocking or self.preempt_requested
        previous_error = self._join_pending()
        self._last_attempted_step = step
        start = self.clock()
        state = build_state_dict(app_state)
        if blocking:
            try:
                self._save_now(step, state, start=start, stall_s=None)
            except CheckpointSaveError as err:
                raise err from previous_error
        else:
            staged = stage_to_cpu(state)
            stall_s = self.clock() - start
            self._pending = self._executor.submit(self._save_now, step, staged, start=start, stall_s=stall_s)
        self._last_save_clock = self.clock()
        if previous_error is not None:
            raise previous_error

    def wait(self) -> None:
        """Block until an async save has committed; raise CheckpointSaveError if it failed."""
        error = self._join_pending()
        if error is not None:
            raise error

    def _join_pending(self) -> CheckpointSaveError | None:
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except CheckpointSaveError as err:
            return err
        return None

    def _save_now(self, step: int, state: dict[str, Any], *, start: float, stall_s: float | None) -> None:
        """One save with `checkpoint.save_retries` retries after `retry_backoff_s`, doubling (all ranks fail
        and retry together: every failure below is agreed), and no retry that would start after
        `checkpoint.save_timeout_s` (rank 0's clock decides for all). Only the last failure is
        `checkpoint_failed`."""
        ck = self.spec.checkpoint
        for attempt in range(ck.save_retries + 1):
            try:
                self._save_once(step, state, start=start, stall_s=stall_s)
                return
            except CheckpointSaveError as err:
                wait_s = ck.retry_backoff_s * 2**attempt
                in_time = self._agree(self.clock() - start + wait_s < ck.save_timeout_s, self._save_pg)
                if attempt == ck.save_retries or not in_time:
                    timed_out = {} if in_time else {"save_timeout_s": ck.save_timeout_s}
                    self.events.emit("checkpoint_failed", step=step, error=str(err), operation=err.operation,
                                     attempts=attempt + 1, duration_s=self.clock() - start, **timed_out)
                    raise
                self.events.emit("checkpoint_retry", step=step, error=str(err), operation=err.operation,
                                 attempt=attempt + 1, wait_s=wait_s)
                time.sleep(wait_s)

    def _save_once(self, step: int, state: dict[str, Any], *, start: float, stall_s: float | None) -> None:
        folder = integ.tmp_dir(step) if self.store.supports_rename else integ.step_dir(step)
        is_async = stall_s is not None
        operation = "prepare"
        try:
            skip = self._agree(self._prepare_folder(step, folder) if self.rank == 0 else None, self._save_pg)
            if skip == "exists":
                self.events.emit("checkpoint_skipped", step=step, reason="a good checkpoint of this step exists")
                self.last_saved_step = step
                return
            if skip:
                raise _AgreedFailure(skip)
            self.events.emit("checkpoint_save_started", step=step, folder=self.store.describe(folder),
                             **{"async": is_async})
            operation = "write"
            written = save_state(state, fs=self._fs, folder=folder, process_group=self._save_pg)
            if self.before_commit is not None:
                self.before_commit(step)
            all_written = self._gather(written, self._save_pg)  # rank 0 writes the manifest of all of them
            operation = "commit"
            commit_error = self._commit(step, folder, all_written) if self.rank == 0 else None
            commit_error = self._agree(commit_error, self._save_pg)
            if commit_error:
                raise _AgreedFailure(commit_error)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - a failed save must leave the run alive
            log.error("checkpoint save of step %d failed (%s)", step, operation, exc_info=True)  # the rank log
            self._fs.abort_and_drain()  # DCP leaves sibling writer threads running after a failure
            if self.rank == 0:
                self._discard_attempt(step, folder)
            where = f"{self.store.describe(integ.step_dir(step))} (run dir {self.run_dir})"
            message = str(err) if isinstance(err, _AgreedFailure) else one_line(err)
            raise CheckpointSaveError(step, message, where=where, operation=operation) from err
        self._record_saved(step, all_written, start=start, stall_s=stall_s)

    def _record_saved(self, step: int, all_written: list[dict[str, integ.FileRecord]], *, start: float,
                      stall_s: float | None) -> None:
        duration_s = self.clock() - start
        self.last_saved_step = step
        if self.auto is not None:
            self.auto.observe(stall_s=duration_s if stall_s is None else stall_s, write_s=duration_s)
        num_bytes = sum(rec.num_bytes for files in all_written for rec in files.values())
        self.events.emit(
            "checkpoint_saved", step=step, bytes=num_bytes, duration_s=duration_s,
            stall_s=duration_s if stall_s is None else stall_s, mb_per_s=num_bytes / 1e6 / max(duration_s, 1e-9),
            **{"async": stall_s is not None}, path=self.store.describe(integ.step_dir(step)),
            next_interval_s=None if self.auto is None else self.auto.interval_s,
        )
        if self.rank == 0:
            if self.commit_point is not None:
                self.commit_point(step, "before_retention")
            self._apply_retention(committed_step=step)
            if self.after_commit is not None:
                try:
                    self.after_commit(step, integ.step_dir(step))
                except Exception as err:  # noqa: BLE001 - the checkpoint is committed; bookkeeping must not undo it
                    log.warning("after committing step %d: %s: %s", step, type(err).__name__, err)

    def _discard_attempt(self, step: int, folder: str) -> None:
        """Rank 0, after a failed save: remove the partial folder unless it got committed (object stores).
        Any storage error here (the store may be gone) is an event, never an escape from the failure path."""
        try:
            if not any(e.step == step and e.good_candidate for e in integ.list_steps(self.store)):
                self.store.remove_tree(folder)
        except Exception as err:  # noqa: BLE001 - botocore/fsspec errors are not OSErrors
            self.events.emit("checkpoint_delete_failed", folder=self.store.describe(folder),
                             operation="discard", error=one_line(err))

    def _prepare_folder(self, step: int, folder: str) -> str | None:
        """Rank 0: clear leftovers of an earlier attempt; 'exists' when this step is already committed by this
        timeline (the checkpoint this run resumed from, or saved itself). A good folder of this step that this
        run neither loaded nor wrote holds another timeline's state (the run resumed from an older step, or
        started over): it is replaced, since keeping it would resume the next restart onto that timeline."""
        try:
            for entry in integ.list_steps(self.store):
                if entry.name in self.foreign:
                    if entry.step == step:
                        aside = f"foreign-{entry.name}-{int(time.time())}"
                        self.store.rename(entry.name, aside)
                        self.events.emit("checkpoint_moved_aside", folder=self.store.describe(entry.name),
                                         to=self.store.describe(aside), reason=self.foreign.pop(entry.name))
                    continue
                if entry.step == step and entry.good_candidate and step in (
                        self.loaded_step, self.last_saved_step, self._committed_step):
                    if step == self._committed_step:  # a retry after a commit that failed once in place (its
                        self.store.sync_dir("")      # last fsync): that checkpoint is this save's, keep it
                    return "exists"
                if entry.step == step and entry.good_candidate:
                    integ.remove_checkpoint(self.store, entry.name)
                    self.events.emit("checkpoint_deleted", folder=entry.name,
                                     reason="another timeline's checkpoint of this step, replaced by this save")
                elif entry.step == step and not self.store.supports_rename:
                    # Condemned or never committed (a lost marker may hide good data): an object store writes
                    # in place, so it goes now; a filesystem keeps it until publish() replaces it with this
                    # save's committed folder, so a failed save leaves it as it was.
                    self.store.remove_tree(entry.name)
            self.store.remove_tree(folder)
            self.store.makedirs(folder)
        except Exception as err:  # noqa: BLE001 - any storage error: the save fails cleanly
            return f"preparing {self.store.describe(folder)}: {one_line(err)}"
        return None

    def _commit(self, step: int, folder: str, all_written: list[dict[str, integ.FileRecord]]) -> str | None:
        """Rank 0: extra files, manifest, commit marker, publish. Returns an error message instead of raising."""
        try:
            files = {name: rec for per_rank in all_written for name, rec in per_rank.items()}
            for name, data in (self.extra_files(step) if self.extra_files else {}).items():
                files[name] = write_sealed(self._fs, f"{folder}/{name}", data)  # encrypted like DCP's files
            manifest = integ.build_manifest(step=step, files=files, world_size=self.world_size, cipher=self.cipher,
                                            extra=self.manifest_extra(step) if self.manifest_extra else None)
            point = self.commit_point
            integ.write_commit(self.store, folder, manifest,
                               before_marker=None if point is None else lambda: point(step, "before_marker"))
            self._committed_step = step
            integ.publish(self.store, step=step)
        except Exception as err:  # noqa: BLE001 - any storage error: the save fails cleanly
            return f"committing {self.store.describe(folder)}: {one_line(err)}"
        return None

    def _apply_retention(self, *, committed_step: int) -> None:
        """After a commit; a storage error lists or deletes nothing more (an event, the save stands)."""
        try:
            tmp_names = [n for n in self.store.list_dir("") if integ.TMP_RE.match(n)]
            entries = [e for e in integ.list_steps(self.store) if e.name not in self.foreign]
            victims = integ.retention_victims(entries, keep_last=self.spec.checkpoint.keep_last,
                                              tmp_names=tmp_names, committed_step=committed_step)
        except Exception as err:  # noqa: BLE001 - any storage error
            self.events.emit("checkpoint_delete_failed", folder=self.store.url, operation="retention",
                             error=one_line(err))
            return
        for name, reason in victims:
            try:
                integ.remove_checkpoint(self.store, name)
                self.events.emit("checkpoint_deleted", folder=name, reason=reason)
            except Exception as err:  # noqa: BLE001 - any storage error
                self.events.emit("checkpoint_delete_failed", folder=name, operation="retention", error=one_line(err))

    # ---- load -------------------------------------------------------------------------------------------
    def load_latest(self, app_state: dict[str, Any], *, step: int | None = None, source: Store | None = None,
                    check: ResumeCheck | None = None) -> int | None:
        """Load the newest checkpoint that verifies, falling back to older ones; the step, or None when there
        is no checkpoint. Raises CheckpointLoadError (exit 2, nothing changed) when checkpoints exist and none
        is valid. `step`, `source`, `check`: see ckpt/loading.py."""
        self.wait()
        return load_checkpoint(self, app_state, step=step, source=source, check=check)

    # ---- the interface of the loader (loading.py) and the trainer's hook (hook.py) ----------------------
    def agree(self, value: Any) -> Any:
        """Rank 0's value on every rank, on the main thread's agreement group (all ranks call it together)."""
        return self._agree(value, self._control_pg)

    def highest(self, values: list[int]) -> list[int]:
        """The element-wise largest of every rank's `values`, on every rank, on the main thread's agreement group
        (all ranks call it together; a tensor all-reduce, no pickled objects)."""
        if self._control_pg is None:
            return list(values)
        return all_reduce_max(values, group=self._control_pg)

    def read_on_rank0(self, read: Callable[[], T]) -> T:
        """`read()` on rank 0 alone, its result on every rank, on the main thread's agreement group (all ranks
        call it together): one reader of the store's shared files (listing, manifest, DCP metadata)."""
        if self._control_pg is None:
            return read()
        return from_rank0(read, group=self._control_pg)

    @property
    def load_group(self) -> dist.ProcessGroup | None:
        """The group DCP loads on: the save group, whose timeout is the saves' (one slow shard read must not time
        every rank out and fall back a checkpoint)."""
        return self._save_pg

    @property
    def sealed_fs(self) -> SealedFileSystem:
        """The file system this store's checkpoints are written and read through (hashing, encryption)."""
        return self._fs

    def adopt_group(self, group: dist.ProcessGroup) -> None:
        """A group another checkpoint component made (the fast tier's): destroyed with the manager's own."""
        self._own_groups.append(group)

    # ---- collectives (no-ops in one process) ------------------------------------------------------------
    def _agree(self, value: Any, group: dist.ProcessGroup | None) -> Any:
        """Rank 0's value on every rank."""
        if group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def _gather(self, value: Any, group: dist.ProcessGroup | None) -> list[Any]:
        """Every rank's value on rank 0 (the one that commits), an empty list elsewhere."""
        if group is None:
            return [value]
        out: list[Any] | None = [None] * dist.get_world_size(group) if self.rank == 0 else None
        dist.gather_object(value, out, dst=dist.get_global_rank(group, 0), group=group)
        return out or []

    def close(self) -> None:
        """Finish a pending save, restore signal handlers, free the manager's groups. Raises a pending failure."""
        try:
            self.wait()
        finally:
            self.preemption.restore()
            self._executor.shutdown(wait=True)
            for group in self._own_groups:
                dist.destroy_process_group(group)
            self._own_groups.clear()


def all_reduce_max(values: list[int], *, group: Any = None, device: Any = None) -> list[int]:
    """The element-wise largest of every rank's `values`, on every rank of `group` (all call it together; one
    int64 tensor all-reduce, no pickled objects)."""
    box = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in box.tolist()]


def _make_cipher(spec: JobSpec) -> ChunkCipher | None:
    sec = spec.security
    if not sec.encrypt_checkpoints:
        return None
    ref = sec.encryption_key
    return ChunkCipher(parse_key(resolve_secret(ref) or "", var_name=f"security.encryption_key {ref}"))

