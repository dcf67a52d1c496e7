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
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from leantrain.data.chat import parse_record
from leantrain.data.inputs import COMPRESSED, BadInputError, base_suffix, file_size, list_files, open_binary, open_raw
from leantrain.data.preference import parse_preference
from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSource

MAX_EXAMPLES = 5


@dataclass(frozen=True)
class RawDoc:
    """One document as read: where it came from and its text (not yet cleaned)."""

    source: str
    doc_id: str
    text: str


DEFAULT_MAX_DOC_BYTES = 1 << 23


@dataclass
class ReadStats:
    """Problems met while reading one source, by kind, with a few `file:line` examples each; and the
    reading limit `max_doc_bytes` (data.max_doc_bytes): a longer line, paragraph or file is skipped as it
    streams by (`doc_too_large`), never held whole."""

    files: int = 0
    bytes_read: int = 0
    problems: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES

    def problem(self, kind: str, where: str) -> None:
        self.problems[kind] += 1
        self.examples.setdefault(kind, [])
        if len(self.examples[kind]) < MAX_EXAMPLES:
            self.examples[kind].append(where)


# Formats whose files are rows with a text column: a folder of one may hold files of the others, and each
# file is read by its own suffix with the source's text_field/id_field.
RECORD_FORMATS = ("jsonl", "parquet", "arrow")
# What Hugging Face `datasets` writes beside its .arrow files: metadata, not documents.
DATASET_METADATA = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})


def file_format(source: DataSource, path: str) -> str | None:
    """The reader for one file of a source: the source's format for its own suffixes; for a record format,
    the record format the suffix belongs to (a jsonl folder's .parquet files are read as parquet); None: no
    reader of this source fits the file."""
    suffix = base_suffix(_name(path))
    if suffix in READERS[source.format].suffixes:
        return source.format
    if source.format in RECORD_FORMATS:
        return next((f for f in RECORD_FORMATS if suffix in READERS[f].suffixes), None)
    return None


