"""Exact and near-duplicate detection: a hash of normalised text, and MinHash signatures + banded LSH.

Near duplicates (Broder 1997; Leskovec et al., Mining of Massive Datasets ch. 3):
- Shingles: word n-grams (default 5, as datatrove) of the *simplified* words; for CJK-dominant text the
  "words" are characters, so the shingles are character n-grams. Simplified as datatrove's MinHash does
  before shingling (`datatrove.utils.text.simplify_text` with its default `TextNormConfig`: lower case,
  numbers to "0", punctuation to spaces, whitespace collapsed, diacritics removed after NFD): here each
  word is case-folded, every digit run becomes "0" and combining marks are dropped after NFD; the word
  split (runs of letters and digits) already removes punctuation and whitespace. So copies that differ
  only in case ("to" → "TO"), accents ("café" → "cafe") or numbers are caught at the same threshold.
  (datatrove keeps "3.14" as one number; here it is two words "0 0".) `data.dedup.normalize_numbers: false`
  keeps the digits, for data whose numbers are the content (arithmetic problems, tables); chat and
  preference sources always keep them (templated prompts that differ only in a number are different examples). The exact
  key is not simplified: two documents that differ only in a number are near, not exact, duplicates.
- Signature: k = bands × rows MinHash values. Each shingle is hashed once to 64 bits (token hashes from
  blake2b, combined polynomially in numpy); permutation i is the multiply-shift hash
  h_i(x) = ((a_i·x + b_i) mod 2^64) >> 32 with odd a_i. All of it is vectorised: no per-shingle Python.
- LSH: two documents are candidates when all `rows` values of any band agree (each band is hashed to 64
  bits, `band_hashes`); P(candidate | Jaccard s) = 1 − (1 − s^r)^b. A candidate is confirmed when the
  signatures agree on at least `verify_jaccard` of the k values (an unbiased estimate of Jaccard), which
  removes most of the S-curve's false positives below the threshold.
Finding the candidates across a corpus, out of core, and keeping the first of each cluster in input
order is clusters.py.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterator

import numpy as np

from leantrain.data.clean import WORD_RE, TextStats

_POLY = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier (golden ratio) for combining token hashes


def exact_key(stats: TextStats) -> bytes:
    """Hash of the text with case, punctuation and spacing removed: equal keys mean equal documents."""
    return hashlib.blake2b(" ".join(stats.words).lower().encode("utf-8"), digest_size=16).digest()


SIGNATURE_BLOCK_ROWS = 1 << 12


class Signatures:
    """A task's MinHash signatures, appended one document at a time into (4,096, k) uint32 blocks: 4 bytes per
    value and no array object per document. (A list of one small array per document took ~25 % more, left
    the heap fragmented after the task, and was copied once more by `np.stack` before the band hashes.)"""

    def __init__(self, width: int) -> None:
        self.width = width
        self._blocks: list[np.ndarray] = []
        self._used = 0  # rows filled in the last block

    def append(self, signature: np.ndarray) -> None:
        if not self._blocks or self._used == SIGNATURE_BLOCK_ROWS:
            self._blocks.append(np.empty((SIGNATURE_BLOCK_ROWS, self.width), dtype=np.uint32))
            self._used = 0
        self._blocks[-1][self._used] = signature
        self._used += 1

    def __len__(self) -> int:
        return (len(self._blocks) - 1) * SIGNATURE_BLOCK_ROWS + self._used if self._blocks else 0

    def blocks(self) -> Iterator[np.ndarray]:
        """The filled rows, block by block, in the order they were appended."""
        for number, block in enumerate(self._blocks):
            yield block if number < len(self._blocks) - 1 else block[: self._used]


def add_candidate_hashes(stats: TextStats, *, near: bool, hasher: MinHasher, keys: list[bytes],
                         signatures: Signatures, valid_cut: int) -> str:
    """Append a dedup candidate's exact key (and its MinHash signature when near-dedup is on) and return its
    split: the held-out share is chosen by the key, so a duplicate never lands on the other side."""
    key = exact_key(stats)
    keys.append(key)
    if near:
        signatures.append(hasher.signature(hasher.shingles(stats.words, cjk=stats.cjk_share >= 0.5)))
    return "valid" if int.from_bytes(key[:8], "little") < valid_cut else "train"


def detection_probability(similarity: float, *, bands: int, rows: int) -> float:
    """LSH S-curve: probability that a pair with this Jaccard similarity shares at least one band."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def s_curve(*, bands: int, rows: int) -> dict[str, float]:
    """Detection probability at Jaccard 0.1 … 1.0 and the curve's threshold (1/b)^(1/r), for the report."""
    curve = {f"{s / 10:.1f}": round(detection_probability(s / 10, bands=bands, rows=rows), 4) for s in range(1, 11)}
    curve["threshold"] = round((1.0 / bands) ** (1.0 / rows), 4)
    return curve


