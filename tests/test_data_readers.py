"""Readers: jsonl/text/parquet, .gz/.zst, broken input counted with file:line, empty sources are errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from leantrain.data.readers import ReadStats, read_source
from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSource


def _read(**kw: object) -> tuple[list[str], ReadStats]:
    stats = ReadStats()
    docs = [d.text for d in read_source(DataSource(name="s", **kw), stats)]  # type: ignore[arg-type]
    return docs, stats


def test_jsonl_counts_and_skips_bad_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"text": "один"}).encode(), b"{broken", b"\xff\xfe not utf8",
             json.dumps({"body": "x"}).encode(), b"", json.dumps({"text": "二", "id": 7}).encode()]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    docs, stats = _read(path=tmp_path / "a.jsonl")
    assert docs == ["один", "二"]
    assert stats.problems == {"broken_json": 1, "invalid_utf8": 1, "missing_text_field": 1}
    assert stats.examples["broken_json"] == [f"{tmp_path / 'a.jsonl'}:2"]
    assert stats.examples["invalid_utf8"] == [f"{tmp_path / 'a.jsonl'}:3"]


def test_well_formed_json_python_cannot_take_is_counted_not_a_traceback(tmp_path: Path) -> None:
    """Rows that stopped `prepare` with a traceback (exit 1, even with on_bad_input: skip): a lone surrogate
    escape (common in web crawls; UnicodeEncodeError when the cleaned text was written), nesting past Python's
    recursion limit (RecursionError), an integer of 5,000 digits (ValueError). Each is a counted problem naming
    its line; an escaped surrogate pair (an emoji) is a valid character and reads as one."""
    lines = [r'{"text": "a \ud800 b"}', "[" * 200_000 + "]" * 200_000, '{"text": "x", "n": ' + "1" * 5000 + "}",
             r'{"text": "smile \ud83d\ude00"}', '{"text": "fine"}']
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    docs, stats = _read(path=tmp_path / "a.jsonl")
    assert docs == ["smile \U0001F600", "fine"]
    assert stats.problems == {"invalid_utf8": 1, "broken_json": 2}
    assert stats.examples["invalid_utf8"] == [f"{tmp_path / 'a.jsonl'}:1"]


def test_compressed_folder_in_sorted_order_with_empty_file(tmp_path: Path) -> None:
    row = lambda t: (json.dumps({"content": t}) + "\n").encode()  # noqa: E731
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(row("zst") * 2))
    with gzip.open(tmp_path / "a.jsonl.gz", "wb") as f:
        f.write(row("gz"))
    (tmp_path / "c.jsonl").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not read: not a record format, but named in the report")
    docs, stats = _read(path=tmp_path, text_field="content")
    assert docs == ["gz", "zst", "zst"]
    assert stats.files == 3 and stats.problems == {"empty_file": 1, "unread_file": 1}
    assert stats.examples["unread_file"] == [str(tmp_path / "notes.txt")]


def test_text_units(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("first para\nstill first\n\n\nsecond para\n", encoding="utf-8")
    assert _read(path=tmp_path / "t.txt", format="text")[0] == ["first para\nstill first\n\n\nsecond para\n"]
    assert _read(path=tmp_path / "t.txt", format="text", text_unit="paragraph")[0] == \
        ["first para\nstill first\n", "second para\n"]
    assert _read(path=tmp_path / "t.txt", format="text", text_unit="line")[0] == \
        ["first para", "still first", "second para"]
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\n")
    with pytest.raises(UserInputError, match=r"invalid_utf8: 1 \(e.g. .*bad.txt:2\)"):
        _read(path=tmp_path / "bad.txt", format="text")
    docs, stats = _read(path=tmp_path / "bad.txt", format="text", text_unit="line")
    assert docs == ["ok"] and stats.problems == {"invalid_utf8": 1}


def test_parquet(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["a", None, "c"], "id": [1, 2, 3]}), tmp_path / "p.parquet")
    docs, stats = _read(path=tmp_path / "p.parquet", format="parquet")
    assert docs == ["a", "c"] and stats.problems == {"null_text": 1}
    with pytest.raises(UserInputError, match="no column 'body'"):
        _read(path=tmp_path / "p.parquet", format="parquet", text_field="body")


def test_a_source_that_yields_nothing_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_bytes(b"{bad\n")
    with pytest.raises(UserInputError, match=r"yielded no documents; broken_json: 1 \(e.g. .*e.jsonl:1\)"):
        _read(path=tmp_path / "e.jsonl")
    with pytest.raises(UserInputError, match="does not exist"):
        _read(path=tmp_path / "missing.jsonl")
