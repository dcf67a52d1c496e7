"""Input files: listing local folders or object stores (`s3://…` through fsspec) and opening them as
byte streams, with .gz/.zst decompressed on the fly and checked.

A compressed file that is truncated, corrupt or not what its suffix says raises `BadInputError` naming
the file and the compressed byte offset where decoding failed (and how many decompressed bytes came
before), never a silent early end: gzip's own reader raises EOFError on truncation (which the CLI used to
take for Ctrl-D), and zstandard's stream reader simply stops at a truncated frame. Here the zstd frames
are decoded with a decompress object whose `eof` flag says whether the last frame was complete.
Corruption inside a zstd frame is found when the frame carries a content checksum (the `zstd` tool writes
one by default); without one, damaged bytes decode to damaged text, which the readers then count as
broken rows (`broken_json`, `invalid_utf8`).
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import IO, Any

from leantrain.errors import UserInputError

COMPRESSED = (".gz", ".zst")
READ_CHUNK_BYTES = 1 << 20
ZSTD_CHUNK_BYTES = 1 << 16  # compressed bytes fed per step: an error's offset is exact to this


class BadInputError(UserInputError):
    """A file that cannot be read to its end: names the file, the offset and what was wrong."""

    def __init__(self, path: str, *, offset: int, decompressed: int, problem: str, message: str | None = None,
                 line: int | None = None) -> None:
        self.path, self.offset, self.decompressed, self.problem = path, offset, decompressed, problem
        self.message = message
        self.line = line  # the first line not read (line-based files), set by the reader that met the damage
        super().__init__(message or f"{path}: {problem} at compressed byte {offset:,} (after {decompressed:,} "
                         "decompressed bytes); fix or remove the file, or set data.on_bad_input: skip to skip such "
                         "files")

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process and Ray task boundaries intact
        return (_rebuild_bad_input, (self.path, self.offset, self.decompressed, self.problem, self.message,
                                     self.line))

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.path, "offset": self.offset, "decompressed_bytes": self.decompressed,
               "problem": self.problem}
        return out if self.line is None else {**out, "line": self.line}


def _rebuild_bad_input(path: str, offset: int, decompressed: int, problem: str, message: str | None = None,
                       line: int | None = None) -> BadInputError:
    return BadInputError(path, offset=offset, decompressed=decompressed, problem=problem, message=message, line=line)


def is_url(path: str | Path) -> bool:
    return "://" in str(path)


def _filesystem(path: str) -> tuple[Any, str]:
    import fsspec

    fs, _, (root,) = fsspec.get_fs_token_paths(path)
    return fs, root


def base_suffix(name: str) -> str:
    """The suffix under any compression suffix: `a.jsonl.zst` → `.jsonl`."""
    for comp in COMPRESSED:
        if name.endswith(comp):
            name = name[: -len(comp)]
    return Path(name).suffix.lower()


def list_files(path: str | Path, *, suffixes: tuple[str, ...] | None = None) -> list[str] | None:
    """Files under a folder or prefix (recursive, sorted, hidden names skipped) with one of `suffixes`
    (optionally compressed; None: every file); `[path]` for a single file; None when nothing exists there."""
    if not is_url(path):
        local = Path(path)
        if local.is_file():
            return [str(local)]
        if not local.is_dir():
            return None
        return sorted(str(p) for p in local.rglob("*") if p.is_file() and not _hidden(p.relative_to(local).parts)
                      and (suffixes is None or base_suffix(p.name) in suffixes))
    fs, root = _filesystem(str(path))
    protocol = str(path).split("://", 1)[0]
    if fs.isfile(root):
        return [str(path)]
    if not fs.isdir(root):
        return None
    found = sorted(fs.find(root))
    prefix = root.rstrip("/") + "/"
    return [f"{protocol}://{name}" for name in found if not _hidden(name[len(prefix):].split("/"))
            and (suffixes is None or base_suffix(name.rsplit("/", 1)[-1]) in suffixes)]


def _hidden(parts: tuple[str, ...] | list[str]) -> bool:
    return any(part.startswith((".", "_")) for part in parts)


def file_size(path: str) -> int:
    if not is_url(path):
        return Path(path).stat().st_size
    fs, root = _filesystem(path)
    return int(fs.size(root))


def file_version(path: str) -> list[Any]:
    """What identifies the file's content for the resume fingerprint: size and mtime (or the store's ETag)."""
    if not is_url(path):
        stat = Path(path).stat()
        return [path, stat.st_size, stat.st_mtime_ns]
    fs, root = _filesystem(path)
    info = fs.info(root)
    return [path, info.get("size"), str(info.get("ETag") or info.get("LastModified") or info.get("mtime"))]


def open_raw(path: str) -> IO[bytes]:
    """The file's bytes as stored (no decompression)."""
    if not is_url(path):
        return open(path, "rb")  # noqa: SIM115 - caller closes
    fs, root = _filesystem(path)
    return fs.open(root, "rb")  # type: ignore[no-any-return]


