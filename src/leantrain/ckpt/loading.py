"""Resuming: pick, verify and load a checkpoint for `CheckpointManager.load_latest` (all ranks together).

The newest checkpoint that verifies is loaded, falling back to older ones. Nothing is marked while looking:
a failed checkpoint is condemned (a `CORRUPT` marker) and newer good ones abandoned only once an older one
has loaded, so when every checkpoint fails the store is left exactly as it was and the run refuses to start
(exit 2), naming each checkpoint and why: it never starts over silently on top of them.

Options: `step` loads that step only (no fallback); `source` reads another store (a checkpoint named by
path, e.g. another run's) where nothing is ever marked; `check(entry, manifest)` returns a reason to refuse
before anything is loaded (e.g. the schedule changed, ckpt/resume.py).

Reads at scale: rank 0 alone lists the store, reads each candidate's commit marker, manifest and DCP
`.metadata` and broadcasts them; each shard file is checked by one rank as it loads it (ckpt/verified_load.py).

It uses the manager only through its public interface (`read_on_rank0`, `load_group`, `sealed_fs`, `events`,
`store`, `foreign`, `model_identity`), as the trainer's hook does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

import leantrain.ckpt.integrity as integ
from leantrain.ckpt.dcp_io import SealedFileSystem, apply_state_dict, build_state_dict, load_state
from leantrain.ckpt.errors import CheckpointLoadError, one_line
from leantrain.ckpt.identity import identity_problem
from leantrain.ckpt.storage import FsspecStore, Store
from leantrain.ckpt.verified_load import VerifiedReader, read_metadata, unread_files

if TYPE_CHECKING:
    from leantrain.ckpt.manager import CheckpointManager

ResumeCheck = Callable[[integ.StepEntry, dict], "str | None"]
Problem = tuple[str, bool, bool, str | None]  # (message, permanent, wrong key, identity kind: ckpt/identity.py)

START_OVER_HINT = ("Nothing was changed. Restore a good checkpoint, load one explicitly with --resume STEP|PATH, "
                   "or start over with `--resume none --run-dir NEW_DIR` (and a new checkpoint.url when it is set)")


def _counts_as_checkpoint(store: Store, entry: integ.StepEntry) -> bool:
    """Whether a folder may hold a run's state. On an object store a save is written in place, so a folder
    with neither commit marker nor manifest is a save that was interrupted, not a checkpoint."""
    if entry.committed or entry.corrupt or not isinstance(store, FsspecStore):
        return True
    return store.exists(f"{entry.name}/{integ.MANIFEST_NAME}")


def _list(m: CheckpointManager, store: Store) -> list[integ.StepEntry]:
    def read() -> Any:
        try:
            return [(e, _counts_as_checkpoint(store, e)) for e in integ.list_steps(store)]
        except Exception as err:  # noqa: BLE001 - botocore/fsspec errors are not OSErrors
            return one_line(err)

    listed = m.read_on_rank0(read)
    if isinstance(listed, str):
        if store is m.store:  # this run's own store, which passed the start's preflight: exit 1
            raise CheckpointLoadError(f"cannot list the checkpoints in {store.url}: {listed}")
        # the location `--resume PATH` named: the user's input (exit 2)
        raise CheckpointLoadError(f"--resume {store.url}: cannot list the checkpoints there: {listed}" + (
            "; check the URL, the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, or "
            "checkpoint.access_key/secret_key with checkpoint.storage object_store) and the endpoint "
            "(AWS_ENDPOINT_URL, or checkpoint.endpoint_url)" if store.url.startswith("s3://") else ""), user_input=True)
    return [e for e, counts in listed if counts]


def load(m: CheckpointManager, app_state: dict[str, Any], *, step: int | None = None, source: Store | None = None,
         check: ResumeCheck | None = None) -> int | None:
    """The loaded step, or None when the store holds no checkpoint at all (see the module docstring).

    The console warnings of the checkpoints it skips are shown once a load succeeds (the fallback); a refusal
    (CheckpointLoadError) shows its one-line error alone, since it names every skipped checkpoint and why."""
    with m.events.console_held(drop_on=CheckpointLoadError):
        return _load(m, app_state, step=step, source=source, check=check)


def _load(m: CheckpointManager, app_state: dict[str, Any], *, step: int | None, source: Store | None,
          check: ResumeCheck | None) -> int | None:
    store = source or m.store
    own = source is None
    entries = _list(m, store)
    chosen = entries if step is None else [e for e in entries if e.step == step]
    if step is not None and not chosen:
        steps = ", ".join(str(e.step) for e in entries) or "none"
        raise CheckpointLoadError(f"--resume {step}: no checkpoint of step {step} in {store.url} (steps there: "
                                  f"{steps})", user_input=True)
    candidates = [e for e in chosen if e.good_candidate]
    reasons = [f"step {e.step} ({store.describe(e.name)}): "
               + ("no commit marker (half-written or marker lost)" if not e.committed else "marked CORRUPT earlier")
               for e in chosen if not e.good_candidate]
    for entry in chosen:
        if not entry.committed:
            m.events.emit("checkpoint_invalid", step=entry.step, reason="no commit marker (half-written)",
                          condemned=False)
    partly_loaded, skipped, to_condemn = False, [], []
    for entry in reversed(candidates):
        start = m.clock()
        fs = _reader_fs(m, store)
        problem, manifest, metadata = m.read_on_rank0(partial(_read_shared, m, entry, store=store, fs=fs))
        if problem is not None and problem[2]:  # the key, not the checkpoint: stop before anything is loaded
            m.events.emit("checkpoint_invalid", step=entry.step, reason=problem[0], condemned=False)
            raise CheckpointLoadError(
                f"cannot resume run {m.run_dir} from {store.describe(entry.name)}: {problem[0]}. "
                "Set the key the checkpoints were written with, or move them away to start over.", user_input=True)
        refusal = check(entry, manifest) if problem is None and check is not None else None
        if refusal:
            raise CheckpointLoadError(refusal, user_input=True)
        if problem is None:
            assert metadata is not None
            try:
                state = build_state_dict(app_state, skip=_missing_rank_entries(m, app_state, entry.name, metadata))
                reader = VerifiedReader(fs(manifest), entry.name, metadata=metadata, records=manifest["files"])
                load_state(state, reader=reader, process_group=m.load_group)
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises on all ranks together
                bad = _integrity_failure(err)
                # A file that failed its check is refused like one checked before the load: when every
                # checkpoint fails the run refuses to start either way, so the half-loaded state is never used.
                partly_loaded = partly_loaded or bad is None or not bad.permanent
                problem = ((str(bad), bad.permanent, False, None) if bad is not None
                           else (f"load failed: {one_line(err)}", False, False, None))
        if problem is not None and problem[3] is not None:  # not this run's: named, skipped, never touched
            skipped.append(entry.step)
            reasons.insert(0, f"{store.describe(entry.name)}: {problem[0]}")
            if own:
                m.foreign[entry.name] = problem[0]
            m.events.emit(f"checkpoint_{problem[3]}", step=entry.step, folder=store.describe(entry.name),
                          saved_step=manifest.get("step"), reason=problem[0])
            continue
        if problem is not None:
            skipped.append(entry.step)
            reasons.insert(0, f"step {entry.step} ({store.describe(entry.name)}): {problem[0]}")
            # `permanent`: it will be marked CORRUPT once an older checkpoint has loaded (never before).
            m.events.emit("checkpoint_invalid", step=entry.step, reason=problem[0], permanent=problem[1],
                          condemned=False)
            if problem[1]:
                to_condemn.append((entry.name, problem[0]))
            continue
        apply_state_dict(app_state, state)
        if own and m.rank == 0:
            _condemn(m, to_condemn)  # only now: a good resume point exists
        if skipped:
            m.events.emit("checkpoint_fallback", from_step=skipped[0], to_step=entry.step, skipped=skipped)
        if own and (skipped or step is not None):
            _abandon_newer(m, entries, loaded_step=entry.step)
        m.events.emit("checkpoint_loaded", step=entry.step, bytes=manifest["total_bytes"],
                      duration_s=m.clock() - start, saved_world_size=manifest["world_size"],
                      world_size=m.world_size, folder=store.describe(entry.name))
        m.loaded_from = store.describe(entry.name)
        if own:
            m.last_saved_step = m.loaded_step = entry.step
        return entry.step
    if chosen:
        m.events.emit("checkpoint_none_valid", skipped=[e.step for e in chosen])
    if partly_loaded:
        raise CheckpointLoadError(
            f"cannot resume run {m.run_dir}: every checkpoint in {store.url} failed ({'; '.join(reasons)}) and the "
            "failed load had partly overwritten the model/optimizer state, so training cannot start fresh "
            "either. Restore a checkpoint or move them away to start over.")
    if chosen:
        raise CheckpointLoadError(
            f"cannot resume run {m.run_dir}: {len(chosen)} checkpoint(s) in {store.url} and none is valid: "
            f"{'; '.join(reasons)}. {START_OVER_HINT}.", user_input=True)
    return None


def _condemn(m: CheckpointManager, victims: list[tuple[str, str]]) -> None:
    for name, reason in victims:
        try:
            integ.condemn(m.store, name, reason)
            m.events.emit("checkpoint_condemned", folder=m.store.describe(name), reason=reason)
        except Exception as err:  # noqa: BLE001 - any storage error: the resume stands
            m.events.emit("checkpoint_delete_failed", folder=name, operation="condemn", error=one_line(err))


def _abandon_newer(m: CheckpointManager, entries: list[integ.StepEntry], *, loaded_step: int) -> None:
    """Rank 0, after a fallback or an explicit older step: condemn every still-good folder newer than the
    resume point. The run goes on from `loaded_step`, so those hold an abandoned timeline; left good,
    retention would count them as the newest and delete this timeline's checkpoints, and the next restart
    would resume onto them."""
    if m.rank != 0:
        return
    for entry in entries:
        if entry.step <= loaded_step or not entry.good_candidate or entry.name in m.foreign or m.store.exists(
                f"{entry.name}/{integ.CORRUPT_NAME}"):
            continue
        reason = f"abandoned: the run resumed from step {loaded_step}"
        try:
            integ.condemn(m.store, entry.name, reason)
            m.events.emit("checkpoint_abandoned", step=entry.step, folder=m.store.describe(entry.name),
                          resumed_from=loaded_step)
        except Exception as err:  # noqa: BLE001 - any storage error
            m.events.emit("checkpoint_delete_failed", folder=entry.name, error=f"condemning: {one_line(err)}")


def _reader_fs(m: CheckpointManager, store: Store) -> Callable[[dict], SealedFileSystem]:
    """Plaintext checkpoints written before encryption was switched on stay readable."""
    def pick(manifest: dict) -> SealedFileSystem:
        if store is m.store and manifest.get("encryption"):
            return m.sealed_fs
        return SealedFileSystem(store, cipher=m.cipher if manifest.get("encryption") else None)
    return pick


def _read_shared(m: CheckpointManager, entry: integ.StepEntry, *, store: Store,
                 fs: Callable[[dict], SealedFileSystem]) -> tuple[Problem | None, dict, Metadata | None]:
    """Rank 0: the commit marker, manifest and DCP metadata of `entry` (checked against the manifest), and the
    files no DCP load reads; the first problem instead, as a value (never raised: the other ranks wait for it)."""
    manifest: dict = {}
    try:
        manifest = integ.read_manifest(store, entry.name)
        foreign = identity_problem(folder_step=entry.step, manifest=manifest, expected=m.model_identity)
        if foreign is not None:  # decided from the manifest alone: no shard is read
            kind, message = foreign
            return (message, False, False, kind), manifest, None
        cipher = integ.check_key(entry.name, manifest, cipher=m.cipher)
        metadata = read_metadata(fs(manifest), entry.name, manifest)
        for name in unread_files(manifest, metadata):  # small files of the save (lineage.json), else unchecked
            integ.verify_file(store, entry.name, name, manifest["files"][name], cipher=cipher)
    except integ.KeyMismatchError as err:
        return (str(err), False, True, None), manifest, None
    except integ.IntegrityError as err:
        return (str(err), err.permanent, False, None), manifest, None
    except Exception as err:  # noqa: BLE001 - e.g. unreadable DCP metadata: refused on every rank
        return (one_line(err), not isinstance(err, OSError), False, None), manifest, None
    return None, manifest, metadata


def _integrity_failure(err: BaseException) -> integ.IntegrityError | None:
    """The first failed file check among the ranks' failures of a DCP load (rank order)."""
    failures = err.failures if isinstance(err, CheckpointException) else {0: (err, None)}
    for _, (exc, _trace) in sorted(failures.items()):
        if isinstance(exc, integ.IntegrityError):
            return exc
    return None


def _missing_rank_entries(m: CheckpointManager, app_state: dict[str, Any], folder: str,
                          metadata: Metadata) -> frozenset[str]:
    """App-state keys holding per-rank state (e.g. RankRNGState) that this checkpoint has no entry for."""
    per_rank = {k: v.per_rank_key for k, v in app_state.items() if hasattr(v, "per_rank_key")}
    if not per_rank:
        return frozenset()
    keys = set(metadata.state_dict_metadata)
    missing = frozenset(k for k, sub in per_rank.items() if not any(x.startswith(f"{k}.{sub}.") for x in keys))
    for key in missing:
        m.events.emit("checkpoint_rank_state_missing", key=key, rank=m.rank, folder=folder)
    return missing
