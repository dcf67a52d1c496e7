"""Encryption at rest for checkpoint files: AES-256-GCM in fixed-size chunks (the `cryptography` package).

Why chunks: a checkpoint shard can be many GB, and GCM authenticates a whole message; chunking keeps memory
bounded while still detecting any change. Each chunk is sealed with a fresh random 96-bit nonce and its
associated data binds the file's logical name, the chunk index and a last-chunk flag, so a chunk cannot be
altered, reordered, moved to another file, or dropped from the end without the tag check failing.

File layout: MAGIC | chunk_bytes (4 bytes, big endian) | records, each record = nonce (12) | ciphertext | tag (16);
every record but the last holds exactly chunk_bytes of plaintext.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
from collections.abc import Iterator
from typing import IO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from leantrain.errors import UserInputError

MAGIC = b"LTENC1\n"
HEADER_BYTES = len(MAGIC) + 4
NONCE_BYTES = 12
TAG_BYTES = 16
DEFAULT_CHUNK_BYTES = 4 * 2**20
SCHEME = "aes-256-gcm-chunked-v1"
KEY_HINT = 'generate one with: python -c "import os,base64; print(base64.b64encode(os.urandom(32)).decode())"'


class TamperError(Exception):
    """An encrypted file failed authentication: it was modified, truncated, or the key is wrong."""


def parse_key(value: str, *, var_name: str = "the encryption key variable") -> bytes:
    """A 32-byte key from 64 hex characters or base64; anything else is refused (no weak passphrases)."""
    text = value.strip()
    key: bytes | None = None
    if len(text) == 64:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = None
    for altchars in (None, b"-_"):  # standard or URL-safe alphabet
        if key is not None:
            break
        try:
            key = base64.b64decode(text, altchars=altchars, validate=True)
        except (binascii.Error, ValueError):
            key = None
    if key is None or len(key) != 32:
        raise UserInputError(f"{var_name} must hold a 32-byte key as 64 hex characters or base64; {KEY_HINT}")
    return key


class ChunkCipher:
    """Seals and opens checkpoint files with one key."""

    def __init__(self, key: bytes, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if len(key) != 32:
            raise ValueError("AES-256 needs a 32-byte key")
        self._aead = AESGCM(key)
        self.chunk_bytes = chunk_bytes
        # Recorded in the manifest so that a wrong key is reported as such, not as tampering.
        self.key_id = hmac.new(key, b"leantrain checkpoint key id", hashlib.sha256).hexdigest()[:16]

    def _aad(self, name: str, index: int, *, last: bool) -> bytes:
        return MAGIC + name.encode() + struct.pack(">QB", index, 1 if last else 0)

    def header(self) -> bytes:
        return MAGIC + struct.pack(">I", self.chunk_bytes)

    def seal_chunk(self, plaintext: bytes, *, name: str, index: int, last: bool) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, self._aad(name, index, last=last))

    def open_stream(self, stream: IO[bytes], *, name: str) -> Iterator[bytes]:
        """Yield the plaintext chunks of an encrypted file; raise TamperError on any inconsistency."""
        header = stream.read(HEADER_BYTES)
        if len(header) != HEADER_BYTES or not header.startswith(MAGIC):
            raise TamperError(f"{name}: not an encrypted checkpoint file (bad header)")
        (chunk_bytes,) = struct.unpack(">I", header[len(MAGIC):])
        record_bytes = NONCE_BYTES + chunk_bytes + TAG_BYTES
        index = 0
        record = stream.read(record_bytes)
        while True:
            # Read one record ahead: the last record is the one followed by end of file.
            following = stream.read(record_bytes) if len(record) == record_bytes else b""
            last = not following
            if len(record) < NONCE_BYTES + TAG_BYTES or (not last and len(record) != record_bytes):
                raise TamperError(f"{name}: truncated encrypted record {index}")
            try:
                yield self._aead.decrypt(record[:NONCE_BYTES], record[NONCE_BYTES:], self._aad(name, index, last=last))
            except InvalidTag as err:
                raise TamperError(f"{name}: authentication failed at chunk {index} (tampered or wrong key)") from err
            if last:
                return
            record, index = following, index + 1


class EncryptingWriter:
    """Buffers plaintext into chunks and writes sealed records to `raw` (a binary stream)."""

    def __init__(self, raw: IO[bytes], cipher: ChunkCipher, *, name: str) -> None:
        self._raw, self._cipher, self._name = raw, cipher, name
        self._buffer = bytearray()
        self._index = 0
        self._raw.write(cipher.header())

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += data
        size = self._cipher.chunk_bytes
        # Keep at least one byte buffered so the final record is always sealed with last=True by finish().
        while len(self._buffer) > size:
            chunk = bytes(self._buffer[:size])
            del self._buffer[:size]
            self._raw.write(self._cipher.seal_chunk(chunk, name=self._name, index=self._index, last=False))
            self._index += 1

    def finish(self) -> None:
        record = self._cipher.seal_chunk(bytes(self._buffer), name=self._name, index=self._index, last=True)
        self._raw.write(record)
        self._buffer.clear()
