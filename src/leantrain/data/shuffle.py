"""A source's per-epoch document order without a per-document array, and without reading every length per epoch.

The sampler needs, for an epoch, the document at any position of a seeded shuffle and the token offset where
each position starts. A full permutation and its cumulative lengths are two int64 arrays of the corpus's size on
every rank (16 B per document and epoch: 16 GB per rank at a billion documents), and computing them reads every
document's length on every rank, each epoch (8 GB of the shared index per rank at a billion).

Here documents fall into fixed buckets of `BLOCK_DOCS`: bucket b holds the documents σ(q) for q in [b·BLOCK_DOCS,
(b+1)·BLOCK_DOCS), σ a keyed permutation of [0, n) with a fixed key, so each bucket is a random sample of the
corpus. Each bucket's token total is computed once, when the data dir's index is written (`data.sample_index`: 8 B
per bucket, 8 MB at a billion documents). An epoch is a seeded order of the buckets (a permutation of n / 1,024
buckets) and, inside each, a seeded order of its documents (the same permutation of 1,024 positions for every
bucket, whose members differ): its block offsets are a cumulative sum over the buckets' totals, and a window's
lookup permutes the one bucket it lands in. Every rank computes the same order from (seed, source, epoch) alone. The
buckets keep their members across epochs (their order and the order inside them change), which a shuffle of a
billion documents does not show within one global batch.

The permutations are Feistel networks over the smallest number of bits that covers the domain, with
cycle-walking to stay inside it (Black and Rogaway, "Ciphers with arbitrary finite domains", CT-RSA 2002).
"""

from __future__ import annotations

import numpy as np

BLOCK_DOCS = 1024  # documents per bucket; a window's lookup permutes one bucket
ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudorandom function give a strong pseudorandom permutation
BUCKET_KEY = [0x1EA7, 0xB0C5]  # σ's key: fixed, so that the bucket totals written with the index serve every seed
_CHUNK = 1 << 18  # positions per pass when the bucket totals are computed (bounded temporary memory)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser (Steele et al. 2014)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class KeyedPermutation:
    """A seeded bijection of [0, n), evaluated on arrays of positions (`perm(positions) -> elements`).

    An alternating (unbalanced) Feistel network over the smallest number of bits b with 2^b ≥ n, split into
    halves of ⌈b/2⌉ and ⌊b/2⌋ bits: each round XORs the one half with a keyed hash of the other and swaps them,
    so every round can be undone and the whole is a bijection of [0, 2^b) for any b; 4 rounds of a strong round
    function make a pseudorandom permutation (Luby and Rackoff 1988). Positions that land at n or above are
    walked on through the permutation until they land below n (fewer than 2 passes on average: 2^b < 2n)."""

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
        while outside.size:  # cycle-walk
            out[outside] = self._feistel(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)


def bucket_totals(doc_len: np.ndarray) -> np.ndarray:
    """Each bucket's tokens (int64, one per BLOCK_DOCS documents): what the index writer stores beside the index.
    Reads every length once, `_CHUNK` documents at a time."""
    n = len(doc_len)
    totals = np.zeros(-(-n // BLOCK_DOCS), dtype=np.int64)
    if n == 0:
        return totals
    sigma = KeyedPermutation(n, BUCKET_KEY)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        lengths = np.zeros(-(-(stop - start) // BLOCK_DOCS) * BLOCK_DOCS, dtype=np.int64)
        lengths[:stop - start] = doc_len[sigma(np.arange(start, stop, dtype=np.int64))]
        totals[start // BLOCK_DOCS:start // BLOCK_DOCS + len(lengths) // BLOCK_DOCS] = \
            lengths.reshape(-1, BLOCK_DOCS).sum(axis=1)
    return totals


class EpochOrder:
    """One epoch of a source: its document order and where each position starts in the epoch's token stream.
    Kept per epoch: two int64 per bucket (the epoch's bucket order and block offsets) and the last bucket looked
    up."""

    def __init__(self, doc_len: np.ndarray, totals: np.ndarray, key: list[int]) -> None:
        self.doc_len = doc_len
        self.n = len(doc_len)
        self.blocks = len(totals)
        self._sigma = KeyedPermutation(self.n, BUCKET_KEY)
        self._buckets = KeyedPermutation(self.blocks, key)(np.arange(self.blocks))  # block j is bucket π(j)
        # the order inside a bucket this epoch (the last bucket may be smaller): the members differ from bucket to
        # bucket (σ), the order of positions inside them from epoch to epoch
        last = self.n - (self.blocks - 1) * BLOCK_DOCS
        self._inside = KeyedPermutation(BLOCK_DOCS, [*key, 1])(np.arange(BLOCK_DOCS, dtype=np.int64))
        self._inside_last = KeyedPermutation(last, [*key, 2])(np.arange(last, dtype=np.int64))
        self.block_ends = np.cumsum(np.asarray(totals, dtype=np.int64)[self._buckets])
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None

    def block(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents, end offset of each in the epoch) of one block of positions; the last one is kept."""
        if self._block is None or self._block[0] != number:
            bucket = int(self._buckets[number])
            docs = self._sigma(bucket * BLOCK_DOCS + (self._inside if bucket < self.blocks - 1 else self._inside_last))
            begin = int(self.block_ends[number - 1]) if number else 0
            self._block = (number, docs, begin + np.cumsum(np.asarray(self.doc_len[docs], dtype=np.int64)))
        return self._block[1], self._block[2]

    def find(self, offset: int) -> tuple[int, int]:
        """(block, position within it) of the document holding token `offset` of the epoch (< the epoch's tokens)."""
        number = int(np.searchsorted(self.block_ends, offset, side="right"))
        _, ends = self.block(number)
        return number, int(np.searchsorted(ends, offset, side="right"))

    def order(self) -> np.ndarray:
        """The whole epoch's document order (O(documents): for tests and tools, never the sampler)."""
        return np.concatenate([self.block(number)[0] for number in range(self.blocks)])
