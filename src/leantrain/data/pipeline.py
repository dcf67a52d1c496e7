"""`prepare` as tasks over input files: clean (per file, in parallel) → dedup (hash-range merges, in
parallel, then one resolution) → tokenizer → encode (per file, in parallel) → shards (in input order).

The order of documents is the input order (sources in spec order, each source's files sorted, rows in
file order), never the order tasks finish in, so the data dir is byte-identical for any `data.workers`
and for `data.executor: local | ray` (tasks.py, executor.py, clusters.py).

Crash-resume: `_work/inputs.json` holds a fingerprint of the data settings and input files. With the same
fingerprint a re-run keeps what finished: every published clean/encode task folder, every merged hash
range, the dedup decision (`dedup_done.json`), `tokenizer.json`, and every shard logged in
`_work/shards.jsonl` whose files still hash to the logged sha256 (shard writing continues after the last
verified shard of each split and source). Shard cut points depend only on the documents, so a resumed run
writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from leantrain.data import demo_corpus
from leantrain.data.chat import MASKED_FORMATS, template_for
from leantrain.data.chat_prepare import task_masked_docs, write_masked_split_shards
from leantrain.data.clusters import group_merges, merge_steps, plan_merges, resolve
from leantrain.data.dedup import s_curve
from leantrain.data.executor import Executor, make_executor
from leantrain.data.fingerprint import content_version
from leantrain.data.layout import (
    MANIFEST,
    PII_AUDIT,
    REPORT,
    SPLITS,
    TOKENIZER,
    Manifest,
    MixtureStage,
    write_split_shards,
)
from leantrain.data.preference import masked_source_entry
from leantrain.data.progress import StageProgress
from leantrain.data.readers import ReadStats, list_source, no_documents
from leantrain.data.shards import ShardInfo, atomic_write_bytes, sha256_file, token_dtype
from leantrain.data.stats import SourceStats, build_report
from leantrain.data.tasks import InputTask, clean_task, encode_task, kept_texts, plan_tasks, read_json, task_dir
from leantrain.data.tokenizer import TokenizerInfo, build_tokenizer, load_info
from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSource, DataSpec

WORK = "_work"


@dataclass
class PrepareResult:
    """What `prepare_data` did: the manifest written, the report, and how much was reused."""

    data_dir: Path
    manifest: Manifest
    report: dict[str, Any]
    reused_shards: int
    up_to_date: bool


def resolve_sources(spec: DataSpec, *, data_dir: Path) -> list[DataSource]:
    """Sources with builtin corpora materialised (under data_dir/raw/ when no path is given)."""
    resolved = []
    for source in spec.sources:
        if source.builtin is not None:
            path = Path(source.path) if source.path is not None else data_dir / "raw" / f"{source.name}.jsonl"
            source = source.model_copy(update={"path": demo_corpus.materialize(source.builtin, path)})
        resolved.append(source)
    return resolved


def fingerprint(spec: DataSpec, sources: list[DataSource], files: dict[str, list[str]]) -> str:
    """Hash of everything that changes the cleaned text or the shards (not weights, stages, seq_len, workers)."""
    settings = spec.model_dump(mode="json", include={"cleaning", "dedup", "pii", "tokenizer", "shard_size_tokens",
                                                     "valid_fraction", "on_bad_input", "max_doc_bytes"})
    settings["sources"] = [s.model_dump(mode="json", exclude={"weight", "path"}) for s in sources]
    versions = [content_version(path) for s in sources for path in files[s.name]]  # resolved path + content
    if spec.tokenizer.kind == "file" and spec.tokenizer.path is not None and Path(spec.tokenizer.path).is_file():
        versions.append(content_version(str(spec.tokenizer.path)))  # a changed tokenizer file means new shards
    settings["files"] = versions
    if any(s.format in MASKED_FORMATS for s in sources):  # padded to seq_len, rendered by the template
        settings["chat"] = [spec.seq_len, template_for(spec.tokenizer.path)]
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _reset(data_dir: Path) -> None:
    """Remove what a previous prepare wrote (only our own names; other files in the folder stay)."""
    for name in (WORK, *SPLITS):
        shutil.rmtree(data_dir / name, ignore_errors=True)
    for name in (MANIFEST, REPORT, TOKENIZER, PII_AUDIT):
        (data_dir / name).unlink(missing_ok=True)


def _salt(spec: DataSpec) -> bytes:
    value = os.environ.get(spec.pii.salt_env)
    return value.encode("utf-8") if value else secrets.token_bytes(32)


def _run_stage(executor: Executor, progress: StageProgress, description: str, fn: Callable[..., Any],
               items: list[Any], args: tuple[Any, ...], *, sizes: list[int], docs: Callable[[Any], int]
               ) -> list[Any]:
    """Run one stage's tasks with a progress line (docs, docs/s, MB/s, ETA by bytes)."""
    task = progress.start(description, total_bytes=sum(sizes))
    results = executor.map(fn, items, args, on_done=lambda i, r: progress.advance(task, docs=docs(r),
                                                                                  num_bytes=sizes[i]))
    progress.finish(task)
    return results


