"""Nothing unread in silence: a folder's files of every record format are read, the others named in the
report; under `data.on_bad_input: skip` a damaged file keeps the documents before the damage and says where
it broke; a table without the text column is skipped with a count; each dropped row has its true reason; a
line longer than `data.max_doc_bytes` is skipped while it streams by."""

from __future__ import annotations

import gzip
import json
import random
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from rich.console import Console

from leantrain.cli import main
from leantrain.data.demo_corpus import _document
from leantrain.data.inputs import BadInputError
from leantrain.data.pipeline import prepare_data
from leantrain.data.readers import ReadStats, read_source
from leantrain.data.stats import render_report
from leantrain.errors import UserInputError
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [_document(rng, zh=False) + f" Record {seed}-{i}." for i in range(n)]


def _jsonl(texts: list[str], prefix: str) -> bytes:
    return b"".join((json.dumps({"id": f"{prefix}{i}", "text": t}) + "\n").encode() for i, t in enumerate(texts))


def _spec(*sources: DataSource, **kw: object) -> DataSpec:
    return DataSpec(tokens_total=1e5, seq_len=32, tokenizer=TokenizerSpec(kind="byte"), workers=1,
                    cleaning=CleaningSpec(min_words=5), valid_fraction=0.0, dedup={"near": False},
                    sources=list(sources), **kw)


