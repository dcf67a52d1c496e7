"""Data staging: copy a prepared data dir from an object store (any fsspec URL) to node-local disk.

Why: reading shards over the network during training makes the data loader wait on the store's tail latency;
a node-local copy is read by memory map at disk speed. The copy is verified and resumable:

- the remote `manifest.json` lists every shard (`.bin` with `sha256`, `.idx` with `idx_sha256`) and the
  tokenizer (`tokenizer.sha256`); each file is downloaded to `NAME.part`, continuing from the bytes already
  there after an interruption, hashed, and renamed only when its hash matches the manifest;
- a file already at the destination with the right size and hash is not downloaded again;
- `manifest.json` is written last, with a `.leantrain-staged` marker holding its hash: a destination with
  the marker is complete, and a later launch skips the copy when the remote manifest is unchanged.

Object-store credentials come from the environment as the fsspec backend reads them (s3fs: AWS_* variables).
The job files run `python -m leantrain.launch.staging URL DEST` once per node before training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from leantrain.data.shards import sha256_file
from leantrain.errors import CheckFailed, UserInputError

MANIFEST_NAME = "manifest.json"
MARKER_NAME = ".leantrain-staged"
CHUNK_BYTES = 8 << 20
EXTRA_FILES = ("report.json",)  # copied when present, not hash-checked (not read by training)


@dataclass(frozen=True)
class StageFile:
    """One file to copy: path relative to the data dir, expected hash and size (None when unknown)."""

    rel_path: str
    sha256: str | None
    num_bytes: int | None = None


@dataclass
class StagingResult:
    """What a staging call did."""

    dest: Path
    num_files: int = 0
    num_skipped: int = 0
    downloaded_bytes: int = 0
    resumed_from_bytes: int = 0
    up_to_date: bool = False
    files: list[str] = field(default_factory=list)


def is_remote(url: str | None) -> bool:
    """True for URLs with a non-local protocol (s3://, gs://, memory://, ...)."""
    if not url or "://" not in url:
        return False
    return url.split("://", 1)[0] not in ("file", "local")


def files_from_manifest(manifest: dict[str, Any]) -> list[StageFile]:
    """Every file training reads, with the hash the manifest gives it."""
    files: list[StageFile] = []
    tokenizer = manifest.get("tokenizer") or {}
    files.append(StageFile(Path(tokenizer.get("path") or "tokenizer.json").name, tokenizer.get("sha256")))
    for shard in manifest.get("shards", []):
        if "path" not in shard or "sha256" not in shard:
            raise UserInputError(f"manifest shard entry {shard!r} lacks path/sha256: not a leantrain data dir")
        files.append(StageFile(shard["path"], shard["sha256"], shard.get("num_bytes")))
        idx_path = str(Path(shard["path"]).with_suffix(".idx"))
        files.append(StageFile(idx_path, shard.get("idx_sha256")))
    return files


def _download(fs: Any, remote: str, dest: Path, expected: StageFile) -> tuple[bool, int, int]:
    """Copy one file, resuming a `.part` left by an interrupted copy; verify before publishing.
    Returns (skipped, bytes downloaded, bytes resumed from)."""
    if dest.exists() and (expected.num_bytes is None or dest.stat().st_size == expected.num_bytes) and (
        expected.sha256 is None or sha256_file(dest) == expected.sha256
    ):
        return True, 0, 0
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    downloaded = resumed = 0
    for attempt in range(2):
        offset = part.stat().st_size if part.exists() else 0
        if expected.num_bytes is not None and offset > expected.num_bytes:
            part.unlink()
            offset = 0
        resumed += offset
        with fs.open(remote, "rb") as src, open(part, "ab") as out:
            src.seek(offset)
            while chunk := src.read(CHUNK_BYTES):
                out.write(chunk)
                downloaded += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        if expected.sha256 is None or sha256_file(part) == expected.sha256:
            os.replace(part, dest)
            return False, downloaded, resumed
        part.unlink()  # a bad resume (remote changed) gets one clean retry
        if attempt == 1:
            raise CheckFailed(
                f"staging {remote}: sha256 does not match the manifest after a full download; the remote data "
                f"dir is corrupt or was changed while staging (expected {expected.sha256})"
            )
    raise AssertionError("unreachable: the loop returns or raises")


def stage_data(
    url: str, dest: Path, *, storage_options: dict[str, Any] | None = None, workers: int = 4, verify_all: bool = False
) -> StagingResult:
    """Copy the data dir at `url` to `dest`, verified against its manifest; resumable and idempotent."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    dest = Path(dest)
    result = StagingResult(dest=dest)
    manifest_remote = f"{root}/{MANIFEST_NAME}"
    if not fs.exists(manifest_remote):
        raise UserInputError(f"{url}/{MANIFEST_NAME} does not exist: data_url must point at a prepared data dir")
    manifest_bytes = fs.cat_file(manifest_remote)
    manifest_sha = hashlib.sha256(manifest_bytes).hexdigest()
    marker = dest / MARKER_NAME
    if not verify_all and marker.exists() and marker.read_text().strip() == manifest_sha:
        result.up_to_date = True
        return result
    dest.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    files = files_from_manifest(json.loads(manifest_bytes))
    files += [StageFile(name, None) for name in EXTRA_FILES if fs.exists(f"{root}/{name}")]
    result.num_files = len(files) + 1
    result.files = [f.rel_path for f in files] + [MANIFEST_NAME]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_download, fs, f"{root}/{f.rel_path}", dest / f.rel_path, f) for f in files]
        for future in futures:
            skipped, downloaded, resumed = future.result()
            result.num_skipped += skipped
            result.downloaded_bytes += downloaded
            result.resumed_from_bytes += resumed
    tmp = dest / f".{MANIFEST_NAME}.tmp"
    tmp.write_bytes(manifest_bytes)
    os.replace(tmp, dest / MANIFEST_NAME)
    marker.write_text(manifest_sha + "\n")
    return result


def ensure_local_data(spec: Any, *, dest: Path | None = None) -> StagingResult | None:
    """Stage `cluster.data_url` to `data.dir` (or `dest`) when the spec names a remote data dir; else None.
    The launcher calls this on every node before training starts."""
    url = spec.cluster.data_url
    if not url:
        return None
    options = {"endpoint_url": spec.cluster.data_endpoint_url} if spec.cluster.data_endpoint_url else {}
    return stage_data(url, Path(dest or spec.data.dir), storage_options=options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stage a prepared data dir to node-local disk (verified).")
    parser.add_argument("url")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--verify-all", action="store_true", help="Re-hash every file even if staged before.")
    args = parser.parse_args(argv)
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    try:
        if is_remote(args.url):  # a dead endpoint or a missing bucket: one line in seconds (ckpt/preflight.py)
            from leantrain.ckpt.preflight import probe_data_store

            probe_data_store(args.url, endpoint_url=args.endpoint_url)
        result = stage_data(args.url, args.dest, storage_options=options, verify_all=args.verify_all)
    except (UserInputError, CheckFailed) as err:
        print(f"staging failed: {err}")
        return err.exit_code
    state = "already staged" if result.up_to_date else (
        f"{result.num_files} files, {result.num_skipped} already present, {result.downloaded_bytes} bytes copied"
    )
    print(f"staged {args.url} -> {args.dest}: {state}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
