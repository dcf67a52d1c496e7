"""Data pipeline speed: near-dedup, tokenize + shard, loader. Prints `name: value unit (ratio vs baseline)`.

- near-dedup docs/s against datasketch's MinHash + MinHashLSH at the same parameters (112 permutations,
  14 bands × 8 rows, word 5-gram shingles of the same words), same documents, greedy keep-first;
- tokenize + shard MB/s (byte-level BPE, 8k vocab, encode_batch + Megatron .bin/.idx writing with hashes)
  against tokenizing alone (the share of raw tokenizer speed the shard writing keeps);
- loader tokens/s of one `PackedBatchSampler` (seq 4096, micro-batch 8, two sources) against the tokens/s
  one H100 consumes training a 1B dense model at 40% MFU (peak × MFU / FLOPs per token).
Run: .venv/bin/python bench/data.py   (needs the `peers` extra for datasketch)
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import numpy as np

from leantrain.data.clean import text_stats
from leantrain.data.dedup import NearDeduplicator
from leantrain.data.demo_corpus import builtin_rows
from leantrain.data.layout import write_split_shards, write_token_data_dir
from leantrain.data.sampler import PackedBatchSampler
from leantrain.data.tokenizer import build_tokenizer
from leantrain.hardware import get_accelerator
from leantrain.plan.flops import flops_per_token
from leantrain.spec.schema import DedupSpec, ModelSpec, TokenizerSpec
from leantrain.spec.shapes import resolve_shape


def _dedup_corpus(num_docs: int) -> list[str]:
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    docs: list[str] = []
    for i in range(num_docs):
        if docs and i % 5 == 0:  # every fifth document is a near copy of an earlier one
            words = rng.choice(docs).split()
            for _ in range(3):
                words[rng.randrange(len(words))] = rng.choice(vocab)
            docs.append(" ".join(words))
        else:
            docs.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(150, 400))))
    return docs


def bench_dedup(num_docs: int = 3000) -> None:
    from datasketch import MinHash, MinHashLSH

    docs = _dedup_corpus(num_docs)
    start = time.perf_counter()
    ours = NearDeduplicator(DedupSpec())
    ours_dups = sum(ours.check_and_add(text_stats(t)) is not None for t in docs)
    ours_s = time.perf_counter() - start

    start = time.perf_counter()
    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    theirs_dups = 0
    for i, text in enumerate(docs):
        words = [w.lower() for w in text_stats(text).words]
        shingles = {" ".join(words[j : j + 5]).encode() for j in range(len(words) - 4)}
        signature = MinHash(num_perm=112, seed=42)
        signature.update_batch(list(shingles))
        if lsh.query(signature):
            theirs_dups += 1
        else:
            lsh.insert(str(i), signature)
    theirs_s = time.perf_counter() - start
    ratio = (num_docs / ours_s) / (num_docs / theirs_s)
    print(f"near_dedup_docs_per_s: {num_docs / ours_s:,.0f} docs/s ({ratio:.2f}x vs datasketch "
          f"{num_docs / theirs_s:,.0f} docs/s)")
    print(f"near_dedup_duplicates_found: {ours_dups} ({theirs_dups} by datasketch; {num_docs // 5} planted)")


def bench_tokenize_shard(target_bytes: int = 6_000_000, repeats: int = 3) -> None:
    """Best of `repeats` interleaved runs each (the dev VM is shared), a fresh tokenizer per run."""
    from tokenizers import Tokenizer

    texts = [row["text"] for name in ("demo-en", "demo-zh", "pydoc") for row in builtin_rows(name)]
    corpus: list[str] = []
    while sum(len(t.encode()) for t in corpus) < target_bytes:
        corpus += texts
    num_bytes = sum(len(t.encode()) for t in corpus)
    alone_s, both_s = float("inf"), float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        info = build_tokenizer(TokenizerSpec(vocab_size=8192), iter(texts), out_path=path)
        for repeat in range(repeats):
            tokenizer = Tokenizer.from_file(str(path))  # fresh: no word cache from an earlier run
            start = time.perf_counter()
            for i in range(0, len(corpus), 512):
                tokenizer.encode_batch(corpus[i : i + 512])
            alone_s = min(alone_s, time.perf_counter() - start)
            tokenizer = Tokenizer.from_file(str(path))

            def docs(tokenizer: Tokenizer = tokenizer):  # noqa: ANN202
                for i in range(0, len(corpus), 512):
                    for encoding in tokenizer.encode_batch(corpus[i : i + 512]):
                        yield np.append(np.asarray(encoding.ids, dtype=np.int64), info.eos_id)

            start = time.perf_counter()
            shards = write_split_shards(Path(tmp), split=f"r{repeat}", source="bench", docs=docs(),
                                        dtype=np.uint16, shard_size_tokens=1 << 20)
            both_s = min(both_s, time.perf_counter() - start)
    tokens = sum(s.num_tokens for s in shards)
    print(f"tokenize_shard_mb_per_s: {num_bytes / both_s / 1e6:.1f} MB/s ({alone_s / both_s:.2f}x vs tokenize alone "
          f"{num_bytes / alone_s / 1e6:.1f} MB/s; {tokens:,} tokens, {len(shards)} shards)")


def bench_loader(duration_s: float = 3.0) -> None:
    rng = np.random.default_rng(0)
    docs = {name: [rng.integers(1, 32000, int(rng.integers(50, 3000))).tolist() for _ in range(3000)]
            for name in ("web", "code")}
    shape = resolve_shape(ModelSpec(size_billion=1.0))
    h100 = get_accelerator("H100-SXM").peak_for("bf16")
    needed = h100 * 0.4 / flops_per_token(shape, seq_len=4096).model
    with tempfile.TemporaryDirectory() as tmp:
        write_token_data_dir(Path(tmp), docs, vocab_size=32000, eos_id=0, weights={"web": 0.7, "code": 0.3},
                             shard_size_tokens=1 << 22)
        sampler = PackedBatchSampler(Path(tmp), seq_len=4096, micro_batch=8, dp_rank=0, dp_size=1, seed=0)
        sampler.next_batch()
        batches = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration_s:
            sampler.next_batch()
            batches += 1
        elapsed = time.perf_counter() - start
    rate = batches * 8 * 4096 / elapsed
    print(f"loader_tokens_per_s: {rate:,.0f} tokens/s ({rate / needed:.1f}x vs one H100 on a 1B model at 40% MFU, "
          f"{needed:,.0f} tokens/s)")


def main() -> None:
    bench_dedup()
    bench_tokenize_shard()
    bench_loader()


if __name__ == "__main__":
    main()
