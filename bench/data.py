"""Data pipeline speed and memory. Prints `name: value unit (ratio vs baseline)` lines.

- near-dedup docs/s: our out-of-core MinHash/LSH (`clusters.deduplicate`, one process) against
  datasketch's MinHash + MinHashLSH at the same parameters (the spec's bands × rows, word 5-gram shingles
  of the same words), same documents, with recall on the planted ≥ 0.85-Jaccard copies;
- whole pipeline docs/s per core: `prepare` (read → clean → filter → PII → exact + near dedup → tokenize →
  shards) with one worker against datatrove's equivalent pipeline (JsonlReader → Gopher repetition +
  quality filters → PII formatter → MinHash signature/buckets/cluster/filter → DocumentTokenizer with the
  same tokenizer.json) with one task, on the same jsonl files; both single-threaded;
- scaling: `prepare` wall time with data.workers 1 and 2 on the same corpus;
- peak RSS of a `prepare` process (one worker) at 20k and 100k documents: memory must not follow the corpus;
- tokenize + shard MB/s (byte-level BPE, 8k vocab, encode_batch + Megatron .bin/.idx writing with hashes)
  against tokenizing alone;
- loader tokens/s of one `PackedBatchSampler` (seq 4096, micro-batch 8, two sources) against the tokens/s
  one H100 consumes training a 1B dense model at 40% MFU (peak × MFU / FLOPs per token).
Run: .venv/bin/python bench/data.py [--quick]   (needs the `peers` extra: datasketch, datatrove)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # per-core numbers: one thread for both sides
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from leantrain.data.clean import text_stats  # noqa: E402
from leantrain.data.clusters import KEEP, deduplicate  # noqa: E402
from leantrain.data.demo_corpus import _document, builtin_rows  # noqa: E402
from leantrain.data.layout import write_split_shards, write_token_data_dir  # noqa: E402
from leantrain.data.pipeline import prepare_data  # noqa: E402
from leantrain.data.sampler import PackedBatchSampler  # noqa: E402
from leantrain.data.tokenizer import build_tokenizer  # noqa: E402
from leantrain.hardware import get_accelerator  # noqa: E402
from leantrain.plan.flops import flops_per_token  # noqa: E402
from leantrain.spec.schema import DataSource, DataSpec, DedupSpec, ModelSpec, TokenizerSpec  # noqa: E402
from leantrain.spec.shapes import resolve_shape  # noqa: E402


def _dedup_corpus(num_docs: int) -> tuple[list[str], set[int]]:
    """Random-word documents; every fifth is a near copy (3 words changed) of an earlier one."""
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    docs: list[str] = []
    planted: set[int] = set()
    for i in range(num_docs):
        if docs and i % 5 == 0:
            words = rng.choice(docs).split()
            for _ in range(3):
                words[rng.randrange(len(words))] = rng.choice(vocab)
            planted.add(len(docs))
            docs.append(" ".join(words))
        else:
            docs.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(150, 400))))
    return docs, planted


def _shingle_jaccard(a: str, b: str) -> float:
    def grams(t: str) -> set[tuple[str, ...]]:
        w = [x.lower() for x in text_stats(t).words]
        return {tuple(w[i : i + 5]) for i in range(len(w) - 4)}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def bench_dedup(num_docs: int = 3000) -> None:
    from datasketch import MinHash, MinHashLSH

    docs, planted = _dedup_corpus(num_docs)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.process_time()  # CPU time: both run in this process, and the VM is shared
        decisions, _ = deduplicate(docs, spec=DedupSpec(), work=Path(tmp), shard_docs=1000)
        ours_s = time.process_time() - start
    ours = set(np.flatnonzero(decisions != KEEP).tolist())

    spec = DedupSpec()
    num_perm = spec.num_bands * spec.rows_per_band
    start = time.process_time()
    lsh = MinHashLSH(num_perm=num_perm, params=(spec.num_bands, spec.rows_per_band))
    theirs: set[int] = set()
    for i, text in enumerate(docs):
        words = [w.lower() for w in text_stats(text).words]
        shingles = {" ".join(words[j : j + 5]).encode() for j in range(len(words) - 4)}
        signature = MinHash(num_perm=num_perm, seed=42)
        signature.update_batch(list(shingles))
        if lsh.query(signature):
            theirs.add(i)
        else:
            lsh.insert(str(i), signature)
    theirs_s = time.process_time() - start
    # recall on the planted copies that are at Jaccard >= 0.85 with their original (by construction most are)
    hard = {i for i in planted if max(_shingle_jaccard(docs[i], docs[j]) for j in range(i) if
                                      abs(len(docs[j]) - len(docs[i])) < 40) >= 0.85}
    print(f"near_dedup_docs_per_cpu_s: {num_docs / ours_s:,.0f} docs/s ({theirs_s / ours_s:.2f}x vs datasketch "
          f"{num_docs / theirs_s:,.0f} docs/s)")
    print(f"near_dedup_recall_at_0.85: {len(ours & hard) / len(hard):.3f} ({len(theirs & hard) / len(hard):.3f} by "
          f"datasketch; {len(hard)} planted pairs at Jaccard >= 0.85, flagged {len(ours)} vs {len(theirs)})")


def _write_corpus(root: Path, num_docs: int, *, files: int) -> Path:
    """English demo-style documents (with planted duplicates and junk, as the bundled corpus) in jsonl files."""
    rng = random.Random(1)
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    docs: list[str] = []
    for i in range(num_docs):  # every 10th an exact copy, every 10th + 5 a near copy of an earlier document
        if docs and i % 10 == 0:
            docs.append(rng.choice(docs))
        elif docs and i % 10 == 5:
            sentences = rng.choice(docs).split(". ")
            sentences[rng.randrange(len(sentences))] = "The planner measured it again"
            docs.append(". ".join(sentences))
        else:
            docs.append(_document(rng, zh=False))
    for number in range(files):
        with open(raw / f"part-{number:05d}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs[number::files])
    return raw


def _ours_spec(raw: Path, *, workers: int) -> DataSpec:
    return DataSpec(tokens_total=1e6, sources=[DataSource(name="en", path=raw)], workers=workers,
                    tokenizer=TokenizerSpec(vocab_size=4096, train_sample_bytes=4_000_000))


def _datatrove(raw: Path, work: Path, tokenizer_json: Path, *, bands: int, rows: int) -> None:
    from datatrove.executor.local import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter

    config = MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows)
    stages = iter(range(10))

    def run(steps: list[object], tasks: int = 1) -> None:  # one worker: the tasks run one after the other
        LocalPipelineExecutor(steps, tasks=tasks, workers=1, logging_dir=str(work / "logs" / str(next(stages))),
                              skip_completed=False).run()

    run([JsonlReader(str(raw)), GopherRepetitionFilter(), GopherQualityFilter(), PIIFormatter(),
         JsonlWriter(str(work / "filtered")), MinhashDedupSignature(output_folder=str(work / "sigs"), config=config)])
    run([MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"), config=config)],
        tasks=bands)  # datatrove: one task per bucket
    run([MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove"), config=config)])
    run([JsonlReader(str(work / "filtered")), MinhashDedupFilter(input_folder=str(work / "remove")),
         DocumentTokenizer(output_folder=str(work / "tokens"), tokenizer_name_or_path=str(tokenizer_json),
                           eos_token="<|endoftext|>")])


def bench_pipeline(num_docs: int) -> None:
    import logging

    logging.getLogger("datatrove").setLevel(logging.WARNING)
    from loguru import logger

    logger.remove()
    with tempfile.TemporaryDirectory() as tmp:
        raw = _write_corpus(Path(tmp), num_docs, files=4)
        start, cpu = time.perf_counter(), time.process_time()
        result = prepare_data(_ours_spec(raw, workers=1), data_dir=Path(tmp) / "ours")
        ours_s, ours_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        dedup = DedupSpec()
        _datatrove(raw, Path(tmp) / "datatrove", Path(tmp) / "ours" / "tokenizer.json", bands=dedup.num_bands,
                   rows=dedup.rows_per_band)
        theirs_s, theirs_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        kept = sum(s.num_docs for s in result.manifest.shards)
    print(f"pipeline_docs_per_cpu_s: {num_docs / ours_cpu_s:,.0f} docs/s ({theirs_cpu_s / ours_cpu_s:.2f}x vs "
          f"datatrove {num_docs / theirs_cpu_s:,.0f} docs/s; process CPU time, both in this one process)")
    print(f"pipeline_docs_per_s_per_core: {num_docs / ours_s:,.0f} docs/s ({theirs_s / ours_s:.2f}x vs datatrove "
          f"{num_docs / theirs_s:,.0f} docs/s; wall time; {num_docs:,} docs in, {kept:,} kept by us)")


_SCALING_CHILD = """
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from data import _ours_spec
from leantrain.data.pipeline import prepare_data
start, cpu = time.perf_counter(), time.process_time()
prepare_data(_ours_spec(Path(sys.argv[1]), workers=int(sys.argv[3])), data_dir=Path(sys.argv[2]))
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall_s": time.perf_counter() - start, "main_cpu_s": time.process_time() - cpu,
                  "workers_cpu_s": children.ru_utime + children.ru_stime}))