def _source_stats(spec: DataSpec, sources: list[DataSource], tasks: list[InputTask], cleaned: list[dict[str, Any]],
                  unread: dict[str, list[str]]) -> list[SourceStats]:
    """Per-source counters from the clean tasks (and the files of a folder no reader fits, named as
    `unread_file`); a source that yielded nothing is an error."""
    stats = {s.name: SourceStats(name=s.name, weight=s.weight, read=ReadStats()) for s in sources}
    for name, paths in unread.items():
        for path in paths:
            stats[name].read.problem("unread_file", path)
    for task, result in zip(tasks, cleaned, strict=True):
        stat = stats[task.source.name]
        stat.docs_in += result["docs_in"]
        stat.chars_in += result["chars_in"]
        stat.drops.update(result["drops"])
        stat.read.files += result["files"]
        stat.read.bytes_read += result["bytes_read"]
        for kind, count in result["read_problems"].items():
            stat.read.problems[kind] += count
            examples = stat.read.examples.setdefault(kind, [])
            examples += result["read_examples"][kind][: max(0, 5 - len(examples))]
        if result["bad_input"] is not None:
            stat.bad_inputs.append(result["bad_input"])
            stat.docs_lost_to_bad_input += result["docs_lost_to_bad_input"]
    for source in sources:
        if stats[source.name].docs_in == 0 and not stats[source.name].bad_inputs:
            raise no_documents(source, stats[source.name].read)
    return list(stats.values())


def _dedup_stage(spec: DataSpec, *, executor: Executor, progress: StageProgress, tasks: list[InputTask],
                 offsets: np.ndarray, work: Path) -> dict[str, Any]:
    done = read_json(work / "dedup_done.json")
    if done is not None:
        return done
    steps = plan_merges(spec.dedup, num_records=int(offsets[-1]))
    folders = [task_dir(work, t) for t in tasks]
    groups = group_merges(steps, tasks=4 * executor.num_workers)  # each folder's files mapped once a group
    merged = [result for group in _run_stage(executor, progress, "dedup merge", merge_steps, groups,
                                             (folders, offsets, work / "dedup", spec.dedup),
                                             sizes=[len(g) for g in groups], docs=lambda r: 0) for result in group]
    counts = resolve(steps, folders, offsets, work / "dedup")
    band_steps = [m for s, m in zip(steps, merged, strict=True) if s.space != "exact"]
    result = {"exact": spec.dedup.exact, "near": spec.dedup.near, "bands": spec.dedup.num_bands,
              "rows": spec.dedup.rows_per_band, "verify_jaccard": spec.dedup.verify_jaccard,
              "shingle_words": spec.dedup.shingle_words, "shingle_chars": spec.dedup.shingle_chars,
              "bucket_records": spec.dedup.bucket_records, "merge_steps": len(steps),
              "normalize_numbers": spec.dedup.normalize_numbers,
              "lsh_candidates": sum(max(m["candidates"], 0) for m in band_steps),
              "rejected_by_verify": sum(max(m["rejected"], 0) for m in band_steps),
              "s_curve": s_curve(bands=spec.dedup.num_bands, rows=spec.dedup.rows_per_band), **counts}
    atomic_write_bytes(work / "dedup_done.json", json.dumps(result).encode())
    return result


