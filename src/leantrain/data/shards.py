"""Token shards in Megatron-LM's IndexedDataset layout: `<prefix>.bin` (tokens) + `<prefix>.idx` (index).

Why this layout: existing tools (Megatron-LM, NeMo, their converters and inspectors) read it, and it is a
plain memory-mappable array with an index of document boundaries, so the loader does no per-token work.

Byte layout of the `.idx` file (little endian), as written by megatron-core's `_IndexWriter`:

    9 bytes  b"MMIDIDX\\x00\\x00"            magic
    u64      1                               version
    u8       dtype code                      1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    u64      sequence_count                  one sequence per document here
    u64      document_count                  len(document_indices) = sequence_count + 1
    i32[sequence_count]   sequence_lengths   tokens per sequence
    i64[sequence_count]   sequence_pointers  byte offset of each sequence in the .bin
    i64[document_count]   document_indices   0, then the sequence index where each document ends

The `.bin` is the tokens of all sequences back to back in that dtype. Each of our documents ends with EOS.
Writes are atomic: both files go to `*.tmp`, are fsynced and renamed (`.bin` first, then `.idx`), so an
`.idx` on disk always has its complete `.bin`.
"""

from __future__ import annotations

import array
import hashlib
import io
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from leantrain.errors import UserInputError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[type[np.number], int] = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
TOKEN_DTYPES = tuple(np.dtype(t).name for t in DTYPE_CODES if np.issubdtype(t, np.integer))  # what ids can be in
_FIXED_HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 when every id fits (Megatron's own cut-off, < 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def sha256_file(path: Path, *, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read into one reused buffer (`f.read` in a loop held two chunks at a time)."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(chunk_bytes))
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(buffer[:count])
    return digest.hexdigest()


def _fsync_rename(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a small file via temp + fsync + rename so readers never see half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    _fsync_rename(tmp, path)


_SHARD_KEY_TYPES = {"path": str, "split": str, "source": str, "sha256": str, "idx_sha256": str, "num_tokens": int,
                    "num_docs": int, "num_bytes": int, "max_token_id": int}
_OPTIONAL_SHARD_KEYS = {"max_token_id"}  # not recorded by older versions


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records about one finished shard (paths relative to the data dir)."""

    path: str  # the .bin file; the .idx sits beside it
    split: str
    source: str
    sha256: str  # of the .bin
    idx_sha256: str
    num_tokens: int
    num_docs: int
    num_bytes: int
    max_token_id: int | None = None  # the largest token id in the shard (None: written before it was recorded)

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v is not None or k not in _OPTIONAL_SHARD_KEYS}

    @staticmethod
    def from_json(raw: object) -> ShardInfo:
        """A shard entry as `to_json` wrote it; a missing, unknown or mistyped key is a TypeError naming it."""
        if not isinstance(raw, dict):
            raise TypeError(f"expected an object with keys {sorted(_SHARD_KEY_TYPES)}, got {type(raw).__name__}")
        missing = sorted(set(_SHARD_KEY_TYPES) - _OPTIONAL_SHARD_KEYS - set(raw))
        unknown = sorted(set(raw) - set(_SHARD_KEY_TYPES))
        if missing or unknown:
            raise TypeError(f"missing keys {missing}" if missing else f"unknown keys {unknown}")
        for key, value in raw.items():
            kind = _SHARD_KEY_TYPES[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise TypeError(f"key {key!r}: expected a whole number ≥ 0, got {value!r:.40}")
            if kind is str and not isinstance(value, str):
                raise TypeError(f"key {key!r}: expected a string, got {value!r:.40}")
        return ShardInfo(**raw)


def check_token_file(bin_path: Path, *, dtype: np.dtype, num_tokens: int) -> int:
    """The size of a shard's `.bin` after one stat (nothing is read); a missing file, or one whose size is not
    `num_tokens` (the manifest's count) in `dtype` (truncated, replaced, or the manifest's dtype is wrong), is a
    user error naming the file."""
    itemsize = np.dtype(dtype).itemsize
    try:
        size = os.stat(bin_path).st_size
    except FileNotFoundError:
        raise UserInputError(f"{bin_path}: listed in the data dir's manifest.json but missing; restore it or re-run "
                             "`leantrain prepare`") from None
    if size != num_tokens * itemsize:
        raise UserInputError(
            f"{bin_path}: {size:,} bytes, expected {num_tokens * itemsize:,} (manifest.json lists {num_tokens:,} "
            f"tokens of dtype {np.dtype(dtype).name}, {itemsize} bytes each); the shard is truncated or is not the "
            "one the manifest describes: re-run `leantrain prepare`")
    return size


def map_tokens(bin_path: Path, *, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    """A shard's tokens, memory-mapped after `check_token_file`'s stat."""
    size = check_token_file(bin_path, dtype=dtype, num_tokens=num_tokens)
    return np.memmap(bin_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)


class ShardWriter:
    """Append documents (token arrays, EOS included) to one shard; `finish` publishes it atomically."""

    def __init__(self, prefix: Path, *, dtype: type[np.number]) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self.bin_path = prefix.with_suffix(".bin")
        self.idx_path = prefix.with_suffix(".idx")
        self._bin_tmp = prefix.with_suffix(".bin.tmp")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        self._lengths = array.array("q")  # 8 bytes per document (a list of ints took 36)
        self.num_tokens = 0
        self.max_token_id: int | None = None  # recorded in the manifest: the trainer checks it against the model

    def add(self, tokens: np.ndarray) -> None:
        source = np.asarray(tokens)
        if source.size:  # the largest id before the cast: an id the dtype cannot hold is refused, never wrapped
            top = int(source.max())
            if top > np.iinfo(self.dtype).max:
                raise ValueError(f"{self.bin_path}: token id {top} does not fit the shard's {self.dtype.name}")
            self.max_token_id = top if self.max_token_id is None else max(self.max_token_id, top)
        values = source.astype(self.dtype, copy=False)
        self._file.write(values.tobytes(order="C"))
        self._lengths.append(int(values.size))
        self.num_tokens += int(values.size)

    @property
    def num_docs(self) -> int:
        return len(self._lengths)

    def finish(self) -> tuple[str, str, int]:
        """Publish .bin then .idx; returns (bin sha256, idx sha256, bin bytes)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._bin_tmp, self.bin_path)
        idx_tmp = self.prefix.with_suffix(".idx.tmp")
        with open(idx_tmp, "wb") as f:
            write_index(f, np.frombuffer(self._lengths, dtype=np.int64), dtype=self.dtype.type)
        _fsync_rename(idx_tmp, self.idx_path)
        return sha256_file(self.bin_path), sha256_file(self.idx_path), self.bin_path.stat().st_size

    def abort(self) -> None:
        self._file.close()
        self._bin_tmp.unlink(missing_ok=True)


def write_index(f: BinaryIO, lengths: np.ndarray, *, dtype: type[np.number]) -> None:
    """Write the .idx of documents of these token lengths (one sequence per document) to `f`, section by
    section: beyond `lengths` this holds one section (8 bytes per document), never the whole file's bytes."""
    itemsize = np.dtype(dtype).itemsize
    count = len(lengths)
    f.write(INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[np.dtype(dtype).type])
            + struct.pack("<Q", count) + struct.pack("<Q", count + 1))
    f.write(np.asarray(lengths, dtype="<i4").tobytes())
    pointers = np.zeros(count, dtype="<i8")
    if count > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    f.write(pointers.tobytes())
    del pointers
    f.write(np.arange(count + 1, dtype="<i8").tobytes())


