"""Where checkpoint bytes live: a local folder or an S3-compatible object store, behind one small interface.

The checkpoint layer only needs a handful of operations on paths relative to a root (open for write/read,
list a folder, remove a tree, rename on a filesystem). `LocalStore` does them with `os` so it can fsync files
and folders; `FsspecStore` does them with fsspec (s3fs for `s3://`), where a PUT is atomic and there is no
rename, so a checkpoint is published by writing its commit marker last (see integrity.py).
Credentials are read from the environment at the moment of use (`resolve_secret`), never from the spec file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from leantrain.errors import UserInputError
from leantrain.spec import resolve_secret

if TYPE_CHECKING:
    from leantrain.spec import JobSpec


S3_CONNECT_TIMEOUT_S = 10
S3_READ_TIMEOUT_S = 60


class Store:
    """Operations the checkpoint layer needs, on '/'-separated paths relative to the store's root."""

    url: str
    supports_rename: bool = False

    def open_write(self, rel: str) -> IO[bytes]:
        raise NotImplementedError

    def open_read(self, rel: str) -> IO[bytes]:
        raise NotImplementedError

    def sync_file(self, stream: IO[bytes]) -> None:
        """Make a written file durable before it is closed (no-op where close is the durability point)."""

    def sync_dir(self, rel: str) -> None:
        """Make renames/creations inside a folder durable (no-op on object stores)."""

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_write(rel) as stream:
            stream.write(data)
            self.sync_file(stream)

    def read_bytes(self, rel: str) -> bytes:
        with self.open_read(rel) as stream:
            return stream.read()

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def file_sizes(self, rel: str) -> dict[str, int]:
        """The size of every file under `rel`, keyed by its path relative to `rel` ('/'-separated); empty when
        `rel` does not exist. One listing, not a stat per file: a checkpoint has a file per writing rank, and at
        16,384 ranks one HEAD request each would take minutes on an object store."""
        raise NotImplementedError

    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) of the entries directly inside `rel`; empty when it does not exist."""
        raise NotImplementedError

    def makedirs(self, rel: str) -> None:
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def remove_file(self, rel: str) -> None:
        raise NotImplementedError

    def remove_tree(self, rel: str) -> None:
        raise NotImplementedError

    def describe(self, rel: str) -> str:
        """A human-readable location for messages and events."""
        return f"{self.url.rstrip('/')}/{rel}"


class LocalStore(Store):
    """A folder on a local or shared POSIX filesystem: fsync'd writes and atomic renames."""

    supports_rename = True

    def __init__(self, root: str | Path, *, owner_only: bool = True) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.owner_only = owner_only
        self._dir_mode = 0o700 if owner_only else 0o755
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
        except FileExistsError:
            raise UserInputError(f"checkpoint location {self.root} is a file, not a folder: move it away or set "
                                 "checkpoint.url to a folder") from None
        except OSError as err:
            raise UserInputError(f"checkpoint location {self.root}: cannot create it "
                                 f"({err.strerror or type(err).__name__}"
                                 f"{f': {err.filename}' if err.filename else ''})") from None

    def _path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def open_write(self, rel: str) -> IO[bytes]:
        # No implicit mkdir: a writer thread that outlives a failed save must not recreate a removed folder.
        path = self._path(rel)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if self.owner_only else 0o644)
        return os.fdopen(fd, "wb")

    def open_read(self, rel: str) -> IO[bytes]:
        return open(self._path(rel), "rb")  # noqa: SIM115 - the caller owns the stream

    def sync_file(self, stream: IO[bytes]) -> None:
        stream.flush()
        os.fsync(stream.fileno())

    def sync_dir(self, rel: str) -> None:
        fd = os.open(self._path(rel), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        return self._path(rel).exists()

    def file_sizes(self, rel: str) -> dict[str, int]:
        top = self._path(rel)
        return {(Path(folder) / name).relative_to(top).as_posix(): (Path(folder) / name).stat().st_size
                for folder, _dirs, names in os.walk(top) for name in names}

    def list_dir(self, rel: str) -> list[str]:
        path = self._path(rel)
        return sorted(os.listdir(path)) if path.is_dir() else []

    def makedirs(self, rel: str) -> None:
        self._path(rel).mkdir(parents=True, exist_ok=True, mode=self._dir_mode)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self._path(src), self._path(dst))

    def remove_file(self, rel: str) -> None:
        self._path(rel).unlink(missing_ok=True)

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self._path(rel), ignore_errors=True)


class FsspecStore(Store):
    """An fsspec filesystem under a URL prefix (s3:// through s3fs). Listing caches are off: other ranks write."""

    supports_rename = False

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.url = url.rstrip("/")
        options = {"use_listings_cache": False, "skip_instance_cache": True, **(storage_options or {})}
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.root = self.root.rstrip("/")

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def open_write(self, rel: str) -> IO[bytes]:
        return self.fs.open(self._path(rel), "wb")

    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self._path(rel), "rb")

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._path(rel)))

    def file_sizes(self, rel: str) -> dict[str, int]:
        top = self._path(rel).rstrip("/") + "/"  # s3fs: one paginated ListObjectsV2 (1,000 keys a page), no HEADs
        found = self.fs.find(top, detail=True)
        return {str(path).removeprefix(top): int(info["size"]) for path, info in found.items()
                if info.get("type") != "directory" and str(path).startswith(top)}

    def list_dir(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, rel: str) -> None:
        """Object stores have no folders; a key's prefix exists once an object is written under it."""

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self._path(src), self._path(dst))

    def remove_file(self, rel: str) -> None:
        if self.fs.exists(self._path(rel)):
            self.fs.rm_file(self._path(rel))

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self._path(rel), recursive=True)
        except FileNotFoundError:
            return


def open_store(spec: JobSpec, *, run_dir: str | Path) -> Store:
    """The store named by `spec.checkpoint`: run_dir/checkpoints by default, a folder, or s3://bucket/prefix."""
    ck = spec.checkpoint
    if ck.storage == "local":
        root = Path(ck.url) if ck.url else Path(run_dir) / "checkpoints"
        return LocalStore(root, owner_only=spec.security.owner_only)
    if not ck.url:
        raise UserInputError("checkpoint.url must be s3://bucket/prefix when checkpoint.storage is object_store")
    return FsspecStore(ck.url, storage_options=s3_options(spec))


def s3_options(spec: JobSpec) -> dict[str, Any]:
    """The S3 client's options from `spec.checkpoint` (endpoint_url, access_key/secret_key when given; else the
    AWS_* environment), for this run's store and for a `--resume s3://...` of another run alike."""
    ck = spec.checkpoint
    # Bounded client: a dead endpoint or wrong credentials fail in seconds, not after minutes of botocore's and
    # s3fs's own retries (the save's retries and checkpoint.save_timeout_s are the retry policy).
    options: dict[str, Any] = {"config_kwargs": {
        "connect_timeout": S3_CONNECT_TIMEOUT_S, "read_timeout": S3_READ_TIMEOUT_S,
        "retries": {"max_attempts": 2, "mode": "standard"}}}
    if ck.endpoint_url:
        options["endpoint_url"] = ck.endpoint_url
    key, secret = resolve_secret(ck.access_key), resolve_secret(ck.secret_key)
    if (key is None) != (secret is None):
        raise UserInputError("checkpoint.access_key and checkpoint.secret_key must be given together")
    if key is not None:
        options["key"], options["secret"] = key, secret
    return options