def _tokenizer_sample(spec: DataSpec, sources: list[DataSource], tasks: list[InputTask], work: Path
                      ) -> Iterator[str]:
    """Training text for BPE: the first kept documents of each source, an equal byte budget per source."""
    budget = spec.tokenizer.train_sample_bytes // max(len(sources), 1)
    for source in sources:
        used = 0
        for task in (t for t in tasks if t.source.name == source.name):
            for text in kept_texts(work, task, split="train"):
                yield text
                used += len(text.encode("utf-8"))
                if used >= budget:
                    break
            if used >= budget:
                break


def _verified_log(work: Path, data_dir: Path) -> dict[tuple[str, str], list[ShardInfo]]:
    """Logged shards whose files still match their hashes, per (split, source), stopping at the first bad one."""
    kept: dict[tuple[str, str], list[ShardInfo]] = {}
    broken: set[tuple[str, str]] = set()
    log = work / "shards.jsonl"
    if not log.is_file():
        return kept
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            info = ShardInfo.from_json(json.loads(line))
        except (json.JSONDecodeError, TypeError):
            break  # a torn last line from the crash
        key = (info.split, info.source)
        bin_path, idx_path = data_dir / info.path, (data_dir / info.path).with_suffix(".idx")
        ok = (key not in broken and bin_path.is_file() and idx_path.is_file()
              and sha256_file(bin_path) == info.sha256 and sha256_file(idx_path) == info.idx_sha256)
        if ok:
            kept.setdefault(key, []).append(info)
        else:
            broken.add(key)
    return kept


def _task_docs(work: Path, tasks: list[InputTask], *, split: str, dtype: type[np.number]) -> Iterator[np.ndarray]:
    """The encoded documents (EOS included) of these tasks, in order, read by memory map."""
    for task in tasks:
        folder = task_dir(work, task)
        lengths = np.load(folder / f"{split}.len.npy")
        if not len(lengths):
            continue
        tokens = np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r")
        ends = np.cumsum(lengths)
        for end, length in zip(ends.tolist(), lengths.tolist(), strict=True):
            yield tokens[end - length : end]


def _shard_stage(spec: DataSpec, sources: list[DataSource], tasks: list[InputTask], *, data_dir: Path, work: Path,
                 dtype: type[np.number], progress: StageProgress, on_shard: Callable[[ShardInfo], None] | None
                 ) -> tuple[list[ShardInfo], int]:
    kept = _verified_log(work, data_dir)
    # rewrite the log with only the verified entries, so a torn or stale tail never survives
    log_lines = [json.dumps(s.to_json()) + "\n" for infos in kept.values() for s in infos]
    atomic_write_bytes(work / "shards.jsonl", "".join(log_lines).encode())
    reused = sum(len(v) for v in kept.values())
    all_shards: list[ShardInfo] = []
    with open(work / "shards.jsonl", "a", encoding="utf-8") as log:
        def logged(shard: ShardInfo) -> None:
            log.write(json.dumps(shard.to_json()) + "\n")
            log.flush()
            os.fsync(log.fileno())
            progress.advance(task, docs=shard.num_docs, num_bytes=shard.num_bytes)
            if on_shard is not None:
                on_shard(shard)

        for split in SPLITS:
            for source in sources:
                done = kept.get((split, source.name), [])
                all_shards += done
                task = progress.start(f"shards {split}/{source.name}")
                mine = [t for t in tasks if t.source.name == source.name]
                write, all_docs = write_split_shards, _task_docs(work, mine, split=split, dtype=dtype)
                if source.format in MASKED_FORMATS:  # tokens and their loss mask (data/chat_prepare.py)
                    write = write_masked_split_shards  # type: ignore[assignment]
                    all_docs = (d for t in mine for d in task_masked_docs(task_dir(work, t), split=split,
                                                                          dtype=dtype))  # type: ignore[misc]
                docs = islice(all_docs, sum(s.num_docs for s in done), None)
                all_shards += write(
                    data_dir, split=split, source=source.name, docs=docs, dtype=dtype,
                    shard_size_tokens=spec.shard_size_tokens, first_number=len(done), on_shard=logged,
                )
                progress.finish(task)
    return all_shards, reused