"""


def bench_scaling(num_docs: int) -> None:
    """1 vs 2 workers. Wall time, and the CPU-time critical path (main process + the workers' CPU time split
    over the workers: the tasks are equal-sized files): on a shared VM whose CPU share does not grow with
    the number of processes, wall time cannot show scaling, CPU time can."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = _write_corpus(Path(tmp), num_docs, files=8)
        runs = {}
        for workers in (1, 2):
            out = subprocess.run([sys.executable, "-c", _SCALING_CHILD, str(raw), str(Path(tmp) / f"w{workers}"),
                                  str(workers), str(Path(__file__).parent)], capture_output=True, text=True, check=True)
            runs[workers] = json.loads(out.stdout.strip().splitlines()[-1])
        same = all((Path(tmp) / "w1" / p.relative_to(Path(tmp) / "w2")).read_bytes() == p.read_bytes()
                   for p in (Path(tmp) / "w2").rglob("*.bin"))
    one, two = runs[1], runs[2]
    path_one = one["main_cpu_s"] + one["workers_cpu_s"]
    path_two = two["main_cpu_s"] + two["workers_cpu_s"] / 2
    print(f"prepare_2_workers_cpu_critical_path_s: {path_two:.2f} s ({path_one / path_two:.2f}x vs 1 worker "
          f"{path_one:.2f} s; CPU-s main {two['main_cpu_s']:.2f} + workers {two['workers_cpu_s']:.2f}; shards "
          f"identical: {same})")
    speedup = one["wall_s"] / two["wall_s"]
    print(f"prepare_2_workers_wall_docs_per_s: {num_docs / two['wall_s']:,.0f} docs/s ({speedup:.2f}x vs 1 worker "
          f"{num_docs / one['wall_s']:,.0f} docs/s; wall time on the shared VM)")


