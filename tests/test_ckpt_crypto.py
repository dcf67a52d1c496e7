"""Encryption at rest: chunked AES-GCM format, key parsing, encrypted round trip and tamper detection."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from leantrain.ckpt import CheckpointLoadError, CheckpointManager
from leantrain.ckpt.crypto import ChunkCipher, EncryptingWriter, TamperError, parse_key
from leantrain.errors import UserInputError
from leantrain.spec.schema import SecuritySpec
from test_ckpt_manager import assert_same, events, make_app, make_spec, resume, snapshot, train

KEY = bytes(range(32))


def encrypted_spec() -> Any:
    """Set after loading: spec/load.py's secret-key pattern does not cover `encryption_key` yet, so the loader
    would substitute the variable's value into the field (reported to the lead)."""
    spec = make_spec()
    spec.security = SecuritySpec(encrypt_checkpoints=True, encryption_key="${LT_TEST_CKPT_KEY}")
    return spec


def seal(data: bytes, *, name: str = "step-00000001/a", chunk_bytes: int = 16) -> bytes:
    out = io.BytesIO()
    writer = EncryptingWriter(out, ChunkCipher(KEY, chunk_bytes=chunk_bytes), name=name)
    writer.write(data)
    writer.finish()
    return out.getvalue()


def unseal(blob: bytes, *, name: str = "step-00000001/a", key: bytes = KEY) -> bytes:
    return b"".join(ChunkCipher(key).open_stream(io.BytesIO(blob), name=name))


@pytest.mark.parametrize("size", [0, 1, 16, 17, 100])
def test_chunked_round_trip(size: int) -> None:
    data = os.urandom(size)
    blob = seal(data)
    assert unseal(blob) == data
    assert len(data) < 8 or data not in blob  # short strings can occur in ciphertext by chance


class _CountingBytes(io.BytesIO):
    read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data)
        return data


@pytest.mark.parametrize("size", [0, 1, 16, 32, 37, 100])
def test_a_slice_of_an_encrypted_file_is_read_from_its_chunks_alone(size: int) -> None:
    """DCP loads a rank's slices of a file by seeking; a read decrypted the whole file into memory, so every rank
    read all of the shard file that holds the run's replicated state (one rank's, GBs at 405B). The reader fetches
    and authenticates only the chunks a slice covers, and still finds a changed or missing byte."""
    from leantrain.ckpt.crypto import HEADER_BYTES, NONCE_BYTES, TAG_BYTES, SealedRandomReader

    data = os.urandom(size)
    blob = seal(data)
    cipher = ChunkCipher(KEY, chunk_bytes=16)
    reader = SealedRandomReader(io.BytesIO(blob), cipher, name="step-00000001/a")
    assert reader.size == size and reader.read() == data and reader.read(5) == b""
    for offset, length in ((0, 3), (5, 20), (15, 2), (size - 7, 7), (40, 60)):
        offset = max(0, min(offset, size))
        assert reader.seek(offset) == offset and reader.read(length) == data[offset:offset + length]
    if size >= 4:
        assert reader.seek(-4, io.SEEK_END) == size - 4 and reader.read() == data[-4:]
    if size >= 100:
        counted = _CountingBytes(blob)
        slice_reader = SealedRandomReader(counted, cipher, name="step-00000001/a")
        counted.read_bytes = 0
        slice_reader.seek(70)
        assert slice_reader.read(8) == data[70:78]  # inside chunk 4: one record read, not the file
        assert counted.read_bytes == NONCE_BYTES + 16 + TAG_BYTES < len(blob) - HEADER_BYTES
        damaged = bytearray(blob)
        damaged[HEADER_BYTES + 2 * (NONCE_BYTES + 16 + TAG_BYTES) + NONCE_BYTES] ^= 1  # chunk 2
        tampered = SealedRandomReader(io.BytesIO(bytes(damaged)), cipher, name="step-00000001/a")
        assert tampered.read(16) == data[:16]
        with pytest.raises(TamperError, match="chunk 2"):
            tampered.seek(33)
            tampered.read(4)
        cut = SealedRandomReader(io.BytesIO(blob[:-3]), cipher, name="step-00000001/a")  # the end cut off
        with pytest.raises(TamperError):
            cut.seek(cut.size - 1)
            cut.read(1)


