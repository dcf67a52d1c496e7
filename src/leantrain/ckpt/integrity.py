"""Atomic, verified checkpoint commits: hash while writing, manifest, commit marker, publish, verify, retain.

A checkpoint folder `step-NNNNNNNN/` is *good* only when (1) it holds a `COMMIT` marker, (2) the marker names the
sha256 of `manifest.json`, (3) every file listed in the manifest has the recorded size and sha256 (and, when
encrypted, every chunk authenticates), and (4) it carries no `CORRUPT` marker from an earlier failed check.
On a filesystem the files are written into `.tmp-step-NNNNNNNN/`, fsync'd, committed and then renamed into place;
on an object store (no rename) they are written in place and the commit marker, written last, is the publish:
a PUT is atomic, so a reader never sees a marker without the manifest and files before it.
A resume checks (3) as it loads, each file by one rank in the read that loads it (ckpt/verified_load.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO

from leantrain.ckpt.crypto import ChunkCipher, EncryptingWriter, TamperError
from leantrain.ckpt.storage import Store
from leantrain.errors import LeantrainError

FORMAT = "leantrain-checkpoint/1"
MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMIT"
CORRUPT_NAME = "CORRUPT"
CONTROL_FILES = (MANIFEST_NAME, COMMIT_NAME, CORRUPT_NAME)
STEP_RE = re.compile(r"^step-(\d{8})$")
TMP_RE = re.compile(r"^\.tmp-step-(\d{8})$")
READ_CHUNK_BYTES = 8 * 2**20


class IntegrityError(LeantrainError):
    """A checkpoint failed verification. `permanent` is False for I/O errors that may pass on retry.

    A resume catches it and falls back to an older checkpoint (ckpt/loading.py); export and eval name the
    checkpoint around it (ckpt/export.py); anywhere else the CLI prints its one line and exits 2, no traceback."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent

    def __reduce__(self) -> tuple:
        # DCP carries a rank's failure to the others pickled; `permanent` must survive the trip.
        return (type(self), (str(self),), {"permanent": self.permanent})


class KeyMismatchError(IntegrityError):
    """The checkpoint is fine but the configured key cannot read it (none, or another one): the user's input,
    so the checkpoint is never condemned for it."""


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records for one stored file (the bytes as stored: ciphertext when encrypted)."""

    sha256: str
    num_bytes: int


@dataclass(frozen=True)
class StepEntry:
    """One `step-*` folder as listed: whether it is committed and whether an earlier check condemned it."""

    step: int
    name: str
    committed: bool
    corrupt: bool

    @property
    def good_candidate(self) -> bool:
        return self.committed and not self.corrupt


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir(step: int) -> str:
    return f".tmp-step-{step:08d}"


class _HashingSink:
    """Forwards bytes to the stored stream while hashing and counting them."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.num_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.digest.update(data)
        self.num_bytes += len(data)
        self.raw.write(data)
        return len(data)


class SealedWriter(io.RawIOBase):
    """A write stream that hashes (and optionally encrypts) what it stores and reports it on close.

    `tell()` counts plaintext bytes, which is what DCP records as offsets inside the file.
    """

    def __init__(
        self,
        store: Store,
        raw: IO[bytes],
        *,
        logical_name: str,
        cipher: ChunkCipher | None,
        on_commit: Callable[[FileRecord], None],
        is_aborted: Callable[[], bool] = lambda: False,
        location: str | None = None,
    ) -> None:
        super().__init__()
        self._store, self._raw, self._on_commit, self._is_aborted = store, raw, on_commit, is_aborted
        self._location = location or store.describe(logical_name)  # for write errors (ENOSPC names no file)
        self._sink = _HashingSink(raw)
        self._encrypt = EncryptingWriter(self._sink, cipher, name=logical_name) if cipher else None  # type: ignore[arg-type]
        self._plain_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        if self._is_aborted():  # another writer thread of this save failed: stop early
            raise OSError("checkpoint save aborted")
        size = memoryview(data).nbytes
        try:
            if self._encrypt is not None:
                self._encrypt.write(bytes(data))
            else:
                self._sink.write(data)
        except OSError as err:
            raise _named(err, self._location) from err
        self._plain_bytes += size
        return size

    def tell(self) -> int:
        return self._plain_bytes

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._encrypt is not None:
                self._encrypt.finish()
            self._store.sync_file(self._raw)
            self._raw.close()
        except OSError as err:
            raise _named(err, self._location) from err
        super().close()
        self._on_commit(FileRecord(sha256=self._sink.digest.hexdigest(), num_bytes=self._sink.num_bytes))

    def abort(self) -> None:
        """Close the stored stream after a failed write without reporting the file as written."""
        if self.closed:
            return
        try:
            self._raw.close()
        except OSError:  # e.g. ENOSPC again while flushing: the write's own error is the one to report
            pass
        finally:
            super().close()