def list_source(source: DataSource) -> tuple[list[str], list[str]]:
    """(files to read, files not read) of a source in a fixed (sorted) order. A folder or prefix is searched
    recursively; names starting with . or _ are skipped (.DS_Store, _SUCCESS), and so is `datasets`
    metadata beside .arrow files; every other file is read, or returned as not read so the report names it
    (a README.md in a jsonl folder, a .csv). A single file is read with the source's format whatever its
    name, unless its suffix is another record format's."""
    assert source.path is not None, "builtin sources are materialised before reading"
    _need_pyarrow(source)
    try:
        found = list_files(source.path)
    except Exception as err:  # an unreachable store, no credentials, a bad bucket or host name
        # (botocore's credential and endpoint errors are not OSErrors: NoCredentialsError, ...)
        store = type(err).__module__.split(".")[0] in ("botocore", "aiobotocore", "s3fs", "fsspec", "aiohttp")
        if not (store or isinstance(err, (OSError, ValueError))):
            raise
        raise UserInputError(f"data.sources[{source.name}].path: {source.path} cannot be listed: "
                             f"{type(err).__name__}: {err}") from err
    if found is None:
        raise UserInputError(f"data.sources[{source.name}].path: {source.path} does not exist")
    if found == [str(source.path)]:
        return found, []
    arrow = any(base_suffix(_name(f)) == ".arrow" for f in found)
    files, unread = [], []
    for path in found:
        if arrow and _name(path) in DATASET_METADATA:
            continue
        (files if file_format(source, path) is not None else unread).append(path)
    if not files:
        wanted = READERS[source.format].suffixes
        shown = ", ".join(_name(f) for f in unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        raise UserInputError(
            f"data.sources[{source.name}]: folder {source.path} has no {source.format} files ({', '.join(wanted)}, "
            f"optionally .gz/.zst)" + (f"; it holds {shown}" if unread else "")
        )
    return files, unread


def _need_pyarrow(source: DataSource) -> None:
    """parquet and arrow sources read through pyarrow, an extra (`make demo` leaves it out): say so up front."""
    import importlib.util

    if source.format in ("parquet", "arrow") and importlib.util.find_spec("pyarrow") is None:
        raise UserInputError(
            f"data.sources[{source.name}].format: {source.format} reads through pyarrow, which is not installed "
            "here: `.venv/bin/python -m pip install -c constraints.txt -e \".[parquet]\"` (make test installs it)")


def source_files(source: DataSource) -> list[str]:
    """The files of a source that are read (see `list_source`)."""
    return list_source(source)[0]


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _lines(path: str, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
           ) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) pairs; undecodable lines are counted and skipped. `span`
    (start, end, first line): only the lines in bytes [start, end) of an uncompressed file (cut at line ends
    by `line_spans`)."""
    start, end, first_line = span
    limit = stats.max_doc_bytes
    number = first_line - 1
    with open_binary(path) as raw:
        if start:
            raw.seek(start)
        position = start
        try:
            while end is None or position < end:
                line = raw.readline(limit + 1)  # a longer line is never held whole
                if not line:
                    break
                number += 1
                if len(line) > limit and not line.endswith(b"\n"):
                    size = len(line) + _skip_line(raw)
                    position += size
                    stats.bytes_read += size
                    stats.problem("doc_too_large", f"{path}:{number}")
                    continue
                position += len(line)
                stats.bytes_read += len(line)
                try:
                    yield number, line.decode("utf-8")
                except UnicodeDecodeError:
                    stats.problem("invalid_utf8", f"{path}:{number}")
        except BadInputError as err:
            err.line = number + 1  # where reading stopped: every line before it arrived
            raise


def _skip_line(raw: Any) -> int:
    """Read past the rest of an over-long line in 1 MiB steps; the number of bytes skipped."""
    skipped = 0
    while chunk := raw.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


SPLIT_SCAN_BYTES = 1 << 24


def splittable(source: DataSource, path: str) -> bool:
    """Line-based and uncompressed: a file that byte-range tasks can share."""
    fmt = file_format(source, path) or source.format
    line_based = fmt in ("jsonl", "chat", "preference") or (fmt == "text" and source.text_unit == "line")
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


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a UTF-16 surrogate written as a JSON escape


def _json_rows(path: str, stats: ReadStats, span: tuple[int, int | None, int]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) per non-blank JSONL line; broken JSON is counted and skipped, and so is JSON
    that Python's parser refuses though it is well formed (nested past the recursion limit, an integer of more
    than 4,300 digits), and a row whose strings hold a lone surrogate escape (`\\ud800`: no Unicode text, like a
    line that is no UTF-8; it would stop the pipeline when written)."""
    for number, line in _lines(path, stats, span):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            stats.problem("broken_json", f"{path}:{number}")
            continue
        if SURROGATE_ESCAPE.search(line):  # rare: checked only then (a pair of them is a valid character)
            try:
                json.dumps(row, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                stats.problem("invalid_utf8", f"{path}:{number}")
                continue
        yield number, row


def _doc_id(row: Any, source: DataSource, path: str, number: int) -> str:
    """The row's `id_field`, else file name:line."""
    doc_id = row.get(source.id_field) if source.id_field and isinstance(row, dict) else None
    return str(doc_id) if doc_id is not None else f"{_name(path)}:{number}"


def _read_jsonl(path: str, source: DataSource, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
                ) -> Iterator[RawDoc]:
    for number, row in _json_rows(path, stats, span):
        text = row.get(source.text_field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            stats.problem(_no_text_reason(row, source.text_field), f"{path}:{number}")
            continue
        yield RawDoc(source.name, _doc_id(row, source, path, number), text)


def _no_text_reason(row: Any, text_field: str) -> str:
    """Why a row has no text: not an object (a bare number or list), no such field, null, or not a string."""
    if not isinstance(row, dict):
        return "row_not_object"
    if text_field not in row:
        return "missing_text_field"
    return "null_text" if row[text_field] is None else "non_string_text"


def _read_text(path: str, source: DataSource, stats: ReadStats, span: tuple[int, int | None, int] = (0, None, 1)
               ) -> Iterator[RawDoc]:
    if source.text_unit == "file":
        with open_binary(path) as raw:
            data = raw.read(stats.max_doc_bytes + 1)
            if len(data) > stats.max_doc_bytes:  # not read further: its bytes would only be dropped
                stats.problem("doc_too_large", f"{path}:1")
                return
        stats.bytes_read += len(data)
        try:
            yield RawDoc(source.name, _name(path), data.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = data[: err.start].count(b"\n") + 1
            stats.problem("invalid_utf8", f"{path}:{line}")
        return
    paragraph: list[str] = []
    first_line = size = 0
    for number, line in _lines(path, stats, span):
        if source.text_unit == "line":
            if line.strip():
                yield RawDoc(source.name, f"{_name(path)}:{number}", line.rstrip("\n"))
            continue
        if line.strip():
            if not size:
                first_line = number
            oversize = size > stats.max_doc_bytes
            size += len(line) if line.isascii() else len(line.encode("utf-8"))
            if size > stats.max_doc_bytes:  # drop what is held; the rest of the paragraph is skipped line by line
                if not oversize:
                    stats.problem("doc_too_large", f"{path}:{first_line}")
                paragraph = []
                continue
            paragraph.append(line)
        else:
            if paragraph:
                yield RawDoc(source.name, f"{_name(path)}:{first_line}", "".join(paragraph))
            paragraph, size = [], 0
    if paragraph:
        yield RawDoc(source.name, f"{_name(path)}:{first_line}", "".join(paragraph))


def _read_table_batches(path: str, source: DataSource, stats: ReadStats, batches: Any, names: list[str]
                        ) -> Iterator[RawDoc]:
    if source.text_field not in names:
        problem = f"no column {source.text_field!r} (has: {names})"
        raise BadInputError(path, offset=0, decompressed=0, problem=problem, message=(
            f"data.sources[{source.name}].text_field: {path} has {problem}; set text_field, fix or remove the "
            "file, or set data.on_bad_input: skip to skip such files"))
    has_id = source.id_field is not None and source.id_field in names
    row_number = 0
    for batch in batches:
        texts = batch.column(source.text_field).to_pylist()
        ids = batch.column(source.id_field).to_pylist() if has_id else [None] * len(texts)
        for text, doc_id in zip(texts, ids, strict=True):
            row_number += 1
            if not isinstance(text, str):
                stats.problem("null_text" if text is None else "non_string_text", f"{path}:row {row_number}")
                continue
            if len(text) > stats.max_doc_bytes // 4 and len(text.encode("utf-8")) > stats.max_doc_bytes:
                stats.problem("doc_too_large", f"{path}:row {row_number}")
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


def _read_preference(path: str, source: DataSource, stats: ReadStats,
                     span: tuple[int, int | None, int] = (0, None, 1)) -> Iterator[RawDoc]:
    """A preference pair per line through `preference.parse_preference` (a bad record is an error naming
    file:line and the field); the document's text is the pair as JSON (prompt, chosen, rejected messages)."""
    for number, row in _json_rows(path, stats, span):
        pair = parse_preference(row, where=f"{path}:{number}")
        yield RawDoc(source.name, _doc_id(row, source, path, number), json.dumps(pair.to_json()))


READERS: dict[str, Reader] = {
    "jsonl": Reader((".jsonl", ".json", ".ndjson"), _read_jsonl),
    "chat": Reader((".jsonl", ".json", ".ndjson"), _read_chat),
    "preference": Reader((".jsonl", ".json", ".ndjson"), _read_preference),
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
    reader = READERS[file_format(source, path) or source.format].read
    if start or end is not None:
        yield from reader(path, source, stats, (start, end, first_line))
        return
    yield from reader(path, source, stats)


def read_source(source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    """Stream a source's documents; raises UserInputError at the end if it yielded none."""
    num_docs = 0
    files, unread = list_source(source)
    for path in unread:
        stats.problem("unread_file", path)
    for path in files:
        for doc in read_file(source, path, stats):
            num_docs += 1
            yield doc
    if num_docs == 0:
        raise no_documents(source, stats)


def no_documents(source: DataSource, stats: ReadStats) -> UserInputError:
    seen = ", ".join(f"{k}: {v} (e.g. {stats.examples[k][0]})" for k, v in stats.problems.items()) or "no rows"
    return UserInputError(f"data.sources[{source.name}] ({source.path}) yielded no documents; {seen}")
