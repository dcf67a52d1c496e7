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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import leantrain.ckpt.integrity as integ
from leantrain.ckpt.crypto import ChunkCipher, parse_key
from leantrain.ckpt.dcp_io import (
    SealedFileSystem,
    apply_state_dict,
    build_state_dict,
    checkpoint_keys,
    load_state,
    save_state,
    stage_to_cpu,
    write_sealed,
)
from leantrain.ckpt.events import AlertCallback, EventLog
from leantrain.ckpt.policy import AutoInterval, PreemptionHandler, job_mtbf_s, planned_auto_interval
from leantrain.ckpt.storage import Store, open_store
from leantrain.errors import LeantrainError
from leantrain.security import AuditLog
from leantrain.spec import resolve_secret

if TYPE_CHECKING:
    from leantrain.spec import JobSpec

log = logging.getLogger("leantrain.ckpt")


class CheckpointSaveError(LeantrainError):
    """A save failed; earlier checkpoints are intact. The trainer alerts and keeps training, and stops (exit 1)
    after `checkpoint.max_consecutive_failures` failures in a row: the CLI shows the message, no traceback."""

    exit_code = 1

    def __init__(self, step: int, message: str, *, where: str | None = None) -> None:
        super().__init__(f"checkpoint save of step {step}{f' to {where}' if where else ''} failed: {message}")
        self.step = step


