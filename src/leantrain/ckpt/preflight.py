"""Storage preflight: before a run writes anything, prove its checkpoint store works end to end.

Without it a missing bucket is found at the first save, and training runs unprotected until three saves
fail. The probe, in order: the bucket exists (object stores), the location lists, a probe object is written,
read back (same bytes) and deleted. Each operation runs under one deadline (PREFLIGHT_TIMEOUT_S for all), so
a dead endpoint or a hanging mount is one line and exit 2 well under 30 s, naming the url, the operation and
the cause. Rank 0 (or a one-node `launch`, before any rank starts) runs it once per start.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from leantrain.ckpt.errors import one_line
from leantrain.ckpt.storage import FsspecStore, Store, open_store
from leantrain.errors import UserInputError

if TYPE_CHECKING:
    from pathlib import Path

    from leantrain.spec import JobSpec

PREFLIGHT_TIMEOUT_S = 20.0


def _steps(store: Store, probe: str, data: bytes) -> list[tuple[str, Any]]:
    steps: list[tuple[str, Any]] = []
    if isinstance(store, FsspecStore):
        bucket = store.root.split("/", 1)[0]

        def bucket_exists() -> None:
            # HEAD on the bucket, not fs.exists(): exists() answers False for a dead endpoint or bad credentials.
            try:
                store.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                missing = f"bucket {bucket!r} does not exist (create it, or fix checkpoint.url)"
                raise FileNotFoundError(missing) from None

        steps.append(("bucket exists", bucket_exists))
    steps += [
        ("list", lambda: store.list_dir("")),
        ("write", lambda: store.write_bytes(probe, data)),
        ("read", lambda: _read_back(store, probe, data)),
        ("delete", lambda: store.remove_file(probe)),
    ]
    return steps


def _read_back(store: Store, probe: str, data: bytes) -> None:
    if store.read_bytes(probe) != data:
        raise OSError("the probe object read back differs from what was written")


def probe_store(store: Store, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> float:
    """Run the probe; the seconds it took. Raises UserInputError naming url, operation and cause."""
    probe = f".leantrain-probe-{socket.gethostname()}-{os.getpid()}"
    data = os.urandom(64)
    state: dict[str, Any] = {"operation": "connect", "error": None}
    start = time.monotonic()

    def run() -> None:
        try:
            for name, step in _steps(store, probe, data):
                state["operation"] = name
                step()
            state["operation"] = None
        except BaseException as err:  # noqa: BLE001 - botocore/fsspec errors are not OSErrors
            state["error"] = err

    worker = threading.Thread(target=run, name="storage-preflight", daemon=True)
    worker.start()
    worker.join(timeout_s)
    where = f"checkpoint store {store.url}"
    if worker.is_alive():
        raise UserInputError(f"{where}: {state['operation']} did not answer within {timeout_s:.0f} s (endpoint "
                             "unreachable or too slow; check checkpoint.endpoint_url and the network)")
    if state["error"] is not None:
        raise UserInputError(f"{where}: {state['operation']} failed: {one_line(state['error'])}")
    return time.monotonic() - start


def preflight_storage(spec: JobSpec, *, run_dir: Path) -> float:
    """The spec's checkpoint store works end to end, or exit 2 naming url, operation and cause."""
    return probe_store(open_store(spec, run_dir=run_dir))