def test_a_folder_reads_every_record_format_and_names_the_rest(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(_jsonl(_texts(30, 1), "j"))
    pq.write_table(pa.table({"text": _texts(50, 2), "id": [f"p{i}" for i in range(50)]}), folder / "b.parquet")
    (folder / "README.md").write_text("# about this corpus\n")
    (folder / "c.csv").write_text("text\nnot read\n")
    (folder / "_SUCCESS").write_text("")  # hidden by convention, like .DS_Store
    docs, stats = [], ReadStats()
    docs = [d.doc_id for d in read_source(DataSource(name="mix", path=folder), stats)]
    assert len(docs) == 80 and docs[:1] == ["j0"] and docs[-1] == "p49"
    assert stats.problems == {"unread_file": 2}
    assert sorted(stats.examples["unread_file"]) == [str(folder / "README.md"), str(folder / "c.csv")]
    result = prepare_data(_spec(DataSource(name="mix", path=folder)), data_dir=tmp_path / "data")
    source = result.report["sources"][0]
    assert source["docs_in"] == 80 and source["files"] == 2
    assert source["read_problems"] == {"unread_file": 2}
    assert sorted(source["read_problem_examples"]["unread_file"]) == [str(folder / "README.md"),
                                                                        str(folder / "c.csv")]
    console = Console(record=True, width=400)  # what `prepare` prints at the end
    render_report(result.report, console=console)
    printed = [line for line in console.export_text().splitlines() if "unread_file" in line]
    assert len(printed) == 1 and printed[0].startswith("mix: skipped 2 (unread_file), e.g. "), printed
    assert str(folder / "README.md") in printed[0] and str(folder / "c.csv") in printed[0]


def test_a_folder_with_no_file_of_the_format_names_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(UserInputError, match=r"has no text files .*it holds notes\.csv"):
        list(read_source(DataSource(name="t", path=tmp_path, format="text"), ReadStats()))


def test_datasets_metadata_beside_arrow_files_is_not_a_document(tmp_path: Path) -> None:
    table = pa.table({"text": ["one two three", "four five six"]})
    with pa.ipc.new_stream(tmp_path / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "dataset_info.json").write_text('{"features": {}}')
    (tmp_path / "state.json").write_text('{"_data_files": []}')
    stats = ReadStats()
    assert [d.text for d in read_source(DataSource(name="hf", path=tmp_path, format="arrow"), stats)] == \
        ["one two three", "four five six"]
    assert not stats.problems


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_skip_keeps_every_document_before_the_damage(tmp_path: Path, kind: str) -> None:
    texts = _texts(400, 3)
    data = _jsonl(texts, "z")
    packed = zstandard.ZstdCompressor(write_checksum=True).compress(data) if kind == "zst" else gzip.compress(data)
    path = tmp_path / f"cut.jsonl.{kind}"
    path.write_bytes(packed[: len(packed) * 3 // 4])
    with pytest.raises(BadInputError, match="truncated"):
        prepare_data(_spec(DataSource(name="cut", path=path)), data_dir=tmp_path / "error")
    result = prepare_data(_spec(DataSource(name="cut", path=path), on_bad_input="skip"), data_dir=tmp_path / "d")
    source = result.report["sources"][0]
    (bad,) = source["bad_inputs"]
    kept = bad["docs_before"]
    # every whole line the decoder produced arrived: zstd decodes whole 128 KiB blocks, gzip any prefix
    assert kept > 100 and source["docs_in"] == kept and source["docs_out"] == kept
    assert bad["line"] == kept + 1 and bad["file"] == str(path) and "truncated" in bad["problem"]
    assert source["docs_lost_to_bad_input"] == 1  # the line the cut went through
    decoded = data[: bad["decompressed_bytes"]]
    assert decoded.count(b"\n") == kept and data.startswith(decoded)
    assert result.manifest.sources[0]["bad_inputs"] == source["bad_inputs"]


def test_a_table_without_the_text_column_is_skipped_with_a_count(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tables"
    folder.mkdir()
    pq.write_table(pa.table({"text": _texts(100, 4)}), folder / "a_good.parquet")
    pq.write_table(pa.table({"body": _texts(20, 5)}), folder / "b_wrong.parquet")
    source = DataSource(name="tab", path=folder, format="parquet")
    with pytest.raises(BadInputError, match=r"data.sources\[tab\].text_field: .*b_wrong.parquet has no column"):
        prepare_data(_spec(source), data_dir=tmp_path / "error")
    result = prepare_data(_spec(source, on_bad_input="skip"), data_dir=tmp_path / "d")
    report = result.report["sources"][0]
    assert report["docs_out"] == 100
    assert [b["file"] for b in report["bad_inputs"]] == [str(folder / "b_wrong.parquet")]
    assert "no column 'text'" in report["bad_inputs"][0]["problem"]
    spec = tmp_path / "job.yaml"
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "examples" / "tiny-cpu.yaml").read_text()
    spec.write_text(text.replace("{name: en, builtin: demo-en, weight: 0.5}",
                                 f"{{name: en, path: {folder}, format: parquet}}").replace(
        "data:\n", "data:\n  on_bad_input: skip\n", 1))
    assert main(["prepare", str(spec), "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "b_wrong.parquet" in out and "no column" in out


def test_each_row_without_text_has_its_true_reason(tmp_path: Path) -> None:
    rows = [{"text": "kept"}, {"text": 12345}, {"text": None}, {"body": "x"}, [1, 2], 7, {"text": ["a"]}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = ReadStats()
    assert [d.text for d in read_source(DataSource(name="r", path=tmp_path / "r.jsonl"), stats)] == ["kept"]
    assert stats.problems == {"non_string_text": 2, "null_text": 1, "missing_text_field": 1, "row_not_object": 2}
    pq.write_table(pa.table({"text": [1, 2, None]}), tmp_path / "n.parquet")
    stats = ReadStats()
    with pytest.raises(UserInputError, match=r"non_string_text: 2 .*null_text: 1"):
        list(read_source(DataSource(name="n", path=tmp_path / "n.parquet", format="parquet"), stats))


def test_a_long_line_is_skipped_while_it_streams(tmp_path: Path) -> None:
    """A 40 MB single line with data.max_doc_bytes 1 MiB: dropped as doc_too_large without being held whole
    (peak Python memory a few MiB, not the 40 MB line and its decoded and parsed copies)."""
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(_jsonl(["first document here"], "a"))
        f.write(b'{"id": "huge", "text": "' + b"word " * 8_000_000 + b'"}\n')
        f.write(_jsonl(["last document here"], "b"))
    for name in ("long.jsonl", "long.txt"):
        if name.endswith(".txt"):
            path = path.rename(tmp_path / name)
        stats = ReadStats(max_doc_bytes=1 << 20)
        source = DataSource(name="l", path=path, format="text" if name.endswith(".txt") else "jsonl",
                            text_unit="line")
        tracemalloc.start()
        docs = list(read_source(source, stats))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(docs) == 2 and stats.problems == {"doc_too_large": 1}, name
        assert stats.examples["doc_too_large"] == [f"{path}:2"]
        assert peak < 8 << 20, (name, peak)
        assert stats.bytes_read == path.stat().st_size
    (tmp_path / "para.txt").write_text("short para\n\n" + "a line of a huge paragraph\n" * 100_000 + "\nend para\n")
    stats = ReadStats(max_doc_bytes=1 << 20)
    docs = [d.text for d in read_source(DataSource(name="p", path=tmp_path / "para.txt", format="text",
                                                   text_unit="paragraph"), stats)]
    assert docs == ["short para\n", "end para\n"] and stats.problems == {"doc_too_large": 1}
    (tmp_path / "whole.txt").write_bytes(b"x" * (2 << 20))
    stats = ReadStats(max_doc_bytes=1 << 20)
    with pytest.raises(UserInputError, match="doc_too_large"):
        list(read_source(DataSource(name="w", path=tmp_path / "whole.txt", format="text"), stats))