_DIGITS_RE = re.compile(r"\d+")  # any script's decimal digits (str patterns match Unicode Nd)


def simplify_word(word: str, *, numbers: bool = True) -> str:
    """A word as near-dedup compares it: case-folded, digit runs as "0" (`numbers`), no combining marks."""
    word = word.casefold()
    if numbers:
        word = _DIGITS_RE.sub("0", word)
    if word.isascii():
        return word
    return "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")


class _TokenHashes(dict[str, int]):
    """token → 64-bit blake2b hash of the simplified token, computed on first use (once per distinct token);
    lookups run in C (`map`)."""

    def __init__(self, *, numbers: bool) -> None:
        super().__init__()
        self._numbers = numbers

    def __missing__(self, token: str) -> int:
        simple = simplify_word(token, numbers=self._numbers)
        value = int.from_bytes(hashlib.blake2b(simple.encode("utf-8"), digest_size=8).digest(), "little")
        self[token] = value
        return value


class MinHasher:
    """Signatures of shingle sets; token hashes are cached (vocabularies are small next to corpora)."""

    def __init__(self, *, num_perm: int, seed: int, shingle_words: int, shingle_chars: int,
                 normalize_numbers: bool = True) -> None:
        rng = np.random.default_rng(seed)
        self._a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd
        self._b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self._n_words, self._n_chars = shingle_words, shingle_chars
        self._token_hash = _TokenHashes(numbers=normalize_numbers)
        self.num_perm = num_perm

    def _hash_tokens(self, tokens: list[str]) -> np.ndarray:
        return np.fromiter(map(self._token_hash.__getitem__, tokens), dtype=np.uint64, count=len(tokens))

    def shingles(self, words: list[str], *, cjk: bool) -> np.ndarray:
        """64-bit shingle hashes of a document's words (n-grams of n words, or n chars for CJK), repeats kept."""
        n = self._n_chars if cjk else self._n_words
        hashes = self._hash_tokens(words or [""])
        n = min(n, len(hashes))
        count = len(hashes) - n + 1
        combined = hashes[:count].copy()
        for j in range(1, n):
            combined = combined * _POLY + hashes[j : j + count]
        return combined  # repeated shingles do not change a minimum: no need to deduplicate them

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        """(num_perm,) uint32 MinHash values of a shingle set."""
        mixed = self._a[:, None] * shingles[None, :] + self._b[:, None]  # (num_perm, num_shingles), wraps mod 2^64
        return (mixed.min(axis=1) >> np.uint64(32)).astype(np.uint32)

    def signature_of_text(self, text: str) -> np.ndarray:
        words = WORD_RE.findall(text)
        num_cjk = sum(1 for w in words if len(w) == 1 and ord(w) >= 0x3040)
        return self.signature(self.shingles(words, cjk=num_cjk * 2 >= max(len(words), 1)))


def band_hashes(signatures: np.ndarray, *, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: one hash per LSH band of each (n, bands·rows) uint32 signature; equal bands give
    equal hashes, and unequal ones collide with probability ~2^-64 (the candidates are verified anyway)."""
    grouped = signatures.reshape(len(signatures), bands, rows).astype(np.uint64)
    combined = np.zeros(grouped.shape[:2], dtype=np.uint64)
    for j in range(rows):
        combined = (combined ^ grouped[:, :, j]) * _POLY
    return combined ^ (combined >> np.uint64(29))
