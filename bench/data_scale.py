"""`prepare` memory and throughput at scale. Prints `name: value unit (...)` lines.

- long line: peak RSS of a `prepare` process whose jsonl holds one 100 MB line among short documents
  (the line is skipped as `doc_too_large` while it streams, data.max_doc_bytes 8 MiB);
- peak RSS at 10k vs larger corpora (default 1M) with one worker, each phase's own peak, and CPU docs/s
  per core;
- workers 1 -> 2 -> all cores on the same corpus in one run: wall time, and the CPU-time critical path
  (main process + the workers' CPU seconds over the number of workers; the tasks are equal-sized files),
  which a shared machine cannot inflate the way it inflates wall time.

Peak RSS is VmHWM of the prepare process (with one worker every task runs in it) and, with more
workers, the largest worker's peak as well. Corpora: random words from a 5,000-word vocabulary with
stop words mixed in (so the Gopher rules keep them), 40-120 words each, every 20th an exact copy and every
20th + 10 a near copy (3 words changed) of an earlier document; jsonl files of 20k documents (a task each;
8 equal files for the scaling run). Run it on a clean export of the commit to measure (`git archive HEAD`
into a folder, PYTHONPATH=that/src) when the working tree holds other unfinished work.
Run: .venv/bin/python bench/data_scale.py [--sizes 10000,100000,1000000] [--scaling-docs 100000]
     [--skip-long-line] [--corpora DIR]   (DIR keeps the generated corpora for the next run; 0 skips a part)
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from leantrain.spec.schema import DataSource, DataSpec, TokenizerSpec  # noqa: E402

FILE_DOCS = 20_000
STOP = ["the", "of", "and", "to", "that", "with", "have", "be"]


def write_corpus(raw: Path, num_docs: int, *, seed: int = 0, file_docs: int = FILE_DOCS) -> int:
    """Random-vocabulary jsonl files of `file_docs` documents; returns the bytes written."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(5000)]
    words = vocab + STOP * 200  # about a quarter of the words are stop words
    raw.mkdir(parents=True, exist_ok=True)
    recent: list[str] = []
    written = 0
    out = None
    for i in range(num_docs):
        if i % file_docs == 0:
            if out is not None:
                out.close()
            out = open(raw / f"part-{i // file_docs:05d}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        if recent and i % 20 == 0:
            text = rng.choice(recent)
        elif recent and i % 20 == 10:
            tokens = rng.choice(recent).split()
            for _ in range(3):
                tokens[rng.randrange(len(tokens))] = rng.choice(vocab)
            text = " ".join(tokens)
        else:
            text = " ".join(rng.choices(words, k=rng.randint(40, 120))) + "."
            recent = (recent + [text])[-1000:]
        line = json.dumps({"text": text}) + "\n"
        written += len(line)
        out.write(line)  # type: ignore[union-attr]
    if out is not None:
        out.close()
    return written


def _spec(raw: Path, *, workers: int) -> DataSpec:
    return DataSpec(tokens_total=1e6, sources=[DataSource(name="syn", path=raw)], workers=workers,
                    cleaning={"min_words": 10}, shard_size_tokens=1 << 24,
                    tokenizer=TokenizerSpec(vocab_size=4096, train_sample_bytes=4_000_000))


# VmHWM of this process image (getrusage's ru_maxrss carries over fork + exec), and each phase's own
# peak (VmHWM reset before the phase); the workers' largest peak from RUSAGE_CHILDREN (started by this process).
_CHILD = """
import json, resource, sys, time
from pathlib import Path
from leantrain.data import layout, pipeline
from leantrain.spec.schema import DataSpec

def hwm():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024

peak, phases = [0.0], {}

def phase(label_of, fn):  # the phase's own peak: VmHWM reset (clear_refs 5) before it, read after it
    def wrapped(*args, **kwargs):
        peak[0] = max(peak[0], hwm())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        try:
            return fn(*args, **kwargs)
        finally:
            label = label_of(args)
            phases[label] = max(phases.get(label, 0.0), hwm())
            peak[0] = max(peak[0], phases[label])
    return wrapped

pipeline._run_stage = phase(lambda a: a[2], pipeline._run_stage)
pipeline.resolve = phase(lambda a: "dedup resolve", pipeline.resolve)
pipeline.build_tokenizer = phase(lambda a: "train tokenizer", pipeline.build_tokenizer)
pipeline._shard_stage = phase(lambda a: "shards", pipeline._shard_stage)
layout.Manifest.write = phase(lambda a: "manifest + sample index", layout.Manifest.write)
spec = DataSpec.model_validate_json(Path(sys.argv[1]).read_text())
start = time.perf_counter()
result = pipeline.prepare_data(spec, data_dir=Path(sys.argv[2]))
wall = time.perf_counter() - start
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
src = result.report["sources"][0]
print(json.dumps({"wall_s": wall, "main_cpu_s": me.ru_utime + me.ru_stime,
                  "workers_cpu_s": kids.ru_utime + kids.ru_stime, "main_hwm_mib": max(peak[0], hwm()),
                  "phases_mib": phases, "worker_max_rss_mib": kids.ru_maxrss / 1024, "docs_in": src["docs_in"],
                  "docs_out": src["docs_out"], "read_problems": src["read_problems"]}))
"""


def run_prepare(raw: Path, out: Path, *, workers: int) -> dict[str, object]:
    spec_path = out.parent / f"{out.name}.spec.json"
    spec_path.write_text(_spec(raw, workers=workers).model_dump_json())
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(spec_path), str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def bench_long_line(tmp: Path) -> None:
    raw = tmp / "long"
    write_corpus(raw, 2000, seed=1)
    with open(raw / "part-00000.jsonl", "a", encoding="utf-8") as f:
        f.write('{"text": "' + "word " * 20_000_000 + '"}\n')  # one 100 MB line
    run = run_prepare(raw, tmp / "long_out", workers=1)
    print(f"long_line_100mb_peak_rss_mib: {run['main_hwm_mib']:,.0f} MiB (one 100 MB jsonl line among "
          f"{run['docs_in']:,} documents; read problems {run['read_problems']})")


def _corpus(root: Path, name: str, num_docs: int, **kwargs: int) -> tuple[Path, int, float]:
    """A corpus folder (reused when `root` kept it from an earlier run: same sizes and seeds, same files)."""
    raw, done = root / name, root / f"{name}.done"
    if done.is_file():
        return raw, int(done.read_text()), 0.0
    started = time.perf_counter()
    size = write_corpus(raw, num_docs, **kwargs)
    done.write_text(str(size))
    return raw, size, time.perf_counter() - started


def bench_rss(root: Path, out: Path, sizes: list[int]) -> None:
    runs = {}
    for num_docs in sizes:
        raw, size, written = _corpus(root, f"rss{num_docs}", num_docs)
        runs[num_docs] = run_prepare(raw, out / f"rss{num_docs}_out", workers=1)
        run = runs[num_docs]
        cpu = run["main_cpu_s"] + run["workers_cpu_s"]  # type: ignore[operator]
        phases = ", ".join(f"{k} {v:,.0f}" for k, v in run["phases_mib"].items())  # type: ignore[attr-defined]
        print(f"prepare_1_worker_{num_docs // 1000}k_docs: peak RSS {run['main_hwm_mib']:,.0f} MiB, "
              f"{num_docs / cpu:,.0f} docs/CPU-s, {num_docs / run['wall_s']:,.0f} docs/s wall "  # type: ignore[operator]
              f"({size / 1e6:,.0f} MB corpus, written in {written:.0f} s; {run['docs_out']:,} of "
              f"{run['docs_in']:,} kept); peak per phase MiB: {phases}", flush=True)
        shutil.rmtree(out / f"rss{num_docs}_out", ignore_errors=True)
    small = sizes[0]
    for large in sizes[1:]:
        ratio = runs[large]["main_hwm_mib"] / runs[small]["main_hwm_mib"]  # type: ignore[operator]
        print(f"prepare_peak_rss_ratio_{large // 1000}k_vs_{small // 1000}k: {ratio:.2f}x "
              f"({runs[large]['main_hwm_mib']:,.0f} vs {runs[small]['main_hwm_mib']:,.0f} MiB; corpus "
              f"{large / small:,.0f}x larger)")


def bench_scaling(root: Path, tmp: Path, num_docs: int) -> None:
    raw, _, _ = _corpus(root, f"scale{num_docs}", num_docs, seed=2, file_docs=max(num_docs // 8, 1))  # 8 tasks
    cores = os.cpu_count() or 1
    counts = sorted({1, 2, cores})
    runs = {w: run_prepare(raw, tmp / f"scale_w{w}", workers=w) for w in counts}
    same = all((tmp / "scale_w1" / p.relative_to(tmp / f"scale_w{w}")).read_bytes() == p.read_bytes()
               for w in counts[1:] for p in (tmp / f"scale_w{w}").rglob("*.bin"))
    base = runs[1]
    base_path = base["main_cpu_s"] + base["workers_cpu_s"]  # type: ignore[operator]
    print(f"prepare_1_worker_{num_docs // 1000}k_docs_8_tasks: {num_docs / base_path:,.0f} docs/CPU-s, wall "
          f"{base['wall_s']:.1f} s; peak RSS {base['main_hwm_mib']:,.0f} MiB", flush=True)
    for w in counts[1:]:
        run = runs[w]
        path = run["main_cpu_s"] + run["workers_cpu_s"] / w  # type: ignore[operator]
        cpu = run["main_cpu_s"] + run["workers_cpu_s"]  # type: ignore[operator]
        print(f"prepare_{w}_workers_{num_docs // 1000}k_docs: CPU critical path {path:.1f} s "
              f"({base_path / path:.2f}x vs 1 worker {base_path:.1f} s), wall {run['wall_s']:.1f} s "
              f"({base['wall_s'] / run['wall_s']:.2f}x vs {base['wall_s']:.1f} s); {num_docs / cpu:,.0f} docs/CPU-s "
              f"(per core; {num_docs / base_path:,.0f} with 1 worker); peak RSS main "  # type: ignore[operator]
              f"{run['main_hwm_mib']:,.0f} MiB, largest worker {run['worker_max_rss_mib']:,.0f} MiB; shards "
              f"identical to 1 worker: {same}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    sizes = [int(n) for n in args[args.index("--sizes") + 1].split(",")] if "--sizes" in args else [10_000, 1_000_000]
    scaling = int(args[args.index("--scaling-docs") + 1]) if "--scaling-docs" in args else 100_000
    keep = Path(args[args.index("--corpora") + 1]) if "--corpora" in args else None
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if "--skip-long-line" not in args:
            bench_long_line(Path(tmp))
        if scaling:
            bench_scaling(root, Path(tmp), scaling)
        if sizes and sizes != [0]:
            bench_rss(root, Path(tmp), sizes)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end; bench peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