def _named(err: OSError, location: str) -> OSError:
    """The same error with the file it happened to (a disk-full write error names none)."""
    if err.filename is not None or err.errno is None:
        return err
    return type(err)(err.errno, err.strerror or str(err), location)


def build_manifest(
    *, step: int, files: dict[str, FileRecord], world_size: int, cipher: ChunkCipher | None, extra: dict | None = None
) -> dict:
    """The manifest's content: every stored file with its hash and size, plus how to read them."""
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "created": time.time(),
        "encryption": None if cipher is None else {"scheme": "aes-256-gcm-chunked-v1", "key_id": cipher.key_id},
        "files": {name: {"sha256": rec.sha256, "bytes": rec.num_bytes} for name, rec in sorted(files.items())},
        "total_bytes": sum(rec.num_bytes for rec in files.values()),
        **(extra or {}),
    }


def write_commit(store: Store, folder: str, manifest: dict, *, before_marker: Callable[[], None] | None = None) -> None:
    """Write the manifest, then the commit marker naming its hash; both fsync'd, then the folder itself.
    `before_marker` runs between the two (a fault-injection point, ckpt/fault.py)."""
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    store.write_bytes(f"{folder}/{MANIFEST_NAME}", manifest_bytes)
    if before_marker is not None:
        before_marker()
    marker = {"format": FORMAT, "step": manifest["step"], "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
    store.write_bytes(f"{folder}/{COMMIT_NAME}", json.dumps(marker).encode())
    store.sync_dir(folder)


def publish(store: Store, *, step: int) -> str:
    """Move a committed temporary folder into place (filesystems); object stores were written in place."""
    final = step_dir(step)
    if store.supports_rename:
        store.remove_tree(final)  # only a condemned or uncommitted leftover can be here (see the manager)
        store.rename(tmp_dir(step), final)
        store.sync_dir("")
    return final


def read_manifest(store: Store, folder: str) -> dict:
    """The manifest of a committed folder, checked against its commit marker."""
    try:
        marker = json.loads(store.read_bytes(f"{folder}/{COMMIT_NAME}"))
        manifest_bytes = store.read_bytes(f"{folder}/{MANIFEST_NAME}")
    except FileNotFoundError as err:
        raise IntegrityError(f"{folder}: no {err.filename or 'commit marker/manifest'} (half-written)") from err
    except (OSError, ValueError) as err:
        raise IntegrityError(f"{folder}: unreadable commit marker or manifest: {err}",
                             permanent=isinstance(err, ValueError)) from err
    if hashlib.sha256(manifest_bytes).hexdigest() != marker.get("manifest_sha256"):
        raise IntegrityError(f"{folder}: manifest does not match the hash in its commit marker")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as err:
        raise IntegrityError(f"{folder}: manifest is not valid JSON") from err
    if manifest.get("format") != FORMAT:
        raise IntegrityError(f"{folder}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


class HashingReader:
    """Passes reads through while hashing and counting them."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.num_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        self.num_bytes += len(data)
        return data


def check_read(rel: str, record: dict, *, num_bytes: int, sha256: str) -> None:
    """What a whole read of a file saw against the manifest's record of it."""
    if num_bytes != record["bytes"]:
        raise IntegrityError(f"{rel}: {num_bytes} bytes, manifest says {record['bytes']} (truncated?)")
    if sha256 != record["sha256"]:
        raise IntegrityError(f"{rel}: sha256 mismatch (corrupted)")


def verify_file(store: Store, folder: str, name: str, record: dict, *, cipher: ChunkCipher | None) -> None:
    """Check one file's size and sha256 in a single read pass (authenticating every chunk when encrypted)."""
    rel = f"{folder}/{name}"
    try:
        with store.open_read(rel) as raw:
            reader = HashingReader(raw)
            if cipher is not None:
                for _ in cipher.open_stream(reader, name=f"{step_name(folder)}/{name}"):  # type: ignore[arg-type]
                    pass
            while reader.read(READ_CHUNK_BYTES):
                pass
    except FileNotFoundError as err:
        raise IntegrityError(f"{rel}: missing") from err
    except TamperError as err:
        raise IntegrityError(f"{folder}: {err}") from err
    except OSError as err:
        raise IntegrityError(f"{rel}: read failed: {err}", permanent=False) from err
    check_read(rel, record, num_bytes=reader.num_bytes, sha256=reader.digest.hexdigest())


def check_sizes(store: Store, folder: str, manifest: dict) -> None:
    """Every file of the manifest is there with its recorded size: one listing of the folder, no read (a missing
    or truncated file is named before a reader that does not hash what it reads trips over it)."""
    try:
        sizes = store.file_sizes(folder)
    except OSError as err:
        raise IntegrityError(f"{store.describe(folder)}: cannot list it: {err}", permanent=False) from err
    for name, record in sorted(manifest.get("files", {}).items()):
        rel = f"{folder}/{name}"
        size = sizes.get(name)
        if size is None:
            raise IntegrityError(f"{store.describe(rel)}: missing")
        if size != record["bytes"]:
            raise IntegrityError(f"{store.describe(rel)}: {size} bytes, manifest says {record['bytes']} (truncated?)")


class OnePassReader:
    """A plaintext stored file read once, front to back, while its slices are handed out, and checked against the
    manifest's record (size, sha256) when `finish` has hashed the rest: the bytes a load uses are verified by the
    same read that loads them, with no second pass over the file. Slices must come in ascending offsets (a
    repeat of the last one is served again); the bytes between and after them are hashed, not kept."""

    def __init__(self, raw: IO[bytes], *, rel: str, record: dict) -> None:
        self._raw, self.rel, self._record = raw, rel, record
        self._digest = hashlib.sha256()
        self._pos = 0
        self._last: tuple[int, int, bytes] | None = None

    def _read(self, size: int) -> bytes:
        try:
            data = self._raw.read(size)
        except OSError as err:
            raise IntegrityError(f"{self.rel}: read failed: {err}", permanent=False) from err
        self._digest.update(data)
        self._pos += len(data)
        return data

    def _skip_to(self, offset: int | None) -> None:
        while offset is None or self._pos < offset:
            if not self._read(READ_CHUNK_BYTES if offset is None else min(READ_CHUNK_BYTES, offset - self._pos)):
                return

    def slice(self, offset: int, length: int) -> bytes:
        if self._last is not None and self._last[:2] == (offset, length):
            return self._last[2]
        assert offset >= self._pos, f"{self.rel}: slice at {offset} after byte {self._pos} was read"
        self._skip_to(offset)
        parts, wanted = [b""], length
        while wanted > 0:
            part = self._read(wanted)
            if not part and self._pos < self._record["bytes"]:
                raise IntegrityError(f"{self.rel}: {self._pos} bytes, manifest says {self._record['bytes']} "
                                     "(truncated?)")
            if not part:  # the file is whole by its record: DCP's metadata does not describe it
                raise EOFError(f"{self.rel}: DCP's metadata reads bytes {offset}-{offset + length}, the file has "
                               f"{self._pos}")
            parts.append(part)
            wanted -= len(part)
        data = parts[-1] if len(parts) == 2 else b"".join(parts)  # one read: no copy
        self._last = (offset, length, data)
        return data

    def finish(self) -> None:
        """Hash to the end of the file and check it (raises IntegrityError)."""
        self._skip_to(None)
        check_read(self.rel, self._record, num_bytes=self._pos, sha256=self._digest.hexdigest())


def step_name(folder: str) -> str:
    """The logical folder name used in encryption associated data: the same before and after the rename."""
    match = TMP_RE.match(folder)
    return step_dir(int(match.group(1))) if match else folder


def check_key(folder: str, manifest: dict, *, cipher: ChunkCipher | None) -> ChunkCipher | None:
    """The cipher that reads this checkpoint (None for plaintext, also one written before encryption was
    switched on); KeyMismatchError when the configured key cannot read it."""
    enc = manifest.get("encryption")
    if enc and cipher is None:
        raise KeyMismatchError(f"{folder}: checkpoint is encrypted but no key is configured "
                               "(security.encrypt_checkpoints / security.encryption_key)")
    if enc and cipher is not None and enc.get("key_id") != cipher.key_id:
        raise KeyMismatchError(f"{folder}: encrypted with another key (key id {enc.get('key_id')}, "
                               f"security.encryption_key has {cipher.key_id})")
    return cipher if enc else None


def list_steps(store: Store) -> list[StepEntry]:
    """Every `step-*` folder, oldest first, with its commit/corrupt state."""
    entries = []
    for name in store.list_dir(""):
        match = STEP_RE.match(name)
        if match:
            entries.append(
                StepEntry(
                    step=int(match.group(1)),
                    name=name,
                    committed=store.exists(f"{name}/{COMMIT_NAME}"),
                    corrupt=store.exists(f"{name}/{CORRUPT_NAME}"),
                )
            )
    return sorted(entries, key=lambda e: e.step)


def condemn(store: Store, entry_name: str, reason: str) -> None:
    """Mark a folder as failed verification so later resumes skip it without reading it again."""
    store.write_bytes(f"{entry_name}/{CORRUPT_NAME}", json.dumps({"reason": reason, "time": time.time()}).encode())


def retention_victims(
    entries: Iterable[StepEntry], *, keep_last: int, tmp_names: Iterable[str] = (), committed_step: int | None = None
) -> list[tuple[str, str]]:
    """Folders to delete after a commit: good ones beyond `keep_last`, and leftovers older than the newest good.

    Only called after a successful commit, so the newest good checkpoint is always among those kept. With
    `committed_step` (the step just committed) everything is counted back from that step: folders of higher
    steps belong to a timeline the run abandoned when it resumed from an older checkpoint; they are neither
    counted among the kept nor deleted here (the run replaces each when it reaches its step).
    """
    entries = list(entries)
    if committed_step is not None:
        entries = [e for e in entries if e.step <= committed_step]
    good = [e for e in entries if e.good_candidate]
    if not good:
        return []
    kept = {e.step for e in good[-keep_last:]}
    newest = good[-1].step
    victims = [(e.name, f"beyond keep_last={keep_last}") for e in good if e.step not in kept]
    victims += [
        (e.name, "condemned" if e.corrupt else "never committed") for e in entries
        if not e.good_candidate and e.step < newest
    ]
    victims += [(name, "stale temporary folder") for name in tmp_names]
    return victims


def remove_checkpoint(store: Store, name: str) -> None:
    """Delete the commit marker first, so a crash mid-delete leaves an uncommitted folder, never a broken one."""
    store.remove_file(f"{name}/{COMMIT_NAME}")
    store.remove_tree(name)
