"""Out-of-core duplicate resolution over the clean tasks' sorted hash files (datatrove/NeMo-Curator style).

Each clean task left, per hash space (the exact key, and each LSH band), its candidate documents' hashes
sorted on disk. A merge step takes one hash range of one space: from every task's sorted file it reads
only the slice inside the range (binary search on a memory map), sorts the slice together, and turns
every run of equal hashes into edges (first document of the run in input order → each other one). The
ranges split the 64-bit hash space evenly into ceil(records / `data.dedup.bucket_records`) parts, so one
step holds about `bucket_records` records whatever the corpus size; steps are independent tasks.
Band edges are verified: the two MinHash signatures (read back by memory map) must agree on at least
`data.dedup.verify_jaccard` of their values.

Resolution: a document with an exact-key edge from an earlier one is an exact duplicate; the verified
band edges are joined into clusters (connected components, vectorised union-find), and every document
but the first of its cluster in input order is a near duplicate. The edge files are joined one batch at a
time into a forest of one row per duplicate document, so memory here is 16 bytes per duplicate plus one
batch of edges, never all the edges. The decision is written per shard folder as `keep.npy` (0 keep, 1 exact
duplicate, 2 near duplicate).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from leantrain.data.dedup import Signatures, band_hashes
from leantrain.spec.schema import DedupSpec

HASH_SPACE = 1 << 64
VERIFY_BLOCK_EDGES = 1 << 13
MAX_HELD_FOLDERS = 8192  # up to 3 maps a folder (hashes, documents, signatures): 24,576, under vm.max_map_count
KEEP, EXACT_DUP, NEAR_DUP = 0, 1, 2


def write_hashes(out: Path, *, keys: list[bytes], signatures: Signatures, spec: DedupSpec) -> None:
    """One shard's hash files: exact keys sorted (`exact_keys.npy` + `exact_docs.npy`), the signatures
    (`sigs.npy`), and per band the band hashes sorted (`bands.npy` (bands, n) + `band_docs.npy`).

    The signatures are written and band-hashed block by block (`Signatures`), so beyond them this holds the
    (bands, n) band hashes and their order, not a stacked copy of every signature."""
    key_array = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2).astype(np.uint64)
    order = np.lexsort((key_array[:, 1], key_array[:, 0]))
    np.save(out / "exact_keys.npy", key_array[order])
    np.save(out / "exact_docs.npy", order.astype(np.uint32))
    del key_array, order
    bands, rows = spec.num_bands, spec.rows_per_band
    hashes = np.empty((bands, len(signatures)), dtype=np.uint64)
    with open(out / "sigs.npy", "wb") as f:  # the bytes np.save writes, one block at a time
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<u4", "fortran_order": False, "shape": (len(signatures), bands * rows)})
        start = 0
        for block in signatures.blocks():
            f.write(np.ascontiguousarray(block, dtype="<u4").tobytes())
            hashes[:, start : start + len(block)] = band_hashes(block, bands=bands, rows=rows).T
            start += len(block)
    band_order = np.argsort(hashes, axis=1, kind="stable")
    np.save(out / "bands.npy", np.take_along_axis(hashes, band_order, axis=1))
    del hashes
    np.save(out / "band_docs.npy", band_order.astype(np.uint32))


@dataclass(frozen=True)
class MergeStep:
    """One hash range [lo, hi) of one space ("exact" or "band07")."""

    space: str
    number: int
    lo: int
    hi: int

    @property
    def file_name(self) -> str:
        return f"{self.space}_{self.number:05d}.npy"


def plan_merges(spec: DedupSpec, *, num_records: int) -> list[MergeStep]:
    parts = max(1, math.ceil(num_records / spec.bucket_records))
    bounds = [i * HASH_SPACE // parts for i in range(parts)] + [HASH_SPACE]
    spaces = (["exact"] if spec.exact else []) + ([f"band{b:02d}" for b in range(spec.num_bands)] if spec.near
                                                  else [])
    return [MergeStep(space, i, bounds[i], bounds[i + 1]) for space in spaces for i in range(parts)]


def group_merges(steps: list[MergeStep], *, tasks: int) -> list[list[MergeStep]]:
    """Consecutive merge steps of one space, about `tasks` groups in all: one task runs a group with every task
    folder's files mapped once (`merge_steps`). One task per step opened every folder's files at every step:
    ceil(records / bucket_records) × folders × 2 opens per space, quadratic in the corpus (at a billion
    documents in 10,000 folders, 3,815 steps a space: 76 million opens of the shared file system per space)."""
    size = max(1, -(-len(steps) // max(1, tasks)))
    groups: list[list[MergeStep]] = []
    for step in steps:
        if groups and len(groups[-1]) < size and groups[-1][-1].space == step.space:
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


class HeldMaps:
    """The task folders' hash and signature files, memory-mapped once for a group of merge steps (or, past
    MAX_HELD_FOLDERS folders, at each use: a process may hold about 65,000 maps, vm.max_map_count)."""

    def __init__(self, *, hold: bool) -> None:
        self._hold = hold
        self._maps: dict[Path, np.ndarray] = {}

    def load(self, path: Path) -> np.ndarray:
        if not self._hold:
            return np.load(path, mmap_mode="r")
        if path not in self._maps:
            self._maps[path] = np.load(path, mmap_mode="r")
        return self._maps[path]


def merge_steps(group: list[MergeStep], folders: list[Path], offsets: np.ndarray, out_dir: Path, spec: DedupSpec
                ) -> list[dict[str, Any]]:
    """`merge_step` for each step of a group (`group_merges`), each folder's files mapped once for all of them."""
    maps = HeldMaps(hold=len(folders) <= MAX_HELD_FOLDERS)
    return [merge_step(step, folders, offsets, out_dir, spec, maps=maps) for step in group]


