"""Near-duplicate detection: precision and recall on planted ≥ 0.85-Jaccard copies (English and Chinese),
out of core across shards, and the same decisions when the merge holds only a tiny bucket in memory."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from leantrain.data.clean import text_stats
from leantrain.data.clusters import EXACT_DUP, KEEP, NEAR_DUP, deduplicate, write_hashes
from leantrain.data.dedup import (
    SIGNATURE_BLOCK_ROWS,
    MinHasher,
    Signatures,
    band_hashes,
    detection_probability,
    exact_key,
    s_curve,
)
from leantrain.spec.schema import DedupSpec

ZH_CHARS = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出"
            "就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经")


def _shingles(text: str, n: int, *, cjk: bool) -> set[tuple[str, ...]]:
    words = [w.lower() for w in text_stats(text).words]
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _jaccard(a: str, b: str, *, cjk: bool) -> float:
    x, y = _shingles(a, 5, cjk=cjk), _shingles(b, 5, cjk=cjk)
    return len(x & y) / len(x | y)


def _corpus(rng: random.Random) -> tuple[list[str], set[int], list[bool]]:
    """Docs in order, indices of planted near duplicates, and which docs are CJK."""
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    docs: list[str] = []
    cjk: list[bool] = []
    planted: set[int] = set()
    bases: list[tuple[list[str], bool]] = []
    for i in range(240):
        zh = i % 4 == 3
        tokens = [rng.choice(ZH_CHARS) for _ in range(rng.randint(220, 400))] if zh else \
            [rng.choice(vocab) for _ in range(rng.randint(150, 300))]
        bases.append((tokens, zh))
    for tokens, zh in bases:
        docs.append(("" if zh else " ").join(tokens))
        cjk.append(zh)
    for number in range(120):  # planted near duplicates: a few scattered edits, Jaccard checked ≥ 0.85
        tokens, zh = bases[number * 2]
        original = ("" if zh else " ").join(tokens)
        while True:
            edited = list(tokens)
            for _ in range(rng.randint(1, 3)):
                edited[rng.randrange(len(edited))] = rng.choice(ZH_CHARS) if zh else rng.choice(vocab)
            text = ("" if zh else " ").join(edited)
            if _jaccard(original, text, cjk=zh) >= 0.85:
                break
        planted.add(len(docs))
        docs.append(text)
        cjk.append(zh)
    for number in range(60):  # hard negatives: half of a base document, half new (Jaccard ≈ 0.3)
        tokens, zh = bases[number * 2 + 1]
        half = len(tokens) // 2
        fresh = [rng.choice(ZH_CHARS) for _ in range(half)] if zh else [rng.choice(vocab) for _ in range(half)]
        text = ("" if zh else " ").join(tokens[:half] + fresh)
        assert _jaccard(("" if zh else " ").join(tokens), text, cjk=zh) < 0.5
        docs.append(text)
        cjk.append(zh)
    return docs, planted, cjk


def test_near_dedup_precision_and_recall_across_shards(tmp_path: Path) -> None:
    docs, planted, _ = _corpus(random.Random(5))
    decisions, _ = deduplicate(docs, spec=DedupSpec(), work=tmp_path, shard_docs=97)  # 5 shards
    flagged = set(np.flatnonzero(decisions != KEEP).tolist())
    true_positive = len(flagged & planted)
    precision = true_positive / max(len(flagged), 1)
    recall = true_positive / len(planted)
    assert recall == 1.0 and precision >= 0.95, (precision, recall, sorted(flagged - planted))
    assert set(np.flatnonzero(decisions == NEAR_DUP).tolist()) == flagged  # no exact copies planted


def test_a_tiny_bucket_limit_spills_into_many_steps_with_the_same_decisions(tmp_path: Path) -> None:
    docs, _, _ = _corpus(random.Random(7))
    docs += docs[:30]  # exact copies too
    reference, steps = deduplicate(docs, spec=DedupSpec(), work=tmp_path / "big", shard_docs=50)
    spaces = 1 + DedupSpec().num_bands  # exact + each band
    assert len(steps) == spaces  # one hash range per space
    tiny = DedupSpec(bucket_records=40)
    decisions, steps = deduplicate(docs, spec=tiny, work=tmp_path / "tiny", shard_docs=50)
    assert len(steps) == spaces * int(np.ceil(len(docs) / 40))
    # each step held about bucket_records records (hash ranges are even, the hashes uniform)
    assert max(s["records"] for s in steps) <= 3 * tiny.bucket_records
    assert np.array_equal(decisions, reference)
    assert (decisions[-30:] == EXACT_DUP).all()


def test_without_verification_the_s_curve_shows(tmp_path: Path) -> None:
    spec = DedupSpec(num_bands=20, rows_per_band=2, verify_jaccard=0.0)  # low threshold ≈ 0.22
    docs, _, _ = _corpus(random.Random(6))
    decisions, _ = deduplicate(docs, spec=spec, work=tmp_path)
    assert int((decisions != KEEP).sum()) > 120  # the ≈0.3-Jaccard hard negatives are now caught as well


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(7))  # no digits: numbers compare as 0


def test_clusters_keep_the_first_in_input_order(tmp_path: Path) -> None:
    rng = random.Random(9)
    base = [_word(rng) for _ in range(300)]
    chain = [" ".join(base)]
    for _ in range(3):  # each a near copy of the one before
        words = chain[-1].split()
        words[rng.randrange(len(words))] = _word(rng)
        chain.append(" ".join(words))
    other = " ".join(_word(rng) for _ in range(300))
    decisions, _ = deduplicate([other, *reversed(chain)], spec=DedupSpec(), work=tmp_path, shard_docs=2)
    assert decisions.tolist() == [KEEP, KEEP, NEAR_DUP, NEAR_DUP, NEAR_DUP]


def test_minhash_estimates_jaccard() -> None:
    hasher = MinHasher(num_perm=256, seed=1, shingle_words=5, shingle_chars=5)
    rng = random.Random(2)
    words = [_word(rng) for _ in range(400)]
    a, b = words[:300], words[100:]
    true = 196 / 396  # 200 shared of 5-gram windows: (300-4)+(300-4)-(200-4) union
    est = float(np.mean(hasher.signature(hasher.shingles(a, cjk=False)) ==
                        hasher.signature(hasher.shingles(b, cjk=False))))
    assert abs(est - true) < 0.08


def test_s_curve_and_exact_key() -> None:
    assert abs(detection_probability(0.85, bands=14, rows=8) - 0.988) < 0.001
    curve = s_curve(bands=14, rows=8)
    assert curve["1.0"] == 1.0 and curve["0.5"] < 0.06 and abs(curve["threshold"] - 0.719) < 0.001
    assert exact_key(text_stats("Hello,  World!")) == exact_key(text_stats("hello world"))
    assert exact_key(text_stats("hello world")) != exact_key(text_stats("hello word"))


def _case_sensitive_jaccard(a: str, b: str) -> float:
    x, y = ({tuple(w[i : i + 5]) for i in range(len(w) - 4)} for w in (a.split(), b.split()))
    return len(x & y) / len(x | y)


def test_copies_differing_in_case_accents_or_numbers_are_near_duplicates(tmp_path: Path) -> None:
    """Planted copies at Jaccard ~0.9 (two words replaced) that also differ only in case (a fifth of the
    words upper-cased, "to" -> "TO"), accents (é for e) or numbers: on the raw words their Jaccard is far
    below the 0.7 confirmation, on the simplified words (datatrove's simplify_text) it is not."""
    rng = random.Random(11)
    vocab = [_word(rng) for _ in range(2000)] + ["to", "the", "of", "and"] * 50
    bases = [[rng.choice(vocab) for _ in range(200)] for _ in range(60)]
    for words in bases:  # a few numbers and accentable letters in every document
        for i in rng.sample(range(200), 10):
            words[i] = f"{rng.randint(10, 99999)}"
    def variant(words: list[str], kind: str) -> str:
        out = list(words)
        for i in rng.sample(range(200), 2):
            out[i] = _word(rng)
        if kind == "case":
            out = [w.upper() if rng.random() < 0.2 or w == "to" else w for w in out]
        elif kind == "accents":
            out = [w.replace("e", "\u00e9").replace("a", "\u00e0") for w in out]
        else:
            out = [str(int(w) + 1) if w.isdigit() else w for w in out]
        return " ".join(out)
    kinds = ["case", "accents", "numbers"] * 20
    copies = [variant(words, kind) for words, kind in zip(bases, kinds, strict=True)]
    docs = [" ".join(w) for w in bases] + copies
    assert max(_case_sensitive_jaccard(" ".join(w), c) for w, c in zip(bases, copies, strict=True)) < 0.7
    decisions, _ = deduplicate(docs, spec=DedupSpec(), work=tmp_path / "on", shard_docs=50)
    assert decisions[:60].tolist() == [KEEP] * 60
    assert decisions[60:].tolist() == [NEAR_DUP] * 60  # not exact duplicates: two words differ
    kept_numbers, _ = deduplicate(docs, spec=DedupSpec(normalize_numbers=False), work=tmp_path / "off")
    numbered = [d for d, k in zip(kept_numbers[60:].tolist(), kinds, strict=True) if k == "numbers"]
    assert numbered.count(KEEP) >= 15  # with the digits kept, 12 changed words of 200 are mostly too many


def test_resolution_in_batches_of_edge_files_gives_the_same_clusters(tmp_path: Path) -> None:
    """The forest of (document, cluster root) rows joined one batch of edge files at a time (memory: the
    duplicates, not all edges) gives every document the decision that all edges at once give, including
    chains that link clusters only through a later file."""
    from leantrain.data.clusters import MergeStep, resolve

    rng = np.random.default_rng(7)
    docs, files = 5000, 12
    edges = np.sort(rng.integers(0, docs, size=(1500, 2)), axis=1)
    edges = edges[edges[:, 0] != edges[:, 1]]
    chain = np.stack([np.arange(100, 4100, 400), np.arange(500, 4500, 400)], axis=1)  # 100-500-900-...
    parts = [*np.array_split(edges, files - 1), chain[::-1]]
    steps = [MergeStep(f"band{i:02d}", 0, 0, 1) for i in range(files)] + [MergeStep("exact", 0, 0, 1)]
    (tmp_path / "edges").mkdir()
    for step, part in zip(steps, [*parts, np.array([[3, 4], [3, 100]])], strict=True):
        np.save(tmp_path / "edges" / step.file_name, part.astype(np.int64))
    offsets = np.array([0, 1700, 3300, docs])
    decisions = {}
    for batch in (1, 1 << 30):
        folders = [tmp_path / f"b{batch}" / str(i) for i in range(3)]
        for folder in folders:
            folder.mkdir(parents=True)
        counts = resolve(steps, folders, offsets, tmp_path / "edges", batch_edges=batch)
        decisions[batch] = (np.concatenate([np.load(f / "keep.npy") for f in folders]), counts)
    # reference: plain union-find over all edges
    parent = list(range(docs))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in np.concatenate(parts).tolist():
        ra, rb = root(a), root(b)
        parent[max(ra, rb)] = min(ra, rb)
    expected = np.array([KEEP if root(d) == d else NEAR_DUP for d in range(docs)], dtype=np.uint8)
    expected[[4, 100]] = EXACT_DUP
    for decision, counts in decisions.values():
        assert np.array_equal(decision, expected)
        assert counts == {"exact_duplicates": 2, "near_duplicates": int((expected == NEAR_DUP).sum())}
    assert decisions[1][0][4100] == NEAR_DUP and root(4100) == root(100)  # the chain is in the last file


def test_signatures_in_blocks_write_the_files_a_stacked_array_would(tmp_path: Path) -> None:
    """write_hashes takes the signatures block by block (Signatures): sigs.npy is the np.save of the stacked
    signatures byte for byte, and the band files are those of the stacked array, across block boundaries."""
    spec = DedupSpec()
    rng = np.random.default_rng(3)
    num_docs = SIGNATURE_BLOCK_ROWS * 2 + 17  # two full blocks and a partial one
    rows = rng.integers(0, 2**32, (num_docs, spec.num_bands * spec.rows_per_band), dtype=np.uint32)
    rows[5] = rows[SIGNATURE_BLOCK_ROWS + 9]  # equal band hashes across blocks keep the stable order
    signatures = Signatures(rows.shape[1])
    for row in rows:
        signatures.append(row)
    assert len(signatures) == num_docs
    keys = [rng.bytes(16) for _ in range(num_docs)]
    write_hashes(tmp_path, keys=keys, signatures=signatures, spec=spec)
    np.save(tmp_path / "stacked.npy", rows)
    assert (tmp_path / "sigs.npy").read_bytes() == (tmp_path / "stacked.npy").read_bytes()
    hashes = band_hashes(rows, bands=spec.num_bands, rows=spec.rows_per_band).T
    order = np.argsort(hashes, axis=1, kind="stable")
    assert np.array_equal(np.load(tmp_path / "bands.npy"), np.take_along_axis(hashes, order, axis=1))
    assert np.array_equal(np.load(tmp_path / "band_docs.npy"), order.astype(np.uint32))
    empty = tmp_path / "empty"
    empty.mkdir()
    write_hashes(empty, keys=[], signatures=Signatures(rows.shape[1]), spec=spec)
    assert np.load(empty / "sigs.npy").shape == (0, rows.shape[1])
    assert np.load(empty / "bands.npy").shape == (spec.num_bands, 0)


def test_a_tasks_signatures_and_hash_files_stay_near_the_signatures_own_size(tmp_path: Path) -> None:
    """Memory of the clean task's dedup state (flat peak RSS): the signatures take 4 bytes per value
    (no array object per document), and writing the hash files adds less than the signatures' own size (the
    stacked copy + (n, bands, rows) uint64 band temporaries before took 3.9x; traced by tracemalloc, which
    numpy reports its buffers to)."""
    import tracemalloc

    spec = DedupSpec()
    num_docs, width = 40_000, spec.num_bands * spec.rows_per_band
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 2**32, (num_docs, width), dtype=np.uint32)
    keys = [rng.bytes(16) for _ in range(num_docs)]
    tracemalloc.start()
    try:
        signatures = Signatures(width)
        for row in rows:
            signatures.append(row)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        write_hashes(tmp_path, keys=keys, signatures=signatures, spec=spec)
        extra = tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()
    assert held < rows.nbytes + 2 * SIGNATURE_BLOCK_ROWS * width * 4, held / rows.nbytes
    assert extra < 1.5 * rows.nbytes, extra / rows.nbytes