def _work_note(path: Path) -> dict[str, Any]:
    """What an unfinished prepare noted about its inputs ({} when none). A damaged note (hand-edited, a bad disk)
    cannot tell whose work `_work/` holds: refused naming it, not a traceback."""
    from leantrain.errors import read_json_object

    if not path.exists():
        return {}
    try:
        return read_json_object(path)
    except UserInputError as err:
        raise UserInputError(f"{err} — an unfinished prepare's note of its inputs: remove {path.parent} to "
                             "start that work over (finished shards and manifest.json stay)") from None


def _start(spec: DataSpec, *, data_dir: Path, inputs: str, force: bool) -> None:
    """Start over (clearing only our own files) unless `_work/` belongs to the same inputs and the same task split
    (`task_bytes`: finished task folders are named by their place in the plan, so another split must not reuse
    them; it took one file's second byte range for another file's work, documents lost without a word)."""
    work = data_dir / WORK
    noted = _work_note(work / "inputs.json")
    previous = noted.get("sha256")
    if previous == inputs and noted.get("task_bytes", spec.task_bytes) == spec.task_bytes:
        return
    if previous != inputs:  # other inputs (the same ones planned in other tasks: only the work is redone)
        ours = previous is not None or (data_dir / MANIFEST).is_file()
        if not ours and any((data_dir / split).exists() for split in SPLITS):
            raise UserInputError(f"{data_dir} already has {'/'.join(SPLITS)} folders that prepare did not write; "
                                 "choose an empty or new folder with --out")
        if (data_dir / MANIFEST).is_file() and not force:
            # A finished data dir may be what a run (and its checkpoints' data position) depends on.
            raise UserInputError(
                f"{data_dir} is a finished data dir built from other inputs (sources, cleaning, dedup, PII or "
                "tokenizer settings changed); write the new one elsewhere with --out, or rebuild it in place "
                "with --force (runs that read it will then see different tokens)"
            )
    _reset(data_dir)
    work.mkdir(parents=True)
    atomic_write_bytes(work / "inputs.json", json.dumps({"sha256": inputs, "task_bytes": spec.task_bytes}).encode())


