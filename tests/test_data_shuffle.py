"""The sampler's epoch order (data.shuffle): a bijection at every size, offsets that match the full cumulative
sum, and neither a per-document array kept nor every length read per epoch (the brief's rules: no memory that
grows with the corpus, no per-rank read of shared files)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from leantrain.data.sampler import SourceStream
from leantrain.data.shuffle import BLOCK_DOCS, EpochOrder, KeyedPermutation, bucket_totals


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 1024, 1025, 4099, 70_001])
def test_every_size_gets_a_permutation(n: int) -> None:
    perm = KeyedPermutation(n, [7, 11, 0])
    assert np.array_equal(np.sort(perm(np.arange(n))), np.arange(n))


def test_the_key_decides_the_order_and_the_order_is_shuffled() -> None:
    n = 100_000
    a, b = (KeyedPermutation(n, [3, 5, epoch])(np.arange(n)) for epoch in (0, 1))
    assert np.array_equal(a, KeyedPermutation(n, [3, 5, 0])(np.arange(n)))  # same key, same order
    assert np.mean(a == b) < 0.001  # another epoch: another order
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.02  # positions and documents are not related
    assert np.mean(np.abs(np.diff(a)) == 1) < 0.001  # neighbours in the order are not neighbours in the corpus
    assert abs(np.sum(a == np.arange(n)) - 1) < 10  # about one fixed point, as a uniform permutation has


def _epoch(lengths: np.ndarray, epoch: int = 0) -> EpochOrder:
    return EpochOrder(lengths, bucket_totals(lengths), [1, 2, epoch])


@pytest.mark.parametrize("n", [1, 7, BLOCK_DOCS, 5 * BLOCK_DOCS + 37])
def test_an_epoch_is_a_permutation_and_its_offsets_match_the_full_cumulative_sum(n: int) -> None:
    lengths = np.random.default_rng(0).integers(1, 500, n)
    epoch = _epoch(lengths)
    order = epoch.order()
    assert np.array_equal(np.sort(order), np.arange(n))
    ends = np.cumsum(lengths[order])
    offsets = [0, int(ends[-1]) - 1, *np.random.default_rng(1).integers(0, ends[-1], 200).tolist()]
    offsets += [int(e) for e in ends[BLOCK_DOCS - 1 : BLOCK_DOCS + 1] if e < ends[-1]]  # across a bucket's end
    for offset in offsets:
        block, pos = epoch.find(offset)
        docs, block_ends = epoch.block(block)
        position = block * BLOCK_DOCS + pos
        assert docs[pos] == order[position] and block_ends[pos] == ends[position]
        assert ends[position] > offset >= ends[position] - lengths[order[position]]


def test_epochs_mix_the_corpus_within_a_window_and_reorder_everything() -> None:
    """A bucket is a random sample of the corpus (documents far apart in input order), and the next epoch
    orders the buckets and their insides anew."""
    n = 64 * BLOCK_DOCS
    lengths = np.ones(n, dtype=np.int64)
    first, second = _epoch(lengths, 0).order(), _epoch(lengths, 1).order()
    window = first[:BLOCK_DOCS]  # one bucket: what about one global batch of a small run reads
    assert np.ptp(window) > 0.9 * n and abs(np.corrcoef(np.arange(n), first)[0, 1]) < 0.02
    assert np.mean(first == second) < 0.01
    assert np.mean(np.abs(np.diff(first)) == 1) < 0.001


class _CountingLengths:
    """A document-length row that counts the elements read from it (the shared index, memory-mapped)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths, self.read = lengths, 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, key: np.ndarray | int) -> np.ndarray:
        out = self.lengths[key]
        self.read += np.size(out)
        return out


def test_an_epoch_keeps_one_integer_per_bucket_and_reads_only_the_buckets_it_lands_in() -> None:
    """At a billion documents a per-document order and cumulative sum were 16 GB per rank and epoch, and
    computing them read every length of the shared index (8 GB) on every rank, every epoch."""
    n = 2_000_000
    lengths = np.random.default_rng(0).integers(1, 3000, n)
    totals = bucket_totals(lengths)  # written once with the index, read by every rank
    counting = _CountingLengths(lengths)
    index = np.stack([np.zeros(n, np.int64), np.zeros(n, np.int64), lengths])
    stream = SourceStream(Path("unused"), [], index, name="web", seed=0, seq_len=8, dtype=np.dtype(np.uint16),
                          totals=totals)
    stream.doc_len = counting  # type: ignore[assignment]
    tracemalloc.start()
    try:
        epoch = stream._epoch(0)  # what the sampler keeps for an epoch
        for offset in (0, int(lengths.sum()) - 1):  # its first and last token
            epoch.find(offset)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counting.read == 2 * BLOCK_DOCS  # the two buckets looked up, not the 2,000,000 lengths
    assert epoch.block_ends.nbytes == 8 * -(-n // BLOCK_DOCS)
    assert kept < 64 * 1024  # 31 KB of bucket order and block offsets, and one bucket; a full order and cumsum 32 MB
