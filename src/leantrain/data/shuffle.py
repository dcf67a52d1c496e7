"""A source's per-epoch document order without a per-document array: a keyed permutation evaluated pointwise.

The sampler needs, for an epoch, the document at any position of a seeded shuffle and the token offset where
each position starts. A full permutation and its cumulative lengths are two int64 arrays of the corpus's size on
every rank (16 B per document and epoch: 16 GB per rank at a billion documents). Here the order is a keyed
bijection of [0, n) computed position by position: a Feistel network over the smallest number of bits that
covers n, with cycle-walking to stay inside [0, n) (Black and Rogaway, "Ciphers with arbitrary finite
domains", CT-RSA 2002). Offsets are kept per block of `BLOCK_DOCS` positions only (one int64 per
block: 8 MB at a billion documents), computed as the epoch is read; within a block they are recomputed from the
block's documents when a window lands there. Every rank computes the same order from (seed, source, epoch)
alone: nothing is read or exchanged.
"""

from __future__ import annotations

import numpy as np

BLOCK_DOCS = 1024  # positions per stored offset; a window's lookup permutes and sums one such block
ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudorandom function give a strong pseudorandom permutation
_CHUNK = 1 << 18  # positions per pass of the block offsets (bounded temporary memory, a short read at a time)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser (Steele et al. 2014)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class KeyedPermutation:
    """A seeded bijection of [0, n), evaluated on arrays of positions (`perm(positions) -> documents`).

    An alternating (unbalanced) Feistel network over the smallest number of bits b with 2^b ≥ n, split into
    halves of ⌈b/2⌉ and ⌊b/2⌋ bits: each round XORs the one half with a keyed hash of the other and swaps them,
    so every round can be undone and the whole is a bijection of [0, 2^b) for any b (Black and Rogaway 2002);
    4 rounds of a strong round function make a pseudorandom permutation (Luby and Rackoff 1988). Positions that
    land at n or above are walked on through the permutation until they land below n (fewer than 2 passes on
    average, since 2^b < 2n)."""

    def __init__(self, n: int, key: list[int]) -> None:
        if n < 1:
            raise ValueError("a permutation needs at least one element")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self._a = (bits + 1) // 2  # the first half's bits; after an even number of rounds the halves are back
        self._b = bits - self._a
        self._keys = np.random.default_rng(key).integers(0, 2**63, size=ROUNDS, dtype=np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        a, b = self._a, self._b
        left, right = x >> np.uint64(b), x & np.uint64((1 << b) - 1)  # (a bits, b bits)
        for k in self._keys:
            left = left ^ (_mix(right ^ k) & np.uint64((1 << a) - 1))
            left, right, a, b = right, left, b, a
        return (left << np.uint64(b)) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._feistel(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while outside.size:  # cycle-walk: the domain is < 2n, so few passes
            out[outside] = self._feistel(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)
class EpochOrder:
    """One epoch of a source: its document order and where each position starts in the epoch's token stream.

    The block offsets are computed as the stream is consumed, a chunk of `_CHUNK` positions at a time (a
    source's samples are read roughly in order), so no rank stalls at an epoch's start to read every
    document's length at once."""

    def __init__(self, doc_len: np.ndarray, key: list[int]) -> None:
        self.doc_len = doc_len
        self.n = len(doc_len)
        self.perm = KeyedPermutation(self.n, key)
        self.blocks = -(-self.n // BLOCK_DOCS)
        self.block_ends = np.zeros(self.blocks, dtype=np.int64)  # token offset where each block of positions ends
        self._done = 0  # blocks whose end is known
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None

    def _extend(self) -> None:
        """Compute the next chunk of block ends."""
        start = self._done * BLOCK_DOCS
        stop = min(self.n, start + _CHUNK)
        lengths = np.zeros(-(-(stop - start) // BLOCK_DOCS) * BLOCK_DOCS, dtype=np.int64)
        lengths[:stop - start] = self.doc_len[self.perm(np.arange(start, stop, dtype=np.int64))]
        sums = lengths.reshape(-1, BLOCK_DOCS).sum(axis=1)
        before = int(self.block_ends[self._done - 1]) if self._done else 0
        self.block_ends[self._done:self._done + len(sums)] = before + np.cumsum(sums)
        self._done += len(sums)

    def block(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents, end offset of each in the epoch) of one block of positions; the last one is kept."""
        while self._done <= number:
            self._extend()
        if self._block is None or self._block[0] != number:
            first = number * BLOCK_DOCS
            docs = self.perm(np.arange(first, min(self.n, first + BLOCK_DOCS), dtype=np.int64))
            begin = int(self.block_ends[number - 1]) if number else 0
            self._block = (number, docs, begin + np.cumsum(np.asarray(self.doc_len[docs], dtype=np.int64)))
        return self._block[1], self._block[2]

    def find(self, offset: int) -> tuple[int, int]:
        """(block, position within it) of the document holding token `offset` of the epoch (< the epoch's tokens)."""
        while self._done < self.blocks and (self._done == 0 or self.block_ends[self._done - 1] <= offset):
            self._extend()
        number = int(np.searchsorted(self.block_ends[:self._done], offset, side="right"))
        _, ends = self.block(number)
        return number, int(np.searchsorted(ends, offset, side="right"))

    def order(self) -> np.ndarray:
        """The whole epoch's document order (O(documents): for tests and tools, never the sampler)."""
        return self.perm(np.arange(self.n, dtype=np.int64))
