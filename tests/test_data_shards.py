"""Shards in Megatron's IndexedDataset layout: byte layout, megatron-core's own reader, atomic publish."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from leantrain.data.layout import load_manifest, write_token_data_dir
from leantrain.data.shards import (
    INDEX_HEADER,
    ShardInfo,
    ShardReader,
    ShardWriter,
    map_tokens,
    read_index,
    sha256_file,
    token_dtype,
)
from leantrain.errors import UserInputError

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]


def test_idx_byte_layout(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "s", dtype=np.uint16)
    for doc in DOCS:
        writer.add(np.array(doc))
    writer.finish()
    raw = (tmp_path / "s.idx").read_bytes()
    assert raw[:9] == INDEX_HEADER == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 8  # uint16
    assert struct.unpack("<QQ", raw[18:34]) == (3, 4)
    lengths = np.frombuffer(raw, np.int32, 3, 34)
    pointers = np.frombuffer(raw, np.int64, 3, 34 + 12)
    documents = np.frombuffer(raw, np.int64, 4, 34 + 12 + 24)
    assert lengths.tolist() == [3, 1, 5] and pointers.tolist() == [0, 6, 8] and documents.tolist() == [0, 1, 2, 3]
    assert len(raw) == 34 + 12 + 24 + 32
    assert np.fromfile(tmp_path / "s.bin", np.uint16).tolist() == sum(DOCS, [])
    assert writer.max_token_id == 13


def test_a_token_id_the_shard_dtype_cannot_hold_is_refused_not_wrapped(tmp_path: Path) -> None:
    """An int64 array cast to uint16 wrapped 70000 to 4464 silently, and 4464 was recorded as max_token_id."""
    writer = ShardWriter(tmp_path / "s", dtype=np.uint16)
    with pytest.raises(ValueError, match="token id 70000 does not fit the shard's uint16"):
        writer.add(np.array([5, 70000], dtype=np.int64))
    writer.abort()
    assert not list(tmp_path.glob("*.tmp"))


def test_dtype_switches_to_int32_for_large_vocab(tmp_path: Path) -> None:
    assert token_dtype(512) is np.uint16 and token_dtype(128256) is np.int32
    write_token_data_dir(tmp_path, {"a": [[70000, 1, 2]]}, vocab_size=128256, eos_id=3)
    manifest = load_manifest(tmp_path)
    assert manifest.dtype == "int32"
    reader = ShardReader(tmp_path / manifest.shards[0].path)
    assert reader.doc(0).tolist() == [70000, 1, 2, 3]


def test_manifest_hashes_and_counts(tmp_path: Path) -> None:
    manifest = write_token_data_dir(tmp_path, {"a": DOCS * 10}, vocab_size=64, eos_id=0, shard_size_tokens=20)
    assert len(manifest.shards) > 1
    assert sum(s.num_docs for s in manifest.shards) == 30
    assert sum(s.num_tokens for s in manifest.shards) == 30 + 10 * sum(len(d) for d in DOCS)
    for shard in manifest.shards:
        assert sha256_file(tmp_path / shard.path) == shard.sha256
        assert read_index(tmp_path / shard.path.replace(".bin", ".idx")).document_indices[-1] == shard.num_docs


def test_megatron_core_reads_our_shards(tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="test extra megatron-core")
    write_token_data_dir(tmp_path, {"a": DOCS}, vocab_size=64, eos_id=0)
    prefix = str(tmp_path / "train" / "a_00000")
    dataset = indexed.IndexedDataset(prefix)
    assert len(dataset) == 3
    assert [dataset[i].tolist() for i in range(3)] == [[*d, 0] for d in DOCS]
    assert dataset.document_indices.tolist() == [0, 1, 2, 3]
    # and we read what megatron-core's own builder writes
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for doc in DOCS:
        builder.add_document(np.array(doc), [len(doc)])
    builder.finalize(str(tmp_path / "m.idx"))
    reader = ShardReader(tmp_path / "m.bin")
    assert [reader.doc(i).tolist() for i in range(3)] == DOCS


@pytest.mark.parametrize("num_docs", [1, 2, 3000])
def test_idx_bytes_equal_megatron_cores_builder(tmp_path: Path, num_docs: int) -> None:
    """The .idx written section by section (ShardWriter's compact lengths) is megatron-core's own, byte for byte."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="test extra megatron-core")
    rng = np.random.default_rng(num_docs)
    docs = [rng.integers(0, 60000, int(rng.integers(1, 300))) for _ in range(num_docs)]
    writer = ShardWriter(tmp_path / "ours", dtype=np.uint16)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for doc in docs:
        writer.add(doc)
        builder.add_document(doc.astype(np.uint16), [len(doc)])
    writer.finish()
    builder.finalize(str(tmp_path / "theirs.idx"))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()


@pytest.mark.parametrize("size", [0, 7, 1 << 20, (1 << 20) + 3, 3 * (1 << 20) - 1])
def test_sha256_file_is_hashlibs_across_buffer_boundaries(tmp_path: Path, size: int) -> None:
    import hashlib

    data = np.random.default_rng(size).bytes(size)
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_shards_record_their_largest_token_id_and_older_entries_still_load(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "s", dtype=np.uint16)
    assert writer.max_token_id is None
    for doc in DOCS:
        writer.add(np.array(doc))
    assert writer.max_token_id == 13
    manifest = write_token_data_dir(tmp_path / "d", {"a": DOCS * 10}, vocab_size=64, eos_id=0, shard_size_tokens=20)
    assert [s.max_token_id for s in load_manifest(tmp_path / "d").shards] == [s.max_token_id for s in manifest.shards]
    assert max(s.max_token_id or 0 for s in manifest.shards) == 13
    older = {k: v for k, v in manifest.shards[0].to_json().items() if k != "max_token_id"}
    assert ShardInfo.from_json(older).max_token_id is None
    assert ShardInfo.from_json(older).to_json() == older  # written back as it was read


@pytest.mark.parametrize(("edit", "named"), [
    (lambda m: m["sources"][0].update(weight="heavy"), "'sources.0.weight'"),
    (lambda m: m.update(mixture=[]), "'mixture'"),
    (lambda m: m["mixture"].update(stages=[{"weights": {"a": "x"}}]), "'mixture.stages.0.weights.a'"),
    (lambda m: m.update(eos_id=64), "'eos_id'"),
    (lambda m: m.update(shards={}), "'shards'"),
    (lambda m: m["shards"][0].update(bytes=1), "'shards.0' (train/a_00000.bin): unknown keys ['bytes']"),
    (lambda m: m["shards"][0].update(num_docs=-1), "'num_docs'"),
    (lambda m: m.update(dtype="uint17"), "'dtype'"),
])
def test_a_manifest_with_a_wrong_key_or_type_is_refused_naming_it(tmp_path: Path, edit: Any, named: str) -> None:
    write_token_data_dir(tmp_path, {"a": DOCS}, vocab_size=64, eos_id=0)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    edit(raw)
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(UserInputError) as info:
        load_manifest(tmp_path)
    assert str(tmp_path / "manifest.json") in str(info.value) and named in str(info.value), str(info.value)


def test_a_shards_size_is_checked_once_when_it_is_mapped(tmp_path: Path) -> None:
    """map_tokens compares the file's size with the manifest's token count (one stat, nothing read): a truncated,
    mid-token or missing `.bin` is a user error naming it and what was expected."""
    write_token_data_dir(tmp_path, {"a": DOCS}, vocab_size=64, eos_id=0)
    shard = load_manifest(tmp_path).shards[0]
    path = tmp_path / shard.path
    assert map_tokens(path, dtype=np.dtype(np.uint16), num_tokens=shard.num_tokens).tolist()[:3] == [5, 6, 7]
    for size in (8, shard.num_bytes - 1):
        os.truncate(path, size)
        with pytest.raises(UserInputError, match=f"{path}: {size:,} bytes, expected {shard.num_bytes:,}"):
            map_tokens(path, dtype=np.dtype(np.uint16), num_tokens=shard.num_tokens)
    path.unlink()
    with pytest.raises(UserInputError, match=f"{path}: listed in the data dir's manifest.json but missing"):
        map_tokens(path, dtype=np.dtype(np.uint16), num_tokens=shard.num_tokens)
