"""The per-input-shard tasks of `prepare`: what one worker does to one input file, and what it leaves on disk.

A task is one input file (in source order, then sorted file order: the documents' global order). Tasks
share nothing while they run; each writes its own folder `_work/tasks/tNNNNNN/` and publishes it by
writing `clean.json` last, so a killed run redoes only unfinished tasks and the result never depends on
which worker ran what, or when.

Clean task (read → normalise → filter → exact key + MinHash signature → PII redaction), per candidate
document (one that passed the filters), in input order:
- `docs.jsonl`   {"id", "split", "text" (redacted), "pii" {type: count}, "audit" [[type, start, end, hash]]}
- `exact_keys.npy` (n, 2) uint64 the 128-bit exact keys, sorted; `exact_docs.npy` (n,) uint32 their
                 local documents
- `sigs.npy`     (n, bands·rows) uint32 MinHash signatures (read back by memory map to verify candidates)
- `bands.npy`    (bands, n) uint64 band hashes, each band sorted; `band_docs.npy` (bands, n) uint32 the
                 local document of each entry
- `clean.json`   counters (docs in, drops by filter, read problems, a skipped bad file)
Encode task (after the dedup decision): the kept documents of one clean task as tokens, per split:
`<split>.bin` (tokens back to back, EOS after each) + `<split>.len.npy` (tokens per document), the PII
audit rows of kept documents (`audit.jsonl`) and `encode.json` (counts).
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from leantrain.data.chat import MASKED_FORMATS, ChatRenderer
from leantrain.data.chat_prepare import chat_candidate, encode_rows
from leantrain.data.clean import normalize, quality_problem, text_stats
from leantrain.data.clusters import KEEP, write_hashes
from leantrain.data.code_rules import is_code
from leantrain.data.dedup import MinHasher, Signatures, add_candidate_hashes
from leantrain.data.inputs import BadInputError, file_size
from leantrain.data.layout import SPLITS
from leantrain.data.pii import PIIRedactor
from leantrain.data.readers import ReadStats, line_spans, read_file, splittable
from leantrain.data.shards import atomic_write_bytes
from leantrain.spec.schema import DataSource, DataSpec

CLEAN_DONE = "clean.json"
ENCODE_DONE = "encode.json"
ENCODE_BATCH_DOCS = 512


@dataclass(frozen=True)
class InputTask:
    """One input file (or the lines starting in bytes [start, end) of one) of one source; `index` is its
    place in the global document order; `first_line` the number of the range's first line."""

    index: int
    source: DataSource
    path: str
    num_bytes: int
    start: int = 0
    end: int | None = None
    first_line: int = 1

    @property
    def name(self) -> str:
        return f"t{self.index:06d}"


def plan_tasks(sources: list[DataSource], files: dict[str, list[str]], *, task_bytes: int) -> list[InputTask]:
    tasks: list[InputTask] = []
    for source in sources:
        for path in files[source.name]:
            size = file_size(path)
            spans = line_spans(path, task_bytes=task_bytes) if size > task_bytes and splittable(source, path) \
                else [(0, None, 1)]
            for start, end, first_line in spans:
                tasks.append(InputTask(index=len(tasks), source=source, path=path, start=start, end=end,
                                       first_line=first_line, num_bytes=(end if end is not None else size) - start))
    return tasks


