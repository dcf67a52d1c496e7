"""Streaming readers for raw corpora: jsonl, plain text (files/folders), parquet, Arrow IPC (Hugging Face
`datasets` folders); .gz and .zst on the fly; local paths or object stores (`s3://…`, see inputs.py).

Memory stays bounded: files are read line by line (jsonl, text per line/paragraph) or batch by batch
(parquet, arrow); only `text_unit: file` holds one whole file. Broken rows do not stop a run: invalid
UTF-8, broken JSON lines, rows without text and empty files are counted, the first few are kept as
`file:line` examples for the report, and the row is skipped. A broken *file* (truncated or corrupt
compression, unreadable parquet/arrow) raises `BadInputError` naming the file and offset; the pipeline
stops or, with `data.on_bad_input: skip`, leaves that file out and counts it. A source that yields
nothing is a user error.

`READERS` is the one place that maps a `data.sources[].format` to its reader and file suffixes: a new
format adds one entry there (and its name to the spec's `format` literal).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from leantrain.data.chat import parse_record
from leantrain.data.inputs import COMPRESSED, BadInputError, file_size, list_files, open_binary, open_raw
from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSource

MAX_EXAMPLES = 5


@dataclass(frozen=True)
class RawDoc:
    """One document as read: where it came from and its text (not yet cleaned)."""

    source: str
    doc_id: str
    text: str


@dataclass
class ReadStats:
    """Problems met while reading one source, by kind, with a few `file:line` examples each."""

    files: int = 0
    bytes_read: int = 0
    problems: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def problem(self, kind: str, where: str) -> None:
        self.problems[kind] += 1
        self.examples.setdefault(kind, [])
        if len(self.examples[kind]) < MAX_EXAMPLES:
            self.examples[kind].append(where)


def source_files(source: DataSource) -> list[str]:
    """The files of a source in a fixed (sorted) order; a folder or prefix is searched recursively by suffix."""
    assert source.path is not None, "builtin sources are materialised before reading"
    wanted = READERS[source.format].suffixes
    files = list_files(source.path, suffixes=wanted)
    if files is None:
        raise UserInputError(f"data.sources[{source.name}].path: {source.path} does not exist")
    if not files:
        raise UserInputError(
            f"data.sources[{source.name}]: folder {source.path} has no {source.format} files ({', '.join(wanted)}, "
            "optionally .gz/.zst)"
        )
    return files


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _lines(path: str, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
           ) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) pairs; undecodable lines are counted and skipped. `span`
    (start, end, first line): only the lines in bytes [start, end) of an uncompressed file (cut at line ends
    by `line_spans`)."""
    start, end, first_line = span
    with open_binary(path) as raw:
        if start:
            raw.seek(start)
        position = start
        for number, line in enumerate(raw, start=first_line):
            if end is not None and position >= end:
                break
            position += len(line)
            stats.bytes_read += len(line)
            try:
                yield number, line.decode("utf-8")
            except UnicodeDecodeError:
                stats.problem("invalid_utf8", f"{path}:{number}")


SPLIT_SCAN_BYTES = 1 << 24


def splittable(source: DataSource, path: str) -> bool:
    """Line-based and uncompressed: a file that byte-range tasks can share."""
    line_based = source.format in ("jsonl", "chat") or (source.format == "text" and source.text_unit == "line")
    return line_based and not path.endswith(COMPRESSED)


def line_spans(path: str, *, task_bytes: int) -> list[tuple[int, int | None, int]]:
    """(start, end, first line number) of ranges of about `task_bytes`, each ending after a newline. One
    sequential read of the file (counting newlines, about 1 GB/s) numbers the lines, so document ids stay
    `file:line` whatever the split."""
    spans: list[tuple[int, int | None, int]] = []
    start, first_line = 0, 1
    position = lines = 0  # file offset of the chunk; newlines before position + offset
    next_cut = task_bytes  # the range ends with the line that holds byte next_cut - 1
    with open_raw(path) as raw:
        while chunk := raw.read(SPLIT_SCAN_BYTES):
            offset = 0
            while next_cut - position <= len(chunk):
                newline = chunk.find(b"\n", max(next_cut - position - 1, offset))
                if newline < 0:
                    break  # the line goes on in the next chunk
                lines += chunk.count(b"\n", offset, newline + 1)
                offset = newline + 1
                spans.append((start, position + offset, first_line))
                start, first_line = position + offset, lines + 1
                next_cut = start + task_bytes
            lines += chunk.count(b"\n", offset)
            position += len(chunk)
    if start < position or not spans:
        spans.append((start, None, first_line))
    return spans


def _json_rows(path: str, stats: ReadStats, span: tuple[int, int | None, int]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) per non-blank JSONL line; broken JSON is counted and skipped."""
    for number, line in _lines(path, stats, span):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError:
            stats.problem("broken_json", f"{path}:{number}")


def _doc_id(row: Any, source: DataSource, path: str, number: int) -> str:
    """The row's `id_field`, else file name:line."""
    doc_id = row.get(source.id_field) if source.id_field and isinstance(row, dict) else None
    return str(doc_id) if doc_id is not None else f"{_name(path)}:{number}"