# VmHWM (the peak RSS of this process image), not getrusage's ru_maxrss: Linux carries ru_maxrss over
# fork + exec, so a child of this (torch-importing) bench would report the bench's own size.
_RSS_CHILD = """
import sys
from pathlib import Path
from leantrain.data.pipeline import prepare_data
from leantrain.spec.schema import DataSpec
spec = DataSpec.model_validate_json(Path(sys.argv[1]).read_text())
prepare_data(spec, data_dir=Path(sys.argv[2]))
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def bench_rss(sizes: tuple[int, ...] = (20_000, 100_000)) -> None:
    """Peak RSS of one prepare process (one worker; it imports only what prepare imports, no torch) on
    corpora written beforehand in files of 5k documents each (the task size)."""
    peaks = {}
    for num_docs in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            raw = _write_corpus(Path(tmp), num_docs, files=max(1, num_docs // 5000))
            (Path(tmp) / "spec.json").write_text(_ours_spec(raw, workers=1).model_dump_json())
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(Path(tmp) / "spec.json"),
                                  str(Path(tmp) / "data")], capture_output=True, text=True, check=True)
            peaks[num_docs] = int(out.stdout.split()[-1]) / 1024  # KiB -> MiB
    small, large = sizes[0], sizes[-1]
    print(f"prepare_peak_rss_mib_{large // 1000}k_docs: {peaks[large]:,.0f} MiB ({peaks[large] / peaks[small]:.2f}x vs "
          f"{peaks[small]:,.0f} MiB at {small // 1000}k docs; corpus {large / small:.0f}x larger)")


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
        # dp 1 reads the stream in order; rank 3 of 64 jumps (each of its windows usually lands in another block
        # of the epoch order, which data.shuffle then permutes afresh: the sampler's worst case)
        for suffix, dp_rank, dp_size in (("", 0, 1), ("_rank3_of_64", 3, 64)):
            sampler = PackedBatchSampler(Path(tmp), seq_len=4096, micro_batch=8, dp_rank=dp_rank, dp_size=dp_size,
                                         seed=0)
            sampler.next_batch()
            batches = 0
            start = time.perf_counter()
            while time.perf_counter() - start < duration_s:
                sampler.next_batch()
                batches += 1
            elapsed = time.perf_counter() - start
            rate = batches * 8 * 4096 / elapsed
            print(f"loader_tokens_per_s{suffix}: {rate:,.0f} tokens/s ({rate / needed:.1f}x vs one H100 on a 1B model "
                  f"at 40% MFU, {needed:,.0f} tokens/s)")


def main() -> None:
    quick = "--quick" in sys.argv
    bench_dedup(1000 if quick else 3000)
    bench_pipeline(2000 if quick else 10_000)
    bench_scaling(4000 if quick else 16_000)
    bench_rss((2000, 10_000) if quick else (20_000, 100_000))
    bench_tokenize_shard()
    bench_loader()


if __name__ == "__main__":
    main()