def task_dir(work: Path, task: InputTask) -> Path:
    return work / "tasks" / task.name


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def clean_task(task: InputTask, spec: DataSpec, work: Path, salt: bytes) -> dict[str, Any]:
    """Run the clean task unless its folder is already published; returns its counters."""
    out = task_dir(work, task)
    done = read_json(out / CLEAN_DONE)
    if done is not None:
        return done
    out.mkdir(parents=True, exist_ok=True)
    hasher = MinHasher(num_perm=spec.dedup.num_bands * spec.dedup.rows_per_band, seed=spec.dedup.seed,
                       shingle_words=spec.dedup.shingle_words, shingle_chars=spec.dedup.shingle_chars,
                       normalize_numbers=spec.dedup.normalize_numbers and task.source.format not in MASKED_FORMATS)
    redactor = PIIRedactor(types=spec.pii.types, salt=salt) if spec.pii.enabled else None
    read = ReadStats(max_doc_bytes=spec.max_doc_bytes)
    counts: dict[str, Any] = {"docs_in": 0, "chars_in": 0, "drops": Counter(), "bad_input": None,
                              "docs_lost_to_bad_input": 0}
    keys: list[bytes] = []
    signatures = Signatures(hasher.num_perm)
    valid_cut = int(spec.valid_fraction * 2**64)
    prose_or_code = functools.partial(_candidate, kind=task.source.kind)
    with open(out / "docs.jsonl.tmp", "w", encoding="utf-8") as docs:
        try:
            for raw in read_file(task.source, task.path, read, start=task.start, end=task.end,
                                 first_line=task.first_line):
                counts["docs_in"] += 1
                counts["chars_in"] += len(raw.text)
                candidate = chat_candidate if task.source.format in MASKED_FORMATS else prose_or_code
                row = candidate(raw.text, spec=spec, counts=counts, hasher=hasher, keys=keys,
                                signatures=signatures, redactor=redactor, valid_cut=valid_cut)
                if row is not None:
                    row = {"id": raw.doc_id, **row}
                    docs.write(json.dumps(row, ensure_ascii=False) + "\n")
        except BadInputError as err:
            if spec.on_bad_input == "error":
                raise
            counts.update(bad_input=_damage(err, task, read, docs_before=counts["docs_in"]),
                          docs_lost_to_bad_input=_partial_docs(err, read))
    os.replace(out / "docs.jsonl.tmp", out / "docs.jsonl")
    write_hashes(out, keys=keys, signatures=signatures, spec=spec.dedup)
    result = {**counts, "drops": dict(counts["drops"]), "candidates": len(keys), "files": read.files,
              "bytes_read": read.bytes_read, "read_problems": dict(read.problems), "read_examples": read.examples}
    atomic_write_bytes(out / CLEAN_DONE, json.dumps(result).encode())
    return result


def _damage(err: BadInputError, task: InputTask, read: ReadStats, *, docs_before: int) -> dict[str, Any]:
    """Where a skipped file broke (data.on_bad_input: skip): the error's file, offset and problem, the documents
    read before it (kept), and the compressed bytes from the damage to the end of the file (not decodable)."""
    end = task.end if task.end is not None else file_size(task.path)
    unread = max(end - err.offset, 0) if err.offset >= 0 else None
    return {**err.to_json(), "docs_before": docs_before, "bytes_unread": unread}


def _partial_docs(err: BadInputError, read: ReadStats) -> int:
    """1 when the damage cut a line-based document short (decompressed bytes past the last whole line), else 0:
    in a truncated file nothing else is lost; past corruption the rest of the file is `bytes_unread`."""
    return int(err.line is not None and err.decompressed > read.bytes_read)


def _candidate(text: str, *, spec: DataSpec, counts: dict[str, Any], hasher: MinHasher, keys: list[bytes],
               signatures: Signatures, redactor: PIIRedactor | None, valid_cut: int, kind: str = "prose"
               ) -> dict[str, Any] | None:
    """The row of a document that passes the filters (its hashes appended to keys/signatures), else None.
    `kind` (data.sources[].kind): a code document keeps its indentation and meets the code rules."""
    code = is_code(text, kind)
    cleaned = normalize(text, form=spec.cleaning.normalization, keep_indent=code)
    if not cleaned.strip():
        counts["drops"]["empty"] += 1
        return None
    stats = text_stats(cleaned)
    reason = quality_problem(cleaned, spec.cleaning, stats, code=code)
    if reason is not None:
        counts["drops"][reason] += 1
        return None
    split = add_candidate_hashes(stats, near=spec.dedup.near, hasher=hasher, keys=keys, signatures=signatures,
                                 valid_cut=valid_cut)
    pii: dict[str, int] = {}
    audit: list[list[Any]] = []
    if redactor is not None:
        before = redactor.counts.copy()
        cleaned, rows = redactor(cleaned, doc_id="", source="")
        pii = dict(redactor.counts - before)
        audit = [[r["type"], r["start"], r["end"], r["value_sha256"]] for r in rows]
    return {"split": split, "text": cleaned, "pii": pii, "audit": audit}