def test_any_change_is_detected() -> None:
    data = b"x" * 100  # 7 chunks of 16 bytes
    blob = seal(data)
    record = 12 + 16 + 16
    flipped = bytearray(blob)
    flipped[-5] ^= 1
    cases = {
        "bit flip": bytes(flipped),
        "dropped last record": blob[: len(blob) - (12 + 4 + 16)],  # ends on a record boundary
        "truncated": blob[:-3],
        "swapped records": blob[:11] + blob[11 + record:11 + 2 * record] + blob[11:11 + record]
        + blob[11 + 2 * record:],
    }
    for label, bad in cases.items():
        with pytest.raises(TamperError):
            unseal(bad)
        assert label
    with pytest.raises(TamperError):
        unseal(blob, name="step-00000002/a")  # moved to another file
    with pytest.raises(TamperError):
        unseal(blob, key=bytes(32))


def test_parse_key_accepts_hex_and_base64_only() -> None:
    assert parse_key(KEY.hex()) == KEY
    assert parse_key(base64.b64encode(KEY).decode()) == KEY
    assert parse_key(base64.urlsafe_b64encode(b"\xfb" * 32).decode()) == b"\xfb" * 32
    for weak in ("hunter2", base64.b64encode(b"short").decode(), "zz" * 32):
        with pytest.raises(UserInputError, match="32-byte key"):
            parse_key(weak)


def test_encrypted_checkpoint_round_trip_and_tamper_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LT_TEST_CKPT_KEY", base64.b64encode(KEY).decode())
    spec = encrypted_spec()
    run_dir = tmp_path / "run"
    app = make_app()
    train(app, 2)
    ckpt = CheckpointManager(spec, run_dir=run_dir, extra_files=lambda step: {"lineage.json": b'{"step": 2}'})
    ckpt.save(2, app, blocking=True)
    expected = snapshot(app)
    assert b'"step"' not in (run_dir / "checkpoints" / "step-00000002" / "lineage.json").read_bytes()
    train(app, 2)
    ckpt.save(4, app, blocking=True)
    ckpt.close()

    folder = run_dir / "checkpoints" / "step-00000004"
    shard = folder / "__0_0.distcp"
    weight_bytes = app["model"][0].weight.detach().numpy().tobytes()
    assert weight_bytes[:64] not in shard.read_bytes()  # no plaintext at rest
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["encryption"]["scheme"] == "aes-256-gcm-chunked-v1"

    # An attacker who can rewrite the manifest and commit marker still cannot forge the GCM tags.
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    manifest["files"]["__0_0.distcp"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    manifest_bytes = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(manifest_bytes)
    commit = json.loads((folder / "COMMIT").read_text())
    commit["manifest_sha256"] = hashlib.sha256(manifest_bytes).hexdigest()
    (folder / "COMMIT").write_text(json.dumps(commit))

    fresh = make_app(seed=9)
    assert resume(spec, run_dir, fresh) == 2
    assert_same(snapshot(fresh), expected)
    invalid = [e for e in events(run_dir) if e["event"] == "checkpoint_invalid"]
    assert invalid[0]["step"] == 4 and "authentication failed" in invalid[0]["reason"]


def test_wrong_key_is_reported_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LT_TEST_CKPT_KEY", KEY.hex())
    spec = encrypted_spec()
    run_dir = tmp_path / "run"
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    ckpt.save(2, make_app(), blocking=True)
    ckpt.close()
    monkeypatch.setenv("LT_TEST_CKPT_KEY", bytes(32).hex())
    fresh = make_app(seed=1)
    before = [p.detach().clone() for p in fresh["model"].parameters()]
    # The user's input is wrong, not the checkpoint: exit 2, nothing condemned, nothing loaded, no fresh start.
    with pytest.raises(CheckpointLoadError, match="another key") as raised:
        resume(spec, run_dir, fresh)
    assert raised.value.exit_code == 2 and str(run_dir) in str(raised.value)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh["model"].parameters(), strict=True))
    reasons = [e["reason"] for e in events(run_dir) if e["event"] == "checkpoint_invalid"]
    assert "another key" in reasons[0]
    assert not (run_dir / "checkpoints" / "step-00000002" / "CORRUPT").exists()
    monkeypatch.setenv("LT_TEST_CKPT_KEY", KEY.hex())
    assert resume(spec, run_dir, fresh) == 2


def test_plaintext_checkpoint_still_loads_after_encryption_is_enabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LT_TEST_CKPT_KEY", KEY.hex())
    run_dir = tmp_path / "run"
    app = make_app()
    train(app, 1)
    ckpt = CheckpointManager(make_spec(), run_dir=run_dir)
    ckpt.save(2, app, blocking=True)
    ckpt.close()
    expected = snapshot(app)
    fresh = make_app(seed=6)
    assert resume(encrypted_spec(), run_dir, fresh) == 2
    assert_same(snapshot(fresh), expected)
