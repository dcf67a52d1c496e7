"""Inputs people have: parquet folders, Hugging Face `datasets` folders (Arrow IPC), and object stores
(s3:// through fsspec, against a real S3 server: moto's server mode on loopback)."""

from __future__ import annotations

import gzip
import json
import random
import string
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from leantrain.data.inputs import BadInputError
from leantrain.data.pipeline import prepare_data
from leantrain.data.readers import ReadStats, read_source
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec
from s3_server import moto_s3

_RNG = random.Random(4)
_VOCAB = ["".join(_RNG.choice(string.ascii_lowercase) for _ in range(_RNG.randint(3, 8))) for _ in range(2000)]
TEXTS = [" ".join(_RNG.choice(_VOCAB) for _ in range(40)) for _ in range(30)]  # no two near each other
WEB = [" ".join(_RNG.choice(_VOCAB) for _ in range(40)) for _ in range(30)]


def _docs(**kw: object) -> list[str]:
    return [d.text for d in read_source(DataSource(name="s", **kw), ReadStats())]  # type: ignore[arg-type]


def test_parquet_folder_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "pq" / "year=2024").mkdir(parents=True)
    pq.write_table(pa.table({"text": TEXTS[10:]}), tmp_path / "pq" / "year=2024" / "part-1.parquet")
    pq.write_table(pa.table({"text": TEXTS[:10]}), tmp_path / "pq" / "part-0.parquet")
    (tmp_path / "pq" / "_SUCCESS").write_text("")  # Spark/Hadoop marker files are skipped
    assert _docs(path=tmp_path / "pq", format="parquet") == TEXTS[:10] + TEXTS[10:]
    (tmp_path / "pq" / "part-2.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(BadInputError, match="part-2.parquet: unreadable parquet"):
        _docs(path=tmp_path / "pq", format="parquet")


def _hf_dataset_dir(root: Path) -> Path:
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC *stream* shards + JSON metadata."""
    root.mkdir(parents=True)
    table = pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))})
    for number, part in enumerate((table.slice(0, 12), table.slice(12))):
        with ipc.new_stream(str(root / f"data-{number:05d}-of-00002.arrow"), part.schema) as writer:
            writer.write_table(part, max_chunksize=5)
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"}]}))
    return root


def test_hf_datasets_folder_and_arrow_file_format(tmp_path: Path) -> None:
    folder = _hf_dataset_dir(tmp_path / "hf")
    assert _docs(path=folder, format="arrow") == TEXTS
    with ipc.new_file(str(tmp_path / "file.arrow"), pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": TEXTS[:3]}))
    assert _docs(path=tmp_path / "file.arrow", format="arrow") == TEXTS[:3]


pytest.importorskip("moto.moto_server.threaded_moto_server")
pytest.importorskip("s3fs")


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_s3() as endpoint:
        for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                            ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", endpoint)):
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        yield endpoint


def test_s3_sources_prepare_like_local_files(tmp_path: Path, s3_endpoint: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    monkeypatch.setenv("LEANTRAIN_PII_SALT", "salt")
    local = tmp_path / "local"
    _hf_dataset_dir(local / "hf")
    (local / "web").mkdir()
    rows = "".join(json.dumps({"text": t}) + "\n" for t in WEB)
    (local / "web" / "a.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("corpus")
    fs.put(str(local) + "/", "corpus/raw/", recursive=True)

    def spec(root: str) -> DataSpec:
        return DataSpec(tokens_total=1e4, seq_len=16, tokenizer=TokenizerSpec(kind="byte"), workers=1,
                        cleaning=CleaningSpec(min_words=5, min_stop_words=0, max_mean_word_length=20),
                        sources=[DataSource(name="web", path=f"{root}/web"),
                                 DataSource(name="hf", path=f"{root}/hf", format="arrow")])

    from_s3 = prepare_data(spec("s3://corpus/raw"), data_dir=tmp_path / "s3data")
    from_disk = prepare_data(spec(str(local)), data_dir=tmp_path / "diskdata")
    assert [s.sha256 for s in from_s3.manifest.shards] == [s.sha256 for s in from_disk.manifest.shards]
    assert [s["docs_out"] for s in from_s3.report["sources"]] == [30, 30]
    assert from_s3.report["sources"][0]["bytes_read"] > 0
