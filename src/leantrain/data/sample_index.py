"""The sampler's document index, built once per data dir and memory-mapped by every rank.

The sampler needs, per (split, source), where each document lies: its shard, its first token and its length.
Read from the shards' `.idx` files, that is one open of every index file on every rank at startup (32,768
opens on 4,096 ranks for 8 shards each) and the same arrays in every rank's memory. Instead, as Megatron's
GPTDataset caches its document and sample indices as `.npy` files next to the data and memory-maps them
(megatron/core/datasets/gpt_dataset.py, `_build_document_sample_shuffle_indices`), the data dir holds
`index/<split>-<fingerprint>.npy` per source: an int64 array (3, documents) = (shard number within the
source's shard list, first token, length). The fingerprint is a hash of the source's shard hashes, so a data
dir prepared again gets a new file and a stale one is never read. Beside it, `<split>-<fingerprint>.buckets.npy`
holds the token total of each fixed bucket of 1,024 documents (`data.shuffle`): what an epoch's order sums,
so that no rank reads every document's length (8 GB at a billion documents) at each epoch.

`prepare` (every writer of a manifest) writes the index; a data dir without one (written by an older version)
gets it from the first process that needs it (the trainer's rank 0 before the other ranks open it), written
atomically; a read-only data dir falls back to building it in memory, from every `.idx` file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from leantrain.data.shards import ShardIndex, ShardInfo, read_index
from leantrain.data.shuffle import BLOCK_DOCS, bucket_totals

if TYPE_CHECKING:  # the manifest's writer calls this module: no import back at run time
    from leantrain.data.layout import Manifest

INDEX_DIR = "index"


def index_path(data_dir: Path, *, split: str, shards: list[ShardInfo]) -> Path:
    """Where the index of one source's shards lives (named by their hashes and paths)."""
    digest = hashlib.sha256("\n".join(f"{s.path} {s.sha256}" for s in shards).encode()).hexdigest()[:20]
    return Path(data_dir) / INDEX_DIR / f"{split}-{digest}.npy"


def _shard_indices(data_dir: Path, shards: list[ShardInfo]) -> list[ShardIndex]:
    return [read_index((Path(data_dir) / shard.path).with_suffix(".idx")) for shard in shards]


def _fill(out: np.ndarray, indices: list[ShardIndex]) -> np.ndarray:
    """Write the rows (shard number, first token, length) of every shard's documents into `out` (3, documents)."""
    start = 0
    for number, index in enumerate(indices):
        count = len(index.sequence_lengths)
        out[0, start:start + count] = number
        out[1, start:start + count] = index.sequence_pointers // np.dtype(index.dtype).itemsize
        out[2, start:start + count] = index.sequence_lengths
        start += count
    return out


def build_index(data_dir: Path, shards: list[ShardInfo]) -> np.ndarray:
    """(3, documents) int64 from the shards' `.idx` files, in memory: shard number, first token, length."""
    indices = _shard_indices(data_dir, shards)
    return _fill(np.empty((3, sum(len(i.sequence_lengths) for i in indices)), np.int64), indices)


def write_index(data_dir: Path, *, split: str, shards: list[ShardInfo]) -> Path:
    """Build and write one source's index (atomically: a reader sees the old file or the whole new one).

    Written shard by shard with plain writes into a `.npy` sized from the `.idx` headers: one shard's index is
    open at a time and nothing is memory-mapped for writing, so memory stays one shard's documents whatever
    the corpus (a billion documents are 24 GB of index on disk, not in memory)."""
    path = index_path(data_dir, split=split, shards=shards)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    idx_paths = [(Path(data_dir) / shard.path).with_suffix(".idx") for shard in shards]
    counts = [len(read_index(idx).sequence_lengths) for idx in idx_paths]  # the header only: nothing is read
    total = sum(counts)
    with open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (3, total)})
        base = f.tell()
        f.truncate(base + 3 * 8 * total)
        start = 0
        for number, (idx, count) in enumerate(zip(idx_paths, counts, strict=True)):
            index = read_index(idx)
            rows = (np.full(count, number, np.int64), index.sequence_pointers // np.dtype(index.dtype).itemsize,
                    index.sequence_lengths)
            for row, values in enumerate(rows):
                f.seek(base + 8 * (row * total + start))
                f.write(np.asarray(values, dtype="<i8").tobytes())
            start += count
            del index, rows
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    write_buckets(path)
    return path


def buckets_path(index_file: Path) -> Path:
    """Where the bucket totals of an index live: beside it, named after it (`<split>-<hash>.buckets.npy`)."""
    return index_file.with_name(index_file.name.removesuffix(".npy") + ".buckets.npy")


def write_buckets(index_file: Path) -> Path:
    """The index's bucket totals (`data.shuffle.bucket_totals`: the tokens of each fixed bucket of 1,024
    documents), written atomically beside it: what an epoch's order sums instead of every document's length."""
    try:
        index = np.load(index_file, mmap_mode="r")
    except ValueError:  # an index of no documents cannot be mapped
        index = np.zeros((3, 0), np.int64)
    path = buckets_path(index_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, bucket_totals(index[2]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_sample_index(data_dir: Path, manifest: Manifest) -> None:
    """Every (split, source) index of a data dir, and no stale one beside them (what a manifest writer calls)."""
    data_dir = Path(data_dir)
    keep = set()
    for split in sorted({s.split for s in manifest.shards}):
        for name in manifest.source_names:
            shards = manifest.shards_for(split=split, source=name)
            if shards:
                keep.add(write_index(data_dir, split=split, shards=shards).name)
    keep |= {buckets_path(Path(name)).name for name in keep}
    for old in (data_dir / INDEX_DIR).glob("*.npy") if (data_dir / INDEX_DIR).is_dir() else ():
        if old.name not in keep:
            old.unlink(missing_ok=True)


def ensure_sample_index(data_dir: Path, manifest: Manifest, *, split: str) -> bool:
    """Write the indices of `split` that are missing (the trainer's rank 0, before the others read them).
    Returns False when the data dir cannot be written (the readers then build theirs in memory)."""
    try:
        for name in manifest.source_names:
            shards = manifest.shards_for(split=split, source=name)
            path = index_path(data_dir, split=split, shards=shards)
            if shards and not path.is_file():
                write_index(data_dir, split=split, shards=shards)
            elif shards and not buckets_path(path).is_file():  # an index written before the buckets were
                write_buckets(path)
    except OSError:
        return False
    return True


def load_buckets(data_dir: Path, *, split: str, shards: list[ShardInfo], index: np.ndarray) -> np.ndarray:
    """One source's bucket totals (`data.shuffle`): from the data dir, else computed from `index` (every length
    read: a read-only data dir prepared before the totals were written)."""
    path = buckets_path(index_path(data_dir, split=split, shards=shards))
    blocks = -(-index.shape[1] // BLOCK_DOCS)
    if path.is_file():
        try:
            totals = np.load(path)
        except ValueError:
            totals = None
        if totals is not None and totals.shape == (blocks,) and totals.dtype == np.int64:
            return totals
    return bucket_totals(index[2])


def load_index(data_dir: Path, *, split: str, shards: list[ShardInfo]) -> np.ndarray:
    """One source's (3, documents) index: memory-mapped from the data dir, else built in memory."""
    path = index_path(data_dir, split=split, shards=shards)
    if path.is_file():
        try:
            index = np.load(path, mmap_mode="r")
        except ValueError:  # an index of no documents cannot be mapped
            index = None
        if index is not None and index.ndim == 2 and index.shape[0] == 3 and index.dtype == np.int64:
            return index
    return build_index(data_dir, shards)