def encode_index(lengths: np.ndarray, *, dtype: type[np.number]) -> bytes:
    """The .idx bytes for documents of these token lengths, one sequence per document."""
    out = io.BytesIO()
    write_index(out, np.asarray(lengths, dtype=np.int64), dtype=dtype)
    return out.getvalue()


@dataclass(frozen=True)
class ShardIndex:
    """The decoded .idx: per-sequence lengths and byte pointers, and the document boundaries."""

    dtype: type[np.number]
    sequence_lengths: np.ndarray  # (num_sequences,) int32
    sequence_pointers: np.ndarray  # (num_sequences,) int64, bytes
    document_indices: np.ndarray  # (num_docs + 1,) int64


def read_index(idx_path: Path) -> ShardIndex:
    """Parse an .idx file; a wrong magic/version is reported with the file name."""
    with open(idx_path, "rb") as f:
        head = f.read(_FIXED_HEADER_BYTES)
    if len(head) < _FIXED_HEADER_BYTES or head[:9] != INDEX_HEADER:
        raise ValueError(f"{idx_path}: not a Megatron IndexedDataset index (missing MMIDIDX header)")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_path}: index version {version}, expected {INDEX_VERSION}")
    dtype = CODE_DTYPES[head[17]]
    num_sequences, num_doc_indices = struct.unpack("<QQ", head[18:34])
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    offset = _FIXED_HEADER_BYTES
    lengths = np.frombuffer(raw, dtype=np.int32, count=num_sequences, offset=offset)
    offset += 4 * num_sequences
    pointers = np.frombuffer(raw, dtype=np.int64, count=num_sequences, offset=offset)
    offset += 8 * num_sequences
    documents = np.frombuffer(raw, dtype=np.int64, count=num_doc_indices, offset=offset)
    return ShardIndex(dtype=dtype, sequence_lengths=lengths, sequence_pointers=pointers, document_indices=documents)


class ShardReader:
    """Memory-mapped read access to one shard: documents by index, token offsets for the sampler."""

    def __init__(self, bin_path: Path) -> None:
        self.bin_path = bin_path
        self.index = read_index(bin_path.with_suffix(".idx"))
        itemsize = np.dtype(self.index.dtype).itemsize
        size = bin_path.stat().st_size
        self.tokens = (
            np.memmap(bin_path, dtype=self.index.dtype, mode="r") if size else np.zeros(0, dtype=self.index.dtype)
        )
        self.doc_starts = (self.index.sequence_pointers // itemsize).astype(np.int64)  # token offsets
        self.doc_lengths = self.index.sequence_lengths.astype(np.int64)

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    def doc(self, i: int) -> np.ndarray:
        start = int(self.doc_starts[i])
        return self.tokens[start : start + int(self.doc_lengths[i])]
