"""What identifies an input file for `prepare`'s fingerprint: its resolved path and its content.

The same file named by a relative or an absolute path, or rewritten with the same bytes (a builtin corpus
materialised again, a copy with a new mtime), is the same input, so a data dir built from it stays valid.
Content is a sha256 of the bytes. Hashing a large corpus on every `prepare` would read it all, so digests are
cached by (resolved path, size, mtime): a file is read again only when its stat changes. The cache is a
SQLite file ($LEANTRAIN_CACHE, default ~/.cache/leantrain/content-hashes.db); without a usable cache the
file is simply hashed. Object-store files keep the store's version (size and ETag, which S3 derives from
the content).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Any

from leantrain.data.inputs import file_version, is_url

CACHE_ENV = "LEANTRAIN_CACHE"
READ_CHUNK_BYTES = 8 * 2**20


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "leantrain" / "content-hashes.db")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _cached_sha256(path: Path, *, size: int, mtime_ns: int) -> str:
    key = (str(path), size, mtime_ns)
    try:
        target = cache_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(target, timeout=30) as db:
            db.execute("CREATE TABLE IF NOT EXISTS hashes (path TEXT, size INTEGER, mtime_ns INTEGER, "
                       "sha256 TEXT, PRIMARY KEY (path, size, mtime_ns))")
            row = db.execute("SELECT sha256 FROM hashes WHERE path=? AND size=? AND mtime_ns=?", key).fetchone()
            if row:
                return str(row[0])
            digest = _sha256(path)
            db.execute("DELETE FROM hashes WHERE path=?", (str(path),))
            db.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?)", (*key, digest))
            return digest
    except (OSError, sqlite3.Error):  # no writable cache here: hash without one
        return _sha256(path)


def content_version(path: str) -> list[Any]:
    """[resolved path, size, sha256] for a local file; the store's [url, size, ETag] for an object."""
    if is_url(path):
        return file_version(path)
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    return [str(resolved), stat.st_size, _cached_sha256(resolved, size=stat.st_size, mtime_ns=stat.st_mtime_ns)]