def prepare_data(
    spec: DataSpec, *, data_dir: Path, console: Console | None = None,
    on_shard: Callable[[ShardInfo], None] | None = None, force: bool = False,
) -> PrepareResult:
    """Build (or resume, or confirm up to date) the data dir for `spec`. See the module docstring."""
    data_dir = Path(data_dir).absolute()  # tasks on a Ray cluster run in the workers' own folders
    data_dir.mkdir(parents=True, exist_ok=True)
    sources = resolve_sources(spec, data_dir=data_dir)
    listed = {s.name: list_source(s) for s in sources}
    files = {name: found for name, (found, _) in listed.items()}
    inputs = fingerprint(spec, sources, files)
    work = data_dir / WORK
    up_to_date = _up_to_date(data_dir, inputs, force=force)
    if up_to_date is not None:
        _apply_mixture(spec, up_to_date.manifest)  # weights and stages may change without re-tokenizing
        up_to_date.manifest.write(data_dir)
        return up_to_date
    _start(spec, data_dir=data_dir, inputs=inputs, force=force)
    tasks = plan_tasks(sources, files, task_bytes=spec.task_bytes)
    timings: dict[str, float] = {}
    with make_executor(spec, num_tasks=len(tasks)) as executor, StageProgress(console) as progress:
        start = time.perf_counter()
        sizes = [t.num_bytes for t in tasks]
        cleaned = _run_stage(executor, progress, "clean", clean_task, tasks, (spec, work, _salt(spec)),
                             sizes=sizes, docs=lambda r: r["docs_in"])
        stats = _source_stats(spec, sources, tasks, cleaned, {name: rest for name, (_, rest) in listed.items()})
        offsets = np.concatenate([[0], np.cumsum([r["candidates"] for r in cleaned])]).astype(np.int64)
        timings["clean_s"] = time.perf_counter() - start
        start = time.perf_counter()
        dedup = _dedup_stage(spec, executor=executor, progress=progress, tasks=tasks, offsets=offsets, work=work)
        timings["dedup_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if not (data_dir / TOKENIZER).is_file():
            task = progress.start("train tokenizer")
            sample = progress.counted(task, _tokenizer_sample(spec, sources, tasks, work))
            build_tokenizer(spec.tokenizer, sample, out_path=data_dir / TOKENIZER)
            progress.finish(task)
        _, info = load_info(data_dir / TOKENIZER, spec.tokenizer)
        timings["tokenizer_s"] = time.perf_counter() - start
        start = time.perf_counter()
        dtype = token_dtype(info.vocab_size)
        chat = (template_for(spec.tokenizer.path), spec.seq_len) if any(
            s.format in MASKED_FORMATS for s in sources) else None
        encoded = _run_stage(executor, progress, "encode", encode_task, tasks,
                             (work, data_dir / TOKENIZER, info.eos_id, np.dtype(dtype).name, chat),
                             sizes=sizes, docs=lambda r: sum(r["docs"].values()))
        shards, reused = _shard_stage(spec, sources, tasks, data_dir=data_dir, work=work, dtype=dtype,
                                      progress=progress, on_shard=on_shard)
        timings["encode_shards_s"] = time.perf_counter() - start
    for task, result in zip(tasks, encoded, strict=True):
        stat = next(s for s in stats if s.name == task.source.name)
        stat.docs_out.update(result["docs"])
        stat.chars_out += result["chars_out"]
        stat.pii.update(result["pii"])
    for stat in stats:
        mine = [r for t, r in zip(tasks, cleaned, strict=True) if t.source.name == stat.name]
        stat.drops.update(_dup_drops(work, [t for t in tasks if t.source.name == stat.name]))
        assert sum(r["candidates"] for r in mine) == sum(stat.docs_out.values()) + stat.drops["exact_duplicate"] + \
            stat.drops["near_duplicate"]
    _write_audit(spec, work, tasks)
    return _finish(spec, data_dir=data_dir, work=work, stats=stats, dedup=dedup, shards=shards, info=info,
                   inputs=inputs, timings=timings, reused=reused)


def _dup_drops(work: Path, tasks: list[InputTask]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for task in tasks:
        decision = np.bincount(np.load(task_dir(work, task) / "keep.npy"), minlength=3)
        counts["exact_duplicate"] += int(decision[1])
        counts["near_duplicate"] += int(decision[2])
    return +counts


def _write_audit(spec: DataSpec, work: Path, tasks: list[InputTask]) -> None:
    """pii_audit.jsonl: the tasks' audit rows of kept documents, in input order."""
    if not (spec.pii.enabled and spec.pii.audit):
        return
    with open(work / (PII_AUDIT + ".tmp"), "wb") as out:
        for task in tasks:
            with open(task_dir(work, task) / "audit.jsonl", "rb") as part:
                shutil.copyfileobj(part, out)
    os.replace(work / (PII_AUDIT + ".tmp"), work / PII_AUDIT)


def _apply_mixture(spec: DataSpec, manifest: Manifest) -> None:
    weights = {s.name: s.weight for s in spec.sources}
    for source in manifest.sources:
        source["weight"] = weights[source["name"]]
    manifest.stages = [MixtureStage(weights=dict(st.weights), until_tokens=st.until_tokens) for st in spec.stages]


def _up_to_date(data_dir: Path, inputs: str, *, force: bool = False) -> PrepareResult | None:
    from leantrain.data.layout import load_manifest

    if not (data_dir / MANIFEST).is_file() or not (data_dir / REPORT).exists():
        return None
    try:
        manifest = load_manifest(data_dir)
    except Exception:  # an unreadable old manifest just means: rebuild
        return None
    if manifest.extra.get("inputs_sha256") != inputs:
        return None
    if any(not (data_dir / s.path).is_file() or sha256_file(data_dir / s.path) != s.sha256 for s in manifest.shards):
        return None
    report = read_report(data_dir / REPORT, force=force)
    if report is None:
        return None  # --force: rebuilt, report and all
    return PrepareResult(data_dir=data_dir, manifest=manifest, report=report, reused_shards=len(manifest.shards),
                         up_to_date=True)


def read_report(path: Path, *, force: bool = False) -> dict[str, Any] | None:
    """The report.json of an up-to-date data dir, checked to be one prepare can show. A damaged one (hand-edited:
    not JSON, not an object, keys missing or of the wrong type) is refused naming it; None with `force`."""
    import io

    from leantrain.data.stats import render_report
    from leantrain.errors import read_json_object

    try:
        report = read_json_object(path)
        render_report(report, console=Console(file=io.StringIO()))
    except UserInputError as err:
        problem = str(err)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        problem = f"{path}: not the report prepare writes ({type(err).__name__}: {err}); was it edited by hand?"
    else:
        return report
    if force:
        return None
    raise UserInputError(f"{problem} — the shards and manifest.json are up to date: `leantrain prepare --force` "
                         "rebuilds the data dir and its report")


def _finish(spec: DataSpec, *, data_dir: Path, work: Path, stats: list[SourceStats], dedup: dict[str, Any],
            shards: list[ShardInfo], info: TokenizerInfo, inputs: str, timings: dict[str, float], reused: int
            ) -> PrepareResult:
    sources = [s.to_json() for s in stats]
    weights = {s.name: s.weight for s in spec.sources}
    for source in sources:
        source["weight"] = weights[source["name"]]
        for split in SPLITS:
            mine = [s for s in shards if s.source == source["name"] and s.split == split]
            source["tokens"][split] = sum(s.num_tokens for s in mine)
            source["docs"][split] = sum(s.num_docs for s in mine)
    report = build_report(sources=sources, dedup=dedup, tokenizer=info.__dict__, timings=timings)
    if (work / PII_AUDIT).is_file():
        os.replace(work / PII_AUDIT, data_dir / PII_AUDIT)
    manifest = Manifest(
        vocab_size=info.vocab_size, eos_id=info.eos_id, dtype=np.dtype(token_dtype(info.vocab_size)).name,
        sources=[{k: s[k] for k in ("name", "weight", "docs_in", "docs_out", "drops", "pii", "tokens", "docs",
                                    "bad_inputs")}
                 for s in sources],
        shards=shards,
        stages=[],
        tokenizer=info.__dict__,
        extra={"inputs_sha256": inputs, "dedup": report["dedup"], "pii": report["pii"],
               "valid_fraction": spec.valid_fraction},
    )
    for entry in manifest.sources:  # chat/preference sources: the sampler reads the masks and checks the padding
        fmt = next(s for s in spec.sources if s.name == entry["name"]).format
        if fmt in MASKED_FORMATS:
            entry.update(masked_source_entry(fmt, seq_len=spec.seq_len))
    _apply_mixture(spec, manifest)
    atomic_write_bytes(data_dir / REPORT, (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode())
    manifest.write(data_dir)
    shutil.rmtree(work, ignore_errors=True)
    return PrepareResult(data_dir=data_dir, manifest=manifest, report=report, reused_shards=reused, up_to_date=False)
