"""`prepare` as three resumable stages: clean (read → normalise → filter → dedup → redact → split), tokenizer,
shards. Then the manifest and report are written.

Crash-resume: `_work/inputs.json` holds a fingerprint of the data settings and input files. With the same
fingerprint a re-run keeps what finished: the cleaned text (`_work/clean/`, published by `clean_done.json`),
`tokenizer.json`, and every shard logged in `_work/shards.jsonl` whose files still hash to the logged
sha256; tokenizing continues after the last verified shard of each split and source. Shard cut points
depend only on the documents, so a resumed run writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from leantrain.data import demo_corpus
from leantrain.data.clean import normalize, quality_problem, text_stats
from leantrain.data.dedup import NearDeduplicator, exact_key, s_curve
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
from leantrain.data.pii import PIIRedactor
from leantrain.data.progress import StageProgress
from leantrain.data.readers import ReadStats, read_source, source_files
from leantrain.data.shards import ShardInfo, atomic_write_bytes, sha256_file, token_dtype
from leantrain.data.stats import SourceStats, build_report
from leantrain.data.tokenizer import TokenizerInfo, build_tokenizer, load_info
from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSource, DataSpec

WORK = "_work"
ENCODE_BATCH_DOCS = 512


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


def fingerprint(spec: DataSpec, sources: list[DataSource]) -> str:
    """Hash of everything that changes the cleaned text or the shards (not weights, stages or seq_len)."""
    settings = spec.model_dump(mode="json", include={"cleaning", "dedup", "pii", "tokenizer", "shard_size_tokens",
                                                     "valid_fraction"})
    settings["sources"] = [s.model_dump(mode="json", exclude={"weight", "path"}) for s in sources]
    files = [p for s in sources for p in source_files(s)]
    if spec.tokenizer.kind == "file" and spec.tokenizer.path is not None:
        files.append(Path(spec.tokenizer.path))  # a changed tokenizer file means new shards
    settings["files"] = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.is_file()]
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


def _clean_stage(spec: DataSpec, sources: list[DataSource], *, work: Path, progress: StageProgress
                 ) -> dict[str, Any]:
    """Read every source in spec order and write the kept, redacted documents with their split."""
    clean_dir = work / "clean"
    clean_dir.mkdir(parents=True, exist_ok=True)
    near = NearDeduplicator(spec.dedup) if spec.dedup.near else None
    seen_exact: set[bytes] = set()
    redactor = PIIRedactor(types=spec.pii.types, salt=_salt(spec)) if spec.pii.enabled else None
    stats: list[SourceStats] = []
    valid_cut = int(spec.valid_fraction * 2**64)
    audit_tmp = work / (PII_AUDIT + ".tmp")
    with open(audit_tmp, "w", encoding="utf-8") as audit:
        for source in sources:
            stat = SourceStats(name=source.name, weight=source.weight, read=ReadStats())
            task = progress.start(f"clean {source.name}")
            with open(clean_dir / f"{source.name}.jsonl", "w", encoding="utf-8") as out:
                for raw in read_source(source, stat.read):
                    stat.docs_in += 1
                    stat.chars_in += len(raw.text)
                    progress.advance(task, docs=1, num_bytes=len(raw.text.encode("utf-8")))
                    kept = _keep(raw.text, spec=spec, stat=stat, seen=seen_exact, near=near, valid_cut=valid_cut)
                    if kept is None:
                        continue
                    split, text = kept
                    if redactor is not None:
                        before = redactor.counts.copy()
                        text, rows = redactor(text, doc_id=raw.doc_id, source=source.name)
                        stat.pii.update(redactor.counts - before)
                        if spec.pii.audit:
                            audit.writelines(json.dumps(row) + "\n" for row in rows)
                    stat.docs_out[split] += 1
                    stat.chars_out += len(text)
                    out.write(json.dumps({"id": raw.doc_id, "split": split, "text": text}, ensure_ascii=False) + "\n")
            progress.finish(task)
            stats.append(stat)
    os.replace(audit_tmp, work / PII_AUDIT)
    result = {
        "sources": [s.to_json() for s in stats],
        "dedup": {"exact": spec.dedup.exact, "near": spec.dedup.near, "bands": spec.dedup.num_bands,
                  "rows": spec.dedup.rows_per_band, "verify_jaccard": spec.dedup.verify_jaccard,
                  "shingle_words": spec.dedup.shingle_words, "shingle_chars": spec.dedup.shingle_chars,
                  "lsh_candidates": near.num_candidates if near else 0,
                  "rejected_by_verify": near.num_rejected_by_verify if near else 0,
                  "s_curve": s_curve(bands=spec.dedup.num_bands, rows=spec.dedup.rows_per_band)},
    }
    atomic_write_bytes(work / "clean_done.json", json.dumps(result, indent=2).encode())
    return result


def _keep(text: str, *, spec: DataSpec, stat: SourceStats, seen: set[bytes], near: NearDeduplicator | None,
          valid_cut: int) -> tuple[str, str] | None:
    """(split, normalised text) of a document to keep, or None after counting why it was dropped."""
    cleaned = normalize(text, form=spec.cleaning.normalization)
    if not cleaned:
        stat.drops["empty"] += 1
        return None
    reason = quality_problem(cleaned, spec.cleaning)
    if reason is not None:
        stat.drops[reason] += 1
        return None
    stats = text_stats(cleaned)
    key = exact_key(stats)
    if spec.dedup.exact:
        if key in seen:
            stat.drops["exact_duplicate"] += 1
            return None
        seen.add(key)
    if near is not None and near.check_and_add(stats) is not None:
        stat.drops["near_duplicate"] += 1
        return None
    return ("valid" if int.from_bytes(key[:8], "little") < valid_cut else "train"), cleaned


def _cleaned_texts(work: Path, source: str, *, split: str | None = None) -> Iterator[str]:
    with open(work / "clean" / f"{source}.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if split is None or row["split"] == split:
                yield row["text"]


def _tokenizer_sample(spec: DataSpec, sources: list[DataSource], work: Path) -> Iterator[str]:
    """Training text for BPE: the first documents of each source, an equal byte budget per source."""
    budget = spec.tokenizer.train_sample_bytes // max(len(sources), 1)
    for source in sources:
        used = 0
        for text in _cleaned_texts(work, source.name, split="train"):
            yield text
            used += len(text.encode("utf-8"))
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


def _shard_stage(spec: DataSpec, sources: list[DataSource], *, data_dir: Path, work: Path, tokenizer: Any,
                 info: TokenizerInfo, progress: StageProgress, on_shard: Callable[[ShardInfo], None] | None
                 ) -> tuple[list[ShardInfo], int]:
    kept = _verified_log(work, data_dir)
    # rewrite the log with only the verified entries, so a torn or stale tail never survives
    log_lines = [json.dumps(s.to_json()) + "\n" for infos in kept.values() for s in infos]
    atomic_write_bytes(work / "shards.jsonl", "".join(log_lines).encode())
    reused = sum(len(v) for v in kept.values())
    dtype = token_dtype(info.vocab_size)
    all_shards: list[ShardInfo] = []
    with open(work / "shards.jsonl", "a", encoding="utf-8") as log:
        def logged(shard: ShardInfo) -> None:
            log.write(json.dumps(shard.to_json()) + "\n")
            log.flush()
            os.fsync(log.fileno())
            if on_shard is not None:
                on_shard(shard)

        for split in SPLITS:
            for source in sources:
                done = kept.get((split, source.name), [])
                all_shards += done
                task = progress.start(f"tokenize {split}/{source.name}")
                texts = islice(_cleaned_texts(work, source.name, split=split), sum(s.num_docs for s in done), None)
                docs = _encode(texts, tokenizer=tokenizer, eos_id=info.eos_id, progress=progress, task=task)
                all_shards += write_split_shards(
                    data_dir, split=split, source=source.name, docs=docs, dtype=dtype,
                    shard_size_tokens=spec.shard_size_tokens, first_number=len(done), on_shard=logged,
                )
                progress.finish(task)
    return all_shards, reused


def _encode(texts: Iterator[str], *, tokenizer: Any, eos_id: int, progress: StageProgress, task: int
            ) -> Iterator[np.ndarray]:
    """Token arrays with EOS appended, encoded in batches (the Rust tokenizer parallelises a batch)."""
    while batch := list(islice(texts, ENCODE_BATCH_DOCS)):
        for encoding in tokenizer.encode_batch(batch):
            ids = np.empty(len(encoding.ids) + 1, dtype=np.int64)
            ids[:-1] = encoding.ids
            ids[-1] = eos_id
            yield ids
        progress.advance(task, docs=len(batch), num_bytes=sum(len(t.encode("utf-8")) for t in batch))


def prepare_data(
    spec: DataSpec, *, data_dir: Path, console: Console | None = None,
    on_shard: Callable[[ShardInfo], None] | None = None, force: bool = False,
) -> PrepareResult:
    """Build (or resume, or confirm up to date) the data dir for `spec`. See the module docstring."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    sources = resolve_sources(spec, data_dir=data_dir)
    inputs = fingerprint(spec, sources)
    work = data_dir / WORK
    timings: dict[str, float] = {}
    up_to_date = _up_to_date(data_dir, inputs)
    if up_to_date is not None:
        _apply_mixture(spec, up_to_date.manifest)  # weights and stages may change without re-tokenizing
        up_to_date.manifest.write(data_dir)
        return up_to_date
    previous = json.loads((work / "inputs.json").read_text())["sha256"] if (work / "inputs.json").is_file() else None
    if previous != inputs:
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
        atomic_write_bytes(work / "inputs.json", json.dumps({"sha256": inputs}).encode())
    progress = StageProgress(console)
    with progress:
        start = time.perf_counter()
        done_file = work / "clean_done.json"
        cleaned = json.loads(done_file.read_text()) if done_file.is_file() else _clean_stage(
            spec, sources, work=work, progress=progress)
        timings["clean_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if (data_dir / TOKENIZER).is_file():
            tokenizer, info = load_info(data_dir / TOKENIZER, spec.tokenizer)
        else:
            task = progress.start("train tokenizer")
            sample = progress.counted(task, _tokenizer_sample(spec, sources, work))
            info = build_tokenizer(spec.tokenizer, sample, out_path=data_dir / TOKENIZER)
            progress.finish(task)
            tokenizer, info = load_info(data_dir / TOKENIZER, spec.tokenizer)
        timings["tokenizer_s"] = time.perf_counter() - start
        start = time.perf_counter()
        shards, reused = _shard_stage(spec, sources, data_dir=data_dir, work=work, tokenizer=tokenizer, info=info,
                                      progress=progress, on_shard=on_shard)
        timings["shards_s"] = time.perf_counter() - start
    return _finish(spec, data_dir=data_dir, work=work, cleaned=cleaned, shards=shards, info=info, inputs=inputs,
                   timings=timings, reused=reused)


def _apply_mixture(spec: DataSpec, manifest: Manifest) -> None:
    weights = {s.name: s.weight for s in spec.sources}
    for source in manifest.sources:
        source["weight"] = weights[source["name"]]
    manifest.stages = [MixtureStage(weights=dict(st.weights), until_tokens=st.until_tokens) for st in spec.stages]


def _up_to_date(data_dir: Path, inputs: str) -> PrepareResult | None:
    from leantrain.data.layout import load_manifest

    if not (data_dir / MANIFEST).is_file() or not (data_dir / REPORT).is_file():
        return None
    try:
        manifest = load_manifest(data_dir)
    except Exception:  # an unreadable old manifest just means: rebuild
        return None
    if manifest.extra.get("inputs_sha256") != inputs:
        return None
    if any(not (data_dir / s.path).is_file() or sha256_file(data_dir / s.path) != s.sha256 for s in manifest.shards):
        return None
    report = json.loads((data_dir / REPORT).read_text(encoding="utf-8"))
    return PrepareResult(data_dir=data_dir, manifest=manifest, report=report, reused_shards=len(manifest.shards),
                         up_to_date=True)


def _finish(spec: DataSpec, *, data_dir: Path, work: Path, cleaned: dict[str, Any], shards: list[ShardInfo],
            info: TokenizerInfo, inputs: str, timings: dict[str, float], reused: int) -> PrepareResult:
    sources = cleaned["sources"]
    weights = {s.name: s.weight for s in spec.sources}
    for source in sources:
        source["weight"] = weights[source["name"]]
        for split in SPLITS:
            mine = [s for s in shards if s.source == source["name"] and s.split == split]
            source["tokens"][split] = sum(s.num_tokens for s in mine)
            source["docs"][split] = sum(s.num_docs for s in mine)
    report = build_report(sources=sources, dedup=cleaned["dedup"], tokenizer=info.__dict__, timings=timings)
    if (work / PII_AUDIT).is_file():
        os.replace(work / PII_AUDIT, data_dir / PII_AUDIT)
    manifest = Manifest(
        vocab_size=info.vocab_size, eos_id=info.eos_id, dtype=np.dtype(token_dtype(info.vocab_size)).name,
        sources=[{k: s[k] for k in ("name", "weight", "docs_in", "docs_out", "drops", "pii", "tokens", "docs")}
                 for s in sources],
        shards=shards,
        stages=[],
        tokenizer=info.__dict__,
        extra={"inputs_sha256": inputs, "dedup": report["dedup"], "pii": report["pii"],
               "valid_fraction": spec.valid_fraction},
    )
    _apply_mixture(spec, manifest)
    atomic_write_bytes(data_dir / REPORT, (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode())
    manifest.write(data_dir)
    shutil.rmtree(work, ignore_errors=True)
    return PrepareResult(data_dir=data_dir, manifest=manifest, report=report, reused_shards=reused, up_to_date=False)
