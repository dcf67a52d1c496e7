"""The sampler's epoch order (data.shuffle): a bijection at every size, offsets that match the full cumulative
sum, and no per-document array kept (the brief's rule: no memory that grows with the corpus)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from leantrain.data.sampler import SourceStream
from leantrain.data.shuffle import BLOCK_DOCS, EpochOrder, KeyedPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 1024, 1025, 4099, 70_001])
def test_every_size_gets_a_permutation(n: int) -> None:
    order = KeyedPermutation(n, [7, 11, 0])(np.arange(n))
    assert np.array_equal(np.sort(order), np.arange(n))


def test_the_key_decides_the_order_and_the_order_is_shuffled() -> None:
    n = 100_000
    a, b = (KeyedPermutation(n, [3, 5, epoch])(np.arange(n)) for epoch in (0, 1))
    assert np.array_equal(a, KeyedPermutation(n, [3, 5, 0])(np.arange(n)))  # same key, same order
    assert np.mean(a == b) < 0.001  # another epoch: another order
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.02  # positions and documents are not related
    assert np.mean(np.abs(np.diff(a)) == 1) < 0.001  # neighbours in the order are not neighbours in the corpus
    assert abs(np.sum(a == np.arange(n)) - 1) < 10  # about one fixed point, as a uniform permutation has


def test_offsets_match_the_full_cumulative_sum() -> None:
    lengths = np.random.default_rng(0).integers(1, 500, 5 * BLOCK_DOCS + 37)
    epoch = EpochOrder(lengths, [1, 2, 3])
    order = epoch.order()
    ends = np.cumsum(lengths[order])
    for offset in [0, 1, int(ends[0]), int(ends[BLOCK_DOCS - 1]), int(ends[BLOCK_DOCS]), int(ends[-1]) - 1,
                   *np.random.default_rng(1).integers(0, ends[-1], 300).tolist()]:
        block, pos = epoch.find(offset)
        docs, block_ends = epoch.block(block)
        position = block * BLOCK_DOCS + pos
        assert docs[pos] == order[position] and block_ends[pos] == ends[position]
        assert ends[position] > offset >= ends[position] - lengths[order[position]]


def test_an_epoch_keeps_one_integer_per_block_of_documents_not_per_document() -> None:
    """At a billion documents a per-document order and cumulative sum were 16 GB per rank and epoch."""
    n = 2_000_000
    lengths = np.random.default_rng(0).integers(1, 3000, n)
    index = np.stack([np.zeros(n, np.int64), np.zeros(n, np.int64), lengths])
    stream = SourceStream(Path("unused"), [], index, name="web", seed=0, seq_len=8, dtype=np.dtype(np.uint16))
    tracemalloc.start()
    try:
        epoch = stream._epoch(0)  # what the sampler keeps for an epoch
        assert epoch._done == 0  # nothing read at the epoch's start
        epoch.find(0)
        assert epoch._done == 256  # one chunk of 262,144 documents: the offsets follow the reading
        epoch.find(int(lengths.sum()) - 1)  # the epoch's last token: every block's offset
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert epoch.block_ends.nbytes == 8 * -(-n // BLOCK_DOCS)
    assert kept < 64 * 1024  # 16 KB of block offsets; a full order and cumsum would be 32 MB
    assert peak < 0.6 * lengths.nbytes * 2  # built in chunks, never the whole order at once
