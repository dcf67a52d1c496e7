"""Streaming readers for raw corpora: jsonl, plain text (files/folders), parquet; .gz and .zst on the fly.

Memory stays bounded: files are read line by line (jsonl, text per line/paragraph) or batch by batch
(parquet); only `text_unit: file` holds one whole file. Broken input never stops a run: invalid UTF-8,
broken JSON lines, rows without text and empty files are counted, the first few are kept as `file:line`
examples for the report, and the row is skipped. A source that yields nothing is a user error.
"""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSource

MAX_EXAMPLES = 5
SUFFIXES = {
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "text": (".txt", ".md", ".text", ".rst"),
    "parquet": (".parquet",),
}
COMPRESSED = (".gz", ".zst")


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


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.name.endswith(".zst"):
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115
        return io.BufferedReader(reader)  # type: ignore[arg-type]  # buffered: line iteration
    return open(path, "rb")  # noqa: SIM115 - caller closes


def _base_suffix(path: Path) -> str:
    name = path.name
    for comp in COMPRESSED:
        if name.endswith(comp):
            name = name[: -len(comp)]
    return Path(name).suffix.lower()


def source_files(source: DataSource) -> list[Path]:
    """The files of a source in a fixed (sorted) order; a folder is searched recursively by suffix."""
    assert source.path is not None, "builtin sources are materialised before reading"
    path = Path(source.path)
    if path.is_file():
        return [path]
    if path.is_dir():
        wanted = SUFFIXES[source.format]
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and _base_suffix(p) in wanted)
        if not files:
            raise UserInputError(
                f"data.sources[{source.name}]: folder {path} has no {source.format} files ({', '.join(wanted)}, "
                "optionally .gz/.zst)"
            )
        return files
    raise UserInputError(f"data.sources[{source.name}].path: {path} does not exist")


def _lines(path: Path, stats: ReadStats) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) pairs; undecodable lines are counted and skipped."""
    with _open_binary(path) as raw:
        for number, line in enumerate(raw, start=1):
            stats.bytes_read += len(line)
            try:
                yield number, line.decode("utf-8")
            except UnicodeDecodeError:
                stats.problem("invalid_utf8", f"{path}:{number}")


def _read_jsonl(path: Path, source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    for number, line in _lines(path, stats):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            stats.problem("broken_json", f"{path}:{number}")
            continue
        text = row.get(source.text_field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            stats.problem("missing_text_field", f"{path}:{number}")
            continue
        doc_id = row.get(source.id_field) if source.id_field else None
        yield RawDoc(source.name, str(doc_id) if doc_id is not None else f"{path.name}:{number}", text)


def _read_text(path: Path, source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    if source.text_unit == "file":
        with _open_binary(path) as raw:
            data = raw.read()
        stats.bytes_read += len(data)
        try:
            yield RawDoc(source.name, path.name, data.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = data[: err.start].count(b"\n") + 1
            stats.problem("invalid_utf8", f"{path}:{line}")
        return
    paragraph: list[str] = []
    first_line = 1
    for number, line in _lines(path, stats):
        if source.text_unit == "line":
            if line.strip():
                yield RawDoc(source.name, f"{path.name}:{number}", line.rstrip("\n"))
            continue
        if line.strip():
            if not paragraph:
                first_line = number
            paragraph.append(line)
        elif paragraph:
            yield RawDoc(source.name, f"{path.name}:{first_line}", "".join(paragraph))
            paragraph = []
    if paragraph:
        yield RawDoc(source.name, f"{path.name}:{first_line}", "".join(paragraph))


def _read_parquet(path: Path, source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if source.text_field not in names:
        raise UserInputError(
            f"data.sources[{source.name}].text_field: {path} has no column {source.text_field!r} (has: {names})"
        )
    columns = [source.text_field] + ([source.id_field] if source.id_field in names else [])
    stats.bytes_read += path.stat().st_size
    row_number = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=columns):
        texts = batch.column(source.text_field).to_pylist()
        ids = batch.column(source.id_field).to_pylist() if len(columns) > 1 else [None] * len(texts)
        for text, doc_id in zip(texts, ids, strict=True):
            row_number += 1
            if not isinstance(text, str):
                stats.problem("missing_text_field", f"{path}:row {row_number}")
                continue
            yield RawDoc(source.name, str(doc_id) if doc_id is not None else f"{path.name}:{row_number}", text)


READERS = {"jsonl": _read_jsonl, "text": _read_text, "parquet": _read_parquet}


def read_source(source: DataSource, stats: ReadStats) -> Iterator[RawDoc]:
    """Stream a source's documents; raises UserInputError at the end if it yielded none."""
    num_docs = 0
    for path in source_files(source):
        stats.files += 1
        if path.stat().st_size == 0:
            stats.problem("empty_file", f"{path}:0")
            continue
        for doc in READERS[source.format](path, source, stats):
            num_docs += 1
            yield doc
    if num_docs == 0:
        seen = ", ".join(f"{k}: {v} (e.g. {stats.examples[k][0]})" for k, v in stats.problems.items()) or "no rows"
        raise UserInputError(f"data.sources[{source.name}] ({source.path}) yielded no documents; {seen}")
