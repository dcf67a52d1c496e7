"""Data staging from an fsspec URL (the in-memory filesystem stands in for an object store): verified
against the manifest's hashes, resumable after an interruption, idempotent, and refusing corrupt data."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from leantrain.errors import CheckFailed, UserInputError
from leantrain.launch.staging import ensure_local_data, is_remote, stage_data
from leantrain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def remote() -> tuple[str, dict[str, bytes]]:
    """A prepared data dir in memory://: tokenizer, two shards (.bin/.idx), manifest with hashes."""
    url = f"memory://bucket-{uuid.uuid4().hex[:8]}/data"
    files = {
        "tokenizer.json": b'{"model": "bpe"}',
        "train/en_00000.bin": bytes(range(256)) * 300,
        "train/en_00000.idx": b"MMIDIDX\x00\x00" + b"\x01" * 64,
        "valid/en_00000.bin": b"\x07" * 5000,
        "valid/en_00000.idx": b"MMIDIDX\x00\x00" + b"\x02" * 32,
    }
    manifest = {
        "tokenizer": {"path": "tokenizer.json", "sha256": sha(files["tokenizer.json"])},
        "shards": [
            {"path": f"{split}/en_00000.bin", "sha256": sha(files[f"{split}/en_00000.bin"]),
             "idx_sha256": sha(files[f"{split}/en_00000.idx"]), "num_bytes": len(files[f"{split}/en_00000.bin"])}
            for split in ("train", "valid")
        ],
    }
    files["manifest.json"] = json.dumps(manifest).encode()
    fs = fsspec.filesystem("memory")
    for rel, data in files.items():
        fs.pipe_file(f"{url.removeprefix('memory://')}/{rel}", data)
    yield url, files
    fs.rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def test_stage_copies_and_verifies_every_file_then_is_up_to_date(remote, tmp_path: Path) -> None:
    url, files = remote
    assert is_remote(url) and is_remote("s3://b/d") and not is_remote("/local/data") and not is_remote("file:///x")
    result = stage_data(url, tmp_path / "local")
    assert result.num_files == len(files) and result.num_skipped == 0
    for rel, data in files.items():
        assert (tmp_path / "local" / rel).read_bytes() == data
    assert not list((tmp_path / "local").rglob("*.part"))
    again = stage_data(url, tmp_path / "local")
    assert again.up_to_date and again.downloaded_bytes == 0


def test_an_interrupted_copy_resumes_from_the_partial_file(remote, tmp_path: Path) -> None:
    url, files = remote
    dest = tmp_path / "local"
    shard = files["train/en_00000.bin"]
    (dest / "train").mkdir(parents=True)
    (dest / "train" / "en_00000.bin.part").write_bytes(shard[:30000])  # what an interrupted run left
    (dest / "tokenizer.json").write_bytes(files["tokenizer.json"])  # already complete
    result = stage_data(url, dest)
    assert result.resumed_from_bytes == 30000 and result.num_skipped == 1
    assert result.downloaded_bytes == sum(len(d) for d in files.values()) - 30000 - len(files["tokenizer.json"]) \
        - len(files["manifest.json"])
    assert (dest / "train" / "en_00000.bin").read_bytes() == shard


def test_corrupt_remote_shard_is_refused_and_not_published(remote, tmp_path: Path) -> None:
    url, files = remote
    fsspec.filesystem("memory").pipe_file(f"{url.removeprefix('memory://')}/valid/en_00000.bin", b"\x00" * 5000)
    with pytest.raises(CheckFailed, match="valid/en_00000.bin: sha256 does not match"):
        stage_data(url, tmp_path / "local")
    assert not (tmp_path / "local" / "valid" / "en_00000.bin").exists()
    assert not (tmp_path / "local" / "manifest.json").exists()  # an incomplete copy never looks complete


def test_missing_manifest_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="manifest.json does not exist"):
        stage_data(f"memory://nothing-{uuid.uuid4().hex[:6]}", tmp_path)


def test_launch_stages_when_the_spec_names_a_remote_data_dir(remote, tmp_path: Path) -> None:
    url, files = remote
    spec = load_spec(REPO / "examples" / "tiny-cpu.yaml",
                     overrides=[f"cluster.data_url={url}", f"data.dir={tmp_path / 'node-local'}"])
    result = ensure_local_data(spec)
    assert result is not None and (tmp_path / "node-local" / "manifest.json").read_bytes() == files["manifest.json"]
    assert ensure_local_data(load_spec(REPO / "examples" / "tiny-cpu.yaml")) is None
