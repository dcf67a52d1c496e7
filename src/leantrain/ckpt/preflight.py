"""Storage preflight: before a run writes anything, prove its stores work end to end.

Without it a missing bucket is found at the first save, and training runs unprotected until three saves
fail. The checkpoint store's probe, in order: the bucket exists (object stores), the location lists, a probe
object is written, read back (same bytes) and deleted. A remote data dir (`cluster.data_url`, read-only to
the job) is probed the same way without writing: the bucket exists, the location lists, its manifest.json
reads. Every probe runs under one deadline (PREFLIGHT_TIMEOUT_S for all of them together), so a dead
endpoint or a hanging mount is one line and exit 2 well under 30 s, naming the url, the operation and the
cause. Rank 0 (or a one-node `launch`, before any rank starts) probes the checkpoint store once per start;
`launch` and `launch --preflight` probe the data store too before they stage it, and the job files' staging
step (`python -m leantrain.launch.staging`) probes it on every node before copying.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from leantrain.ckpt.errors import one_line
from leantrain.ckpt.storage import S3_CONNECT_TIMEOUT_S, S3_READ_TIMEOUT_S, FsspecStore, Store, open_store
from leantrain.errors import UserInputError

if TYPE_CHECKING:
    from pathlib import Path

    from leantrain.spec import JobSpec

PREFLIGHT_TIMEOUT_S = 20.0
MIN_PROBE_S = 5.0  # a later store's probe gets at least this long even when an earlier one was slow
DATA_MANIFEST = "manifest.json"  # what a prepared data dir holds at its top (data/shards.py writes it)


def _bucket_step(store: Store, *, field: str) -> list[tuple[str, Callable[[], Any]]]:
    if not (isinstance(store, FsspecStore) and store.url.startswith("s3://")):
        return []
    bucket = store.root.split("/", 1)[0]

    def bucket_exists() -> None:
        # HEAD on the bucket, not fs.exists(): exists() answers False for a dead endpoint or bad credentials.
        try:
            store.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist (create it, or fix {field})") from None

    return [("bucket exists", bucket_exists)]


def _steps(store: Store, probe: str, data: bytes) -> list[tuple[str, Callable[[], Any]]]:
    return [
        *_bucket_step(store, field="checkpoint.url"),
        ("list", lambda: store.list_dir("")),
        ("write", lambda: store.write_bytes(probe, data)),
        ("read", lambda: _read_back(store, probe, data)),
        ("delete", lambda: store.remove_file(probe)),
    ]


def _read_back(store: Store, probe: str, data: bytes) -> None:
    if store.read_bytes(probe) != data:
        raise OSError("the probe object read back differs from what was written")


def _read_manifest(store: Store) -> None:
    try:
        store.read_bytes(DATA_MANIFEST)
    except FileNotFoundError:
        raise FileNotFoundError(f"no {DATA_MANIFEST} there: cluster.data_url must name a prepared data dir "
                                "(`leantrain prepare` writes one)") from None


def _run_steps(steps: list[tuple[str, Callable[[], Any]]], *, where: str, hint: str, timeout_s: float) -> float:
    """Run the operations in order on a worker thread under one deadline; the seconds they took. Raises
    UserInputError naming `where` (the store and its url), the operation and the cause."""
    state: dict[str, Any] = {"operation": "connect", "error": None}
    start = time.monotonic()

    def run() -> None:
        try:
            for name, step in steps:
                state["operation"] = name
                step()
            state["operation"] = None
        except BaseException as err:  # noqa: BLE001 - botocore/fsspec errors are not OSErrors
            state["error"] = err

    worker = threading.Thread(target=run, name="storage-preflight", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise UserInputError(f"{where}: {state['operation']} did not answer within {timeout_s:.0f} s (endpoint "
                             f"unreachable or too slow; check {hint} and the network)")
    if state["error"] is not None:
        raise UserInputError(f"{where}: {state['operation']} failed: {one_line(state['error'])}")
    return time.monotonic() - start


def probe_store(store: Store, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> float:
    """Probe a checkpoint store (bucket, list, write, read, delete); the seconds it took. Raises UserInputError
    naming url, operation and cause."""
    probe = f".leantrain-probe-{socket.gethostname()}-{os.getpid()}"
    return _run_steps(_steps(store, probe, os.urandom(64)), where=f"checkpoint store {store.url}",
                      hint="checkpoint.endpoint_url", timeout_s=timeout_s)


def data_store(url: str, *, endpoint_url: str | None = None) -> FsspecStore:
    """The remote data dir as a store, with the same bounded S3 client as the checkpoint store (credentials from
    the environment, as the staging copy reads them)."""
    options: dict[str, Any] = {}
    if url.startswith("s3://"):
        options["config_kwargs"] = {"connect_timeout": S3_CONNECT_TIMEOUT_S, "read_timeout": S3_READ_TIMEOUT_S,
                                    "retries": {"max_attempts": 2, "mode": "standard"}}
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
    return FsspecStore(url, storage_options=options)


def probe_data_store(url: str, *, endpoint_url: str | None = None, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> float:
    """Probe a remote data dir read-only (bucket, list, read its manifest.json); the seconds it took. Raises
    UserInputError naming `cluster.data_url`, the url, the operation and the cause."""
    where = f"data store {url} (cluster.data_url)"
    try:
        store = data_store(url, endpoint_url=endpoint_url)
    except (ImportError, ValueError) as err:  # no fsspec backend for the protocol, or a malformed url
        raise UserInputError(f"{where}: open failed: {one_line(err)}") from None
    steps = [*_bucket_step(store, field="cluster.data_url"), ("list", lambda: store.list_dir("")),
             (f"read {DATA_MANIFEST}", lambda: _read_manifest(store))]
    return _run_steps(steps, where=where, hint="cluster.data_endpoint_url", timeout_s=timeout_s)


def remote_data_url(spec: JobSpec) -> str | None:
    """`cluster.data_url` when it names a remote store (s3://, gs://, ...), else None (a local dir is checked by
    the data check of `launch --preflight` and by the trainer)."""
    url = spec.cluster.data_url
    if not url or "://" not in url or url.split("://", 1)[0] in ("file", "local"):
        return None
    return url


def preflight_storage(spec: JobSpec, *, run_dir: Path, data: bool = False) -> float:
    """The spec's checkpoint store works end to end (and with `data`, its remote data dir reads), within one
    PREFLIGHT_TIMEOUT_S; or exit 2 naming url, operation and cause. Returns the seconds it took."""
    start = time.monotonic()
    took = probe_store(open_store(spec, run_dir=run_dir))
    url = remote_data_url(spec) if data else None
    if url is not None:
        left = max(MIN_PROBE_S, PREFLIGHT_TIMEOUT_S - (time.monotonic() - start))
        took += probe_data_store(url, endpoint_url=spec.cluster.data_endpoint_url, timeout_s=left)
    return took