class CheckpointLoadError(LeantrainError):
    """No checkpoint could be resumed from and training must not start fresh: exit 1 when the stored
    checkpoints failed after the live state was partly overwritten, exit 2 when the user's input is wrong
    (the encryption key does not match the checkpoints)."""

    exit_code = 1

    def __init__(self, message: str, *, user_input: bool = False) -> None:
        super().__init__(message)
        if user_input:
            self.exit_code = 2


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
            self._save_pg = process_group or self._new_group(ranks)
            self._control_pg = self._new_group(ranks)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._pending: Future | None = None
        # Called with the step after this rank's files are written and before the commit (the fault drill's
        # mid-save kill: the checkpoint is then half-written on disk, deterministically).
        self.before_commit: Callable[[int], None] | None = None
        # Rank 0, with the step and the published folder, after a commit (from the saving thread when async):
        # e.g. indexing the checkpoint in the run registry. Its errors are logged, never fail the save.
        self.after_commit: Callable[[int, str], None] | None = None
        self.loaded_step: int | None = None  # the checkpoint this run resumed from: its timeline is ours
        self.save_requested = False  # the ranks agreed on an outside request (should_save's `requested`)
        self.last_saved_step: int | None = None
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

    def _new_group(self, ranks: list[int] | None) -> dist.ProcessGroup:
        group = dist.new_group(ranks=ranks, backend="gloo")
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
            # Ranks see a signal at different steps and time-based decisions differ per rank: agree on both.
            if self.auto is not None or step % self.spec.fault.preempt_check_every == 0:
                flags = torch.tensor([int(preempt), int(want), int(requested)], dtype=torch.int32)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control_pg)
                preempt, want, requested = bool(flags[0]), bool(flags[1]), bool(flags[2])
            else:
                preempt = requested = False
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
        folder = integ.tmp_dir(step) if self.store.supports_rename else integ.step_dir(step)
        is_async = stall_s is not None
        try:
            skip = self._agree(self._prepare_folder(step, folder) if self.rank == 0 else None, self._save_pg)
            if skip == "exists":
                self.events.emit("checkpoint_skipped", step=step, reason="a good checkpoint of this step exists")
                self.last_saved_step = step
                return
            if skip:
                raise OSError(skip)
            self.events.emit("checkpoint_save_started", step=step, folder=self.store.describe(folder),
                             **{"async": is_async})
            written = save_state(state, fs=self._fs, folder=folder, process_group=self._save_pg)
            if self.before_commit is not None:
                self.before_commit(step)
            all_written = self._gather(written, self._save_pg)
            commit_error = self._commit(step, folder, all_written) if self.rank == 0 else None
            commit_error = self._agree(commit_error, self._save_pg)
            if commit_error:
                raise OSError(commit_error)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - a failed save must leave the run alive
            self._fs.abort_and_drain()  # DCP leaves sibling writer threads running after a failure
            if self.rank == 0:
                self._discard_attempt(step, folder)
            message = f"{type(err).__name__}: {err}"
            self.events.emit("checkpoint_failed", step=step, error=message, duration_s=self.clock() - start)
            where = f"{self.store.describe(integ.step_dir(step))} (run dir {self.run_dir})"
            raise CheckpointSaveError(step, message, where=where) from err
        duration_s = self.clock() - start
        self.last_saved_step = step
        if self.auto is not None:
            self.auto.observe(stall_s=duration_s if stall_s is None else stall_s, write_s=duration_s)
        num_bytes = sum(rec.num_bytes for files in all_written for rec in files.values())
        self.events.emit(
            "checkpoint_saved", step=step, bytes=num_bytes, duration_s=duration_s,
            stall_s=duration_s if stall_s is None else stall_s, mb_per_s=num_bytes / 1e6 / max(duration_s, 1e-9),
            **{"async": is_async}, path=self.store.describe(integ.step_dir(step)),
            next_interval_s=None if self.auto is None else self.auto.interval_s,
        )
        if self.rank == 0:
            self._apply_retention(committed_step=step)
            if self.after_commit is not None:
                try:
                    self.after_commit(step, integ.step_dir(step))
                except Exception as err:  # noqa: BLE001 - the checkpoint is committed; bookkeeping must not undo it
                    log.warning("after committing step %d: %s: %s", step, type(err).__name__, err)

    def _discard_attempt(self, step: int, folder: str) -> None:
        """Rank 0, after a failed save: remove the partial folder unless it got committed (object stores)."""
        try:
            if not any(e.step == step and e.good_candidate for e in integ.list_steps(self.store)):
                self.store.remove_tree(folder)
        except OSError as err:
            self.events.emit("checkpoint_delete_failed", folder=folder, error=str(err))

    def _prepare_folder(self, step: int, folder: str) -> str | None:
        """Rank 0: clear leftovers of an earlier attempt; 'exists' when this step is already committed by this
        timeline (the checkpoint this run resumed from, or saved itself). A good folder of this step that this
        run neither loaded nor wrote holds another timeline's state (the run resumed from an older step, or
        started over): it is replaced, since keeping it would resume the next restart onto that timeline."""
        try:
            for entry in integ.list_steps(self.store):
                if entry.step == step and entry.good_candidate and step in (self.loaded_step, self.last_saved_step):
                    return "exists"
                if entry.step == step and entry.good_candidate:
                    integ.remove_checkpoint(self.store, entry.name)
                    self.events.emit("checkpoint_deleted", folder=entry.name,
                                     reason="another timeline's checkpoint of this step, replaced by this save")
                elif entry.step == step:  # condemned or never committed: nothing good is lost
                    self.store.remove_tree(entry.name)
            self.store.remove_tree(folder)
            self.store.makedirs(folder)
        except OSError as err:
            return f"preparing {folder}: {err}"
        return None

    def _commit(self, step: int, folder: str, all_written: list[dict[str, integ.FileRecord]]) -> str | None:
        """Rank 0: extra files, manifest, commit marker, publish. Returns an error message instead of raising."""
        try:
            files = {name: rec for per_rank in all_written for name, rec in per_rank.items()}
            for name, data in (self.extra_files(step) if self.extra_files else {}).items():
                files[name] = write_sealed(self._fs, f"{folder}/{name}", data)  # encrypted like DCP's files
            manifest = integ.build_manifest(step=step, files=files, world_size=self.world_size, cipher=self.cipher)
            integ.write_commit(self.store, folder, manifest)
            integ.publish(self.store, step=step)
        except OSError as err:
            return f"committing {folder}: {err}"
        return None

    def _apply_retention(self, *, committed_step: int) -> None:
        tmp_names = [n for n in self.store.list_dir("") if integ.TMP_RE.match(n)]
        victims = integ.retention_victims(integ.list_steps(self.store), keep_last=self.spec.checkpoint.keep_last,
                                          tmp_names=tmp_names, committed_step=committed_step)
        for name, reason in victims:
            try:
                integ.remove_checkpoint(self.store, name)
                self.events.emit("checkpoint_deleted", folder=name, reason=reason)
            except OSError as err:
                self.events.emit("checkpoint_delete_failed", folder=name, error=str(err))

    # ---- load -------------------------------------------------------------------------------------------
    def load_latest(self, app_state: dict[str, Any]) -> int | None:
        """Load the newest checkpoint that verifies, falling back to older ones; the step, or None."""
        self.wait()
        entries = integ.list_steps(self.store) if self.rank == 0 else None
        entries = self._agree(entries, self._control_pg)
        candidates = [e for e in entries if e.good_candidate]
        newest_good = candidates[-1].step if candidates else -1
        for entry in entries:
            if not entry.committed and entry.step > newest_good:
                self.events.emit("checkpoint_invalid", step=entry.step, reason="no commit marker (half-written)",
                                 condemned=False)
        partly_loaded, skipped, reasons = False, [], []
        for entry in reversed(candidates):
            start = self.clock()
            problem, manifest, skip = self._verify(entry, app_state)
            if problem is not None and problem[2]:  # the key, not the checkpoint: stop before anything is loaded
                self.events.emit("checkpoint_invalid", step=entry.step, reason=problem[0], condemned=False)
                raise CheckpointLoadError(
                    f"cannot resume run {self.run_dir} from {self.store.describe(entry.name)}: {problem[0]}. "
                    "Set the key the checkpoints were written with, or move them away to start over.",
                    user_input=True)
            if problem is None:
                try:
                    state = build_state_dict(app_state, skip=skip)
                    load_state(state, fs=self._reader_fs(manifest), folder=entry.name, process_group=self._control_pg)
                except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises on all ranks together
                    partly_loaded = True
                    problem = (f"load failed: {type(err).__name__}: {err}", False, False)
            if problem is not None:
                skipped.append(entry.step)
                reasons.append(f"step {entry.step} ({self.store.describe(entry.name)}): {problem[0]}")
                self.events.emit("checkpoint_invalid", step=entry.step, reason=problem[0], condemned=problem[1])
                if problem[1] and self.rank == 0:
                    integ.condemn(self.store, entry.name, problem[0])
                continue
            apply_state_dict(app_state, state)
            if skipped:
                self.events.emit("checkpoint_fallback", from_step=skipped[0], to_step=entry.step, skipped=skipped)
                self._abandon_newer(entries, loaded_step=entry.step)
            self.events.emit("checkpoint_loaded", step=entry.step, bytes=manifest["total_bytes"],
                             duration_s=self.clock() - start, saved_world_size=manifest["world_size"],
                             world_size=self.world_size)
            self.last_saved_step = self.loaded_step = entry.step
            return entry.step
        if skipped:
            self.events.emit("checkpoint_none_valid", skipped=skipped)
        if partly_loaded:
            raise CheckpointLoadError(
                f"cannot resume run {self.run_dir}: every checkpoint in {self.store.url} failed "
                f"({'; '.join(reasons)}) and the failed load had partly overwritten the model/optimizer state, so "
                "training cannot start fresh either. Restore a checkpoint or move them away to start over.")
        return None

    def _abandon_newer(self, entries: list[integ.StepEntry], *, loaded_step: int) -> None:
        """Rank 0, after a fallback: condemn every still-good folder newer than the resume point. The run goes
        on from `loaded_step`, so those hold an abandoned timeline; left good, retention would count them as
        the newest and delete this timeline's checkpoints, and the next restart would try them again."""
        if self.rank != 0:
            return
        for entry in entries:
            if entry.step <= loaded_step or not entry.good_candidate or self.store.exists(
                    f"{entry.name}/{integ.CORRUPT_NAME}"):
                continue
            reason = f"abandoned: the run resumed from step {loaded_step} after this checkpoint failed to load"
            try:
                integ.condemn(self.store, entry.name, reason)
                self.events.emit("checkpoint_abandoned", step=entry.step, folder=self.store.describe(entry.name),
                                 resumed_from=loaded_step)
            except OSError as err:
                self.events.emit("checkpoint_delete_failed", folder=entry.name, error=f"condemning: {err}")

    def _verify(
        self, entry: integ.StepEntry, app_state: dict[str, Any]
    ) -> tuple[tuple[str, bool, bool] | None, dict, frozenset[str]]:
        """Every rank checks its share of files and reads DCP's metadata; all ranks get the first problem
        as (message, permanent, wrong key), so they fall back together instead of some entering DCP's
        collectives."""
        problem: tuple[str, bool, bool] | None = None
        manifest: dict = {}
        skip: frozenset[str] = frozenset()
        try:
            manifest = integ.read_manifest(self.store, entry.name)
            integ.verify_share(self.store, entry.name, manifest, rank=self.rank, world_size=self.world_size,
                               cipher=self.cipher)
            skip = self._missing_rank_entries(app_state, entry.name, fs=self._reader_fs(manifest))
        except integ.KeyMismatchError as err:
            problem = (str(err), False, True)
        except integ.IntegrityError as err:
            problem = (str(err), err.permanent, False)
        except Exception as err:  # noqa: BLE001 - e.g. unreadable DCP metadata; decided together below
            problem = (f"{type(err).__name__}: {err}", not isinstance(err, OSError), False)
        problems = [p for p in self._gather(problem, self._control_pg) if p is not None]
        return (problems[0] if problems else None), manifest, skip

    def _reader_fs(self, manifest: dict) -> SealedFileSystem:
        """Plaintext checkpoints written before encryption was switched on stay readable."""
        return self._fs if manifest.get("encryption") else SealedFileSystem(self.store, cipher=None)

    def _missing_rank_entries(self, app_state: dict[str, Any], folder: str, *, fs: SealedFileSystem) -> frozenset[str]:
        """App-state keys holding per-rank state (e.g. RankRNGState) that this checkpoint has no entry for."""
        per_rank = {k: v.per_rank_key for k, v in app_state.items() if hasattr(v, "per_rank_key")}
        if not per_rank:
            return frozenset()
        keys = checkpoint_keys(fs=fs, folder=folder)
        missing = frozenset(k for k, sub in per_rank.items() if not any(x.startswith(f"{k}.{sub}.") for x in keys))
        for key in missing:
            self.events.emit("checkpoint_rank_state_missing", key=key, rank=self.rank, folder=folder)
        return missing

    # ---- collectives (no-ops in one process) ------------------------------------------------------------
    def _agree(self, value: Any, group: dist.ProcessGroup | None) -> Any:
        """Rank 0's value on every rank."""
        if group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def _gather(self, value: Any, group: dist.ProcessGroup | None) -> list[Any]:
        if group is None:
            return [value]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out

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


def _make_cipher(spec: JobSpec) -> ChunkCipher | None:
    sec = spec.security
    if not sec.encrypt_checkpoints:
        return None
    ref = sec.encryption_key
    return ChunkCipher(parse_key(resolve_secret(ref) or "", var_name=f"security.encryption_key {ref}"))