@functools.lru_cache(maxsize=1)
def _tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    """One tokenizer per worker process, reused by its encode tasks (keyed by the file's size and mtime):
    every fresh `Tokenizer` kept ~2.5 MB after its first batches, so RSS grew with the number of tasks."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def encode_task(task: InputTask, work: Path, tokenizer_path: Path, eos_id: int, dtype: str,
                chat: tuple[str, int] | None = None) -> dict[str, Any]:
    """Tokenize the kept documents of one clean task (decision in `keep.npy`); returns kept counts.

    `chat` (template, pad multiple): a chat source's rows are rendered, masked and padded (data/chat_prepare.py),
    and `<split>.mask` is written beside `<split>.bin`."""
    out = task_dir(work, task)
    done = read_json(out / ENCODE_DONE)
    if done is not None:
        return done
    stat = tokenizer_path.stat()
    tokenizer = _tokenizer(str(tokenizer_path), stat.st_size, stat.st_mtime_ns)
    renderer = ChatRenderer(tokenizer, template=chat[0], eos_id=eos_id) if (
        task.source.format in MASKED_FORMATS and chat) else None
    masks = {split: open(out / f"{split}.mask.tmp", "wb") for split in SPLITS} if renderer else {}  # noqa: SIM115
    decision = np.load(out / "keep.npy")
    counts: dict[str, Any] = {"docs": Counter(), "tokens": Counter(), "chars_out": 0, "pii": Counter()}
    files = {split: open(out / f"{split}.bin.tmp", "wb") for split in SPLITS}  # noqa: SIM115 - closed below
    lengths: dict[str, list[int]] = {split: [] for split in SPLITS}
    try:
        with open(out / "docs.jsonl", encoding="utf-8") as docs, open(out / "audit.jsonl.tmp", "w",
                                                                    encoding="utf-8") as audit:
            kept = (json.loads(line) for line, verdict in zip(docs, decision, strict=True) if verdict == KEEP)
            while batch := list(islice(kept, ENCODE_BATCH_DOCS)):
                for row, ids in zip(batch, _encoded(batch, tokenizer, renderer, masks, chat, eos_id=eos_id,
                                                     dtype=dtype), strict=True):
                    files[row["split"]].write(ids.tobytes())
                    lengths[row["split"]].append(ids.size)
                    counts["docs"][row["split"]] += 1
                    counts["tokens"][row["split"]] += ids.size
                    counts["chars_out"] += row.get("chars", len(row["text"]))
                    counts["pii"].update(row["pii"])
                    audit.writelines(json.dumps({"source": task.source.name, "doc_id": row["id"], "type": a[0],
                                                 "start": a[1], "end": a[2], "value_sha256": a[3]}) + "\n"
                                     for a in row["audit"])
    finally:
        for file in [*files.values(), *masks.values()]:
            file.close()
    for split in SPLITS:
        np.save(out / f"{split}.len.npy", np.asarray(lengths[split], dtype=np.int64))
        if masks:
            os.replace(out / f"{split}.mask.tmp", out / f"{split}.mask")
        os.replace(out / f"{split}.bin.tmp", out / f"{split}.bin")
    os.replace(out / "audit.jsonl.tmp", out / "audit.jsonl")
    result = {k: dict(v) if isinstance(v, Counter) else v for k, v in counts.items()}
    atomic_write_bytes(out / ENCODE_DONE, json.dumps(result).encode())
    return result


def _encoded(batch: list[dict[str, Any]], tokenizer: Any, renderer: ChatRenderer | None, masks: dict[str, Any],
             chat: tuple[str, int] | None, *, eos_id: int, dtype: str) -> list[np.ndarray]:
    """Token ids (EOS appended) per row; chat rows are rendered and padded, their masks written to `masks`."""
    if renderer is not None and chat is not None:
        out = []
        for row, (ids, mask) in zip(batch, encode_rows(batch, renderer=renderer, pad_multiple=chat[1]), strict=True):
            masks[row["split"]].write(mask.tobytes())
            out.append(ids.astype(dtype))
        return out
    out = []
    for encoding in tokenizer.encode_batch([r["text"] for r in batch]):
        ids = np.empty(len(encoding.ids) + 1, dtype=dtype)
        ids[:-1] = encoding.ids
        ids[-1] = eos_id
        out.append(ids)
    return out


def kept_texts(work: Path, task: InputTask, *, split: str) -> Any:
    """The kept documents' texts of one task in order (for training the tokenizer)."""
    decision = np.load(task_dir(work, task) / "keep.npy")
    with open(task_dir(work, task) / "docs.jsonl", encoding="utf-8") as docs:
        for line, verdict in zip(docs, decision, strict=True):
            if verdict == KEEP:
                row = json.loads(line)
                if row["split"] == split:
                    yield row["text"] or "\n".join(m["content"] for m in row.get("messages", []))