def _slice(sorted_hashes: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    start = int(np.searchsorted(sorted_hashes, np.uint64(lo), side="left"))
    end = len(sorted_hashes) if hi >= HASH_SPACE else int(np.searchsorted(sorted_hashes, np.uint64(hi), side="left"))
    return start, end


def _gather(step: MergeStep, folders: list[Path], offsets: np.ndarray, maps: HeldMaps
            ) -> tuple[list[np.ndarray], np.ndarray]:
    """The records of every task inside the step's range: sort columns (most significant first) and doc ids."""
    columns: list[list[np.ndarray]] = []
    docs: list[np.ndarray] = []
    for index, folder in enumerate(folders):
        if offsets[index + 1] == offsets[index]:
            continue
        if step.space == "exact":
            keys = maps.load(folder / "exact_keys.npy")  # (n, 2) sorted
            start, end = _slice(keys[:, 0], step.lo, step.hi)
            columns.append([np.array(keys[start:end, 0]), np.array(keys[start:end, 1])])
            local = maps.load(folder / "exact_docs.npy")[start:end]
        else:
            band = int(step.space[4:])
            hashes = maps.load(folder / "bands.npy")[band]
            start, end = _slice(hashes, step.lo, step.hi)
            columns.append([np.array(hashes[start:end])])
            local = maps.load(folder / "band_docs.npy")[band, start:end]
        docs.append(offsets[index] + np.asarray(local, dtype=np.int64))
    if not docs:
        width = 2 if step.space == "exact" else 1
        return [np.zeros(0, dtype=np.uint64)] * width, np.zeros(0, dtype=np.int64)
    return [np.concatenate(c) for c in zip(*columns, strict=True)], np.concatenate(docs)


def _run_edges(columns: list[np.ndarray], docs: np.ndarray) -> np.ndarray:
    """(m, 2) int64 edges: first doc of each run of equal hashes → every other doc of the run."""
    if len(docs) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    order = np.lexsort((docs, *reversed(columns)))
    docs = docs[order]
    new_run = np.zeros(len(docs), dtype=bool)
    new_run[0] = True
    for column in columns:
        sorted_column = column[order]
        new_run[1:] |= sorted_column[1:] != sorted_column[:-1]
    first = docs[new_run][np.cumsum(new_run) - 1]
    return np.stack([first[~new_run], docs[~new_run]], axis=1)


def _signatures(docs: np.ndarray, folders: list[Path], offsets: np.ndarray, maps: HeldMaps) -> np.ndarray:
    owner = np.searchsorted(offsets, docs, side="right") - 1
    out: np.ndarray | None = None
    for index in np.unique(owner):
        sigs = maps.load(folders[index] / "sigs.npy")
        if out is None:
            out = np.empty((len(docs), sigs.shape[1]), dtype=np.uint32)
        mask = owner == index
        out[mask] = sigs[docs[mask] - offsets[index]]
    assert out is not None
    return out


def merge_step(step: MergeStep, folders: list[Path], offsets: np.ndarray, out_dir: Path, spec: DedupSpec, *,
               maps: HeldMaps) -> dict[str, Any]:
    """Edges of one hash range, verified for bands; written to `out_dir/<space>_<n>.npy`."""
    final = out_dir / step.file_name
    if final.is_file():
        edges = np.load(final)
        return {"records": -1, "edges": len(edges), "candidates": -1, "rejected": -1}
    out_dir.mkdir(parents=True, exist_ok=True)
    columns, docs = _gather(step, folders, offsets, maps)
    edges = _run_edges(columns, docs)
    candidates, rejected = len(edges), 0
    if step.space != "exact" and len(edges) and spec.verify_jaccard > 0:
        kept = []
        for i in range(0, len(edges), VERIFY_BLOCK_EDGES):
            block = edges[i : i + VERIFY_BLOCK_EDGES]
            left = _signatures(block[:, 0], folders, offsets, maps)
            right = _signatures(block[:, 1], folders, offsets, maps)
            kept.append(block[np.mean(left == right, axis=1) >= spec.verify_jaccard])
        edges = np.concatenate(kept)
        rejected = candidates - len(edges)
    tmp = out_dir / (step.file_name + ".tmp.npy")
    np.save(tmp, edges)
    os.replace(tmp, final)
    return {"records": len(docs), "edges": len(edges), "candidates": candidates, "rejected": rejected}


def _components(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, smallest node of each one's connected component), by min-label propagation + pointer jumping."""
    nodes = np.unique(edges)
    if len(nodes) == 0:
        return nodes, nodes
    a, b = np.searchsorted(nodes, edges[:, 0]), np.searchsorted(nodes, edges[:, 1])
    label = np.arange(len(nodes))
    while True:
        low = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, low)
        np.minimum.at(new, b, low)
        new = new[new]  # pointer jumping: follow labels to their own label
        if np.array_equal(new, label):
            break
        label = new
    return nodes, nodes[label]


def _exact_duplicates(steps: list[MergeStep], edge_dir: Path) -> np.ndarray:
    """Sorted documents with an exact-key edge from an earlier one. Edge files are merged in batches that grow
    with the result (each at least as large as the duplicates so far), so the sorting stays O(n log n) in all:
    a merge per file re-sorted every duplicate found so far, once per file (quadratic in the corpus)."""
    dups = np.zeros(0, dtype=np.int64)
    batch: list[np.ndarray] = []
    pending = 0
    for step in steps:
        if step.space == "exact":
            batch.append(np.load(edge_dir / step.file_name)[:, 1])
            pending += len(batch[-1])
            if pending >= max(len(dups), 1 << 20):
                dups, batch, pending = np.unique(np.concatenate([dups, *batch])), [], 0
    return np.unique(np.concatenate([dups, *batch])).astype(np.int64, copy=False)


def _near_forest(steps: list[MergeStep], edge_dir: Path, *, batch_edges: int) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, their smallest cluster member) for every document that is not first in its near cluster.

    The band edge files are read one at a time and joined in batches: the components of (forest so far +
    a batch of edges) are those of all edges so far, and the forest keeps one (node, root) row per
    non-first member, so memory is the duplicates plus one batch (at least `batch_edges` edges, or the
    forest's size), never all edges."""
    forest = np.zeros((0, 2), dtype=np.int64)
    batch: list[np.ndarray] = []
    pending = 0
    files = [s for s in steps if s.space != "exact"]
    for number, step in enumerate(files):
        batch.append(np.load(edge_dir / step.file_name))
        pending += len(batch[-1])
        if pending >= max(batch_edges, len(forest)) or number == len(files) - 1:
            nodes, roots = _components(np.concatenate([forest, *batch]))
            later = roots != nodes
            forest = np.stack([nodes[later], roots[later]], axis=1)
            batch, pending = [], 0
    return forest[:, 0], forest[:, 1]


def resolve(steps: list[MergeStep], folders: list[Path], offsets: np.ndarray, edge_dir: Path, *,
            batch_edges: int = 1 << 16) -> dict[str, int]:
    """Write every shard's `keep.npy` from the merged edges; returns duplicate counts. Memory: the duplicate
    documents and one batch of edge files (`_near_forest`), not all edges."""
    exact_dups = _exact_duplicates(steps, edge_dir)
    members, _ = _near_forest(steps, edge_dir, batch_edges=batch_edges)
    near_dups = np.setdiff1d(members, exact_dups)
    for index, folder in enumerate(folders):
        lo, hi = int(offsets[index]), int(offsets[index + 1])
        decision = np.full(hi - lo, KEEP, dtype=np.uint8)
        for dups, code in ((exact_dups, EXACT_DUP), (near_dups, NEAR_DUP)):  # both sorted
            mine = dups[np.searchsorted(dups, lo) : np.searchsorted(dups, hi)]
            decision[mine - lo] = code
        tmp = folder / "keep.tmp.npy"
        np.save(tmp, decision)
        os.replace(tmp, folder / "keep.npy")
    return {"exact_duplicates": len(exact_dups), "near_duplicates": len(near_dups)}


def deduplicate(texts: Iterable[str], *, spec: DedupSpec, work: Path, shard_docs: int = 100_000
                ) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Exact + near dedup of a stream of texts, out of core, in this process (the pipeline runs the same
    steps as parallel tasks): texts are hashed `shard_docs` at a time into shard folders under `work`,
    merged hash range by hash range, and resolved. Returns the decision per text (KEEP, EXACT_DUP,
    NEAR_DUP) and the merge steps' counters (records held, edges, candidates, rejected)."""
    from leantrain.data.clean import text_stats
    from leantrain.data.dedup import MinHasher, exact_key

    hasher = MinHasher(num_perm=spec.num_bands * spec.rows_per_band, seed=spec.seed,
                       shingle_words=spec.shingle_words, shingle_chars=spec.shingle_chars,
                       normalize_numbers=spec.normalize_numbers)
    folders: list[Path] = []
    counts = [0]
    iterator = iter(texts)
    while True:
        keys: list[bytes] = []
        signatures = Signatures(hasher.num_perm)
        for text in islice(iterator, shard_docs):
            stats = text_stats(text)
            keys.append(exact_key(stats))
            signatures.append(hasher.signature(hasher.shingles(stats.words, cjk=stats.cjk_share >= 0.5)))
        if not keys:
            break
        folders.append(work / f"shard{len(folders):06d}")
        folders[-1].mkdir(parents=True, exist_ok=True)
        write_hashes(folders[-1], keys=keys, signatures=signatures, spec=spec)
        counts.append(counts[-1] + len(keys))
    offsets = np.asarray(counts, dtype=np.int64)
    steps = plan_merges(spec, num_records=int(offsets[-1]))
    merged = merge_steps(steps, folders, offsets, work / "edges", spec)
    resolve(steps, folders, offsets, work / "edges")
    decisions = [np.load(folder / "keep.npy") for folder in folders]
    return (np.concatenate(decisions) if decisions else np.zeros(0, dtype=np.uint8)), merged