def _read_jsonl(path: str, source: DataSource, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
                ) -> Iterator[RawDoc]:
    for number, row in _json_rows(path, stats, span):
        text = row.get(source.text_field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            stats.problem("missing_text_field", f"{path}:{number}")
            continue
        yield RawDoc(source.name, _doc_id(row, source, path, number), text)


def _read_text(path: str, source: DataSource, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
               ) -> Iterator[RawDoc]:
    if source.text_unit == "file":
        with open_binary(path) as raw:
            data = raw.read()
        stats.bytes_read += len(data)
        try:
            yield RawDoc(source.name, _name(path), data.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = data[: err.start].count(b"\n") + 1
            stats.problem("invalid_utf8", f"{path}:{line}")
        return
    paragraph: list[str] = []
    first_line = 1
    for number, line in _lines(path, stats, span):
        if source.text_unit == "line":
            if line.strip():
                yield RawDoc(source.name, f"{_name(path)}:{number}", line.rstrip("\n"))
            continue
        if line.strip():
            if not paragraph:
                first_line = number
            paragraph.append(line)
        elif paragraph:
            yield RawDoc(source.name, f"{_name(path)}:{first_line}", "".join(paragraph))
            paragraph = []
    if paragraph:
        yield RawDoc(source.name, f"{_name(path)}:{first_line}", "".join(paragraph))


def _read_table_batches(path: str, source: DataSource, stats: ReadStats, batches: Any, names: list[str]
                        ) -> Iterator[RawDoc]:
    if source.text_field not in names:
        raise UserInputError(
            f"data.sources[{source.name}].text_field: {path} has no column {source.text_field!r} (has: {names})"
        )
    has_id = source.id_field is not None and source.id_field in names
    row_number = 0
    for batch in batches:
        texts = batch.column(source.text_field).to_pylist()
        ids = batch.column(source.id_field).to_pylist() if has_id else [None] * len(texts)
        for text, doc_id in zip(texts, ids, strict=True):
            row_number += 1
            if not isinstance(text, str):
                stats.problem("missing_text_field", f"{path}:row {row_number}")
                continue
            yield RawDoc(source.name, str(doc_id) if doc_id is not None else f"{_name(path)}:{row_number}", text)


def _read_parquet(path: str, source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_raw(path) as raw:
        try:
            parquet = pq.ParquetFile(raw)
            names = parquet.schema_arrow.names
            columns = [c for c in (source.text_field, source.id_field) if c is not None and c in names]
            stats.bytes_read += file_size(path)
            yield from _read_table_batches(path, source, stats, parquet.iter_batches(batch_size=1024,
                                                                                     columns=columns), names)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as err:
            raise BadInputError(path, offset=raw.tell(), decompressed=0,
                                problem=f"unreadable parquet ({err})") from None


def _read_arrow(path: str, source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    """Arrow IPC: the stream format (what Hugging Face `datasets` writes) or the file format."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    with open_binary(path) as raw:
        try:
            try:
                reader: Any = ipc.open_stream(raw)
                batches: Any = reader
            except pa.ArrowInvalid:
                raw.seek(0)
                reader = ipc.open_file(raw)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            stats.bytes_read += file_size(path)
            yield from _read_table_batches(path, source, stats, batches, reader.schema.names)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as err:
            raise BadInputError(path, offset=raw.tell(), decompressed=0,
                                problem=f"unreadable arrow ({err})") from None


@dataclass(frozen=True)
class Reader:
    """How to read one format: the file suffixes a folder is searched for, and the row reader."""

    suffixes: tuple[str, ...]
    read: Any  # (path, source, stats) -> Iterator[RawDoc]


def _read_chat(path: str, source: DataSource, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
               ) -> Iterator[RawDoc]:
    """A conversation per line through `chat.parse_record` (a bad record is an error naming file:line and the
    field); the document's text is the messages as JSON."""
    for number, row in _json_rows(path, stats, span):
        messages = parse_record(row, where=f"{path}:{number}")
        yield RawDoc(source.name, _doc_id(row, source, path, number), json.dumps(messages))


READERS: dict[str, Reader] = {
    "jsonl": Reader((".jsonl", ".json", ".ndjson"), _read_jsonl),
    "chat": Reader((".jsonl", ".json", ".ndjson"), _read_chat),
    "text": Reader((".txt", ".md", ".text", ".rst"), _read_text),
    "parquet": Reader((".parquet",), _read_parquet),
    "arrow": Reader((".arrow",), _read_arrow),
}


def read_file(source: DataSource, path: str, stats: ReadStats, *, start: int = 0, end: int | None = None,
              first_line: int = 1) -> Iterator[RawDoc]:
    """One file's documents (an empty file is counted, not an error); with a byte range (a `line_spans`
    span of a `splittable` file), the documents of the lines starting in it."""
    if start == 0:
        stats.files += 1  # a split file counts once
    if file_size(path) == 0:
        stats.problem("empty_file", f"{path}:0")
        return
    if start or end is not None:
        yield from READERS[source.format].read(path, source, stats, (start, end, first_line))
        return
    yield from READERS[source.format].read(path, source, stats)


def read_source(source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    """Stream a source's documents; raises UserInputError at the end if it yielded none."""
    num_docs = 0
    for path in source_files(source):
        for doc in read_file(source, path, stats):
            num_docs += 1
            yield doc
    if num_docs == 0:
        raise no_documents(source, stats)


def no_documents(source: DataSource, stats: ReadStats) -> UserInputError:
    seen = ", ".join(f"{k}: {v} (e.g. {stats.examples[k][0]})" for k, v in stats.problems.items()) or "no rows"
    return UserInputError(f"data.sources[{source.name}] ({source.path}) yielded no documents; {seen}")