class _CheckedDecoder(io.RawIOBase):
    """Decompressed bytes of a .gz or .zst file; any decoding failure or early end is a BadInputError."""

    def __init__(self, path: str, *, kind: str) -> None:
        self._path, self._kind = path, kind
        self._raw = open_raw(path)
        self._gzip = gzip.GzipFile(fileobj=self._raw, mode="rb") if kind == "gz" else None
        self._zstd: Any = None
        self._pending = b""
        self._frames = 0
        self.decompressed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._read_gzip(len(buffer)) if self._gzip is not None else self._read_zstd(len(buffer))
        except BadInputError:
            raise
        except (EOFError, OSError, zlib.error, ValueError) as err:
            raise self._bad(f"{self._kind} data is truncated or corrupt ({type(err).__name__}: {err})") from None
        except Exception as err:  # zstandard.ZstdError: a corrupt frame or not zstd at all
            if type(err).__name__ != "ZstdError":
                raise
            raise self._bad(f"not valid zstd data ({err})") from None
        buffer[: len(data)] = data
        self.decompressed += len(data)
        return len(data)

    def _read_gzip(self, size: int) -> bytes:
        assert self._gzip is not None
        # read1: one step of the decoder; read(size) loops until `size` bytes and loses what it decoded
        # when the stream breaks off (a truncated file would keep nothing before the cut)
        return self._gzip.read1(size)

    def _read_zstd(self, size: int) -> bytes:
        import zstandard

        while not self._pending:
            rest = b""
            if self._zstd is not None and self._zstd.eof:  # a frame ended: the next one may follow
                rest, self._zstd = self._zstd.unused_data, None
                self._frames += 1
            chunk = rest or self._raw.read(ZSTD_CHUNK_BYTES)
            if not chunk:
                if self._zstd is not None:
                    raise self._bad("zstd data is truncated (the last frame has no end)")
                if self._frames == 0:
                    raise self._bad("zstd file holds no complete frame")
                return b""
            if self._zstd is None:
                self._zstd = zstandard.ZstdDecompressor().decompressobj()
            self._pending = self._zstd.decompress(chunk)
        data, self._pending = self._pending[:size], self._pending[size:]
        return data

    def _bad(self, problem: str) -> BadInputError:
        try:
            offset = self._raw.tell()
        except (OSError, ValueError):
            offset = -1
        return BadInputError(self._path, offset=offset, decompressed=self.decompressed, problem=problem)

    def close(self) -> None:
        if self._gzip is not None:
            self._gzip.close()
        self._raw.close()
        super().close()


def open_binary(path: str) -> IO[bytes]:
    """A buffered byte stream of the file's content, decompressed and checked for .gz/.zst."""
    name = path.rsplit("/", 1)[-1]
    for suffix, kind in ((".gz", "gz"), (".zst", "zst")):
        if name.endswith(suffix):
            return io.BufferedReader(_CheckedDecoder(path, kind=kind), buffer_size=READ_CHUNK_BYTES)
    if is_url(path):  # fsspec's own readline has no size limit: readers bound each line (readline(n))
        return io.BufferedReader(open_raw(path), buffer_size=READ_CHUNK_BYTES)  # type: ignore[arg-type]
    return open_raw(path)