def test_a_merge_group_maps_each_folders_files_once_with_the_same_decisions(tmp_path: Path, monkeypatch) -> None:
    """A merge step per task mapped every task folder's hash files at every step: hash ranges × folders opens
    per space, quadratic in the corpus. A group of steps maps each file once; the decisions do not change."""
    from collections import Counter

    from leantrain.data import clusters

    docs, _, _ = _corpus(random.Random(3))
    docs += docs[:20]
    tiny = DedupSpec(bucket_records=40)
    steps = clusters.plan_merges(tiny, num_records=len(docs))
    groups = clusters.group_merges(steps, tasks=8)
    assert [s for g in groups for s in g] == steps  # in order, nothing dropped
    assert all(len({s.space for s in g}) == 1 for g in groups) and len(groups) <= 8 + 1 + tiny.num_bands
    opened: Counter[str] = Counter()
    load = np.load
    monkeypatch.setattr(np, "load", lambda path, *a, **k: (opened.update([str(path)]), load(path, *a, **k))[1])

    def hash_file_opens() -> dict[str, int]:
        return {p: n for p, n in opened.items() if p.endswith(("exact_keys.npy", "bands.npy", "sigs.npy"))}

    with monkeypatch.context() as held_nothing:  # past MAX_HELD_FOLDERS: mapped at each use, as before
        held_nothing.setattr(clusters, "MAX_HELD_FOLDERS", 0)
        reference, _ = deduplicate(docs, spec=tiny, work=tmp_path / "ref", shard_docs=50)
    assert max(hash_file_opens().values()) >= len(steps) // (1 + tiny.num_bands)  # once per step
    opened.clear()
    decisions, _ = deduplicate(docs, spec=tiny, work=tmp_path / "held", shard_docs=50)
    assert np.array_equal(decisions, reference)
    assert len(steps) > 10 * (1 + tiny.num_bands) and max(hash_file_opens().values()) == 1, hash_file_opens()
