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
import io
import os
import struct
from collections.abc import Iterator
from typing import IO, Any

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


def read_header(stream: IO[bytes], *, name: str) -> int:
    """The chunk size an encrypted file's header states (read from the stream's position); TamperError when the
    header is not one."""
    header = stream.read(HEADER_BYTES)
    if len(header) != HEADER_BYTES or not header.startswith(MAGIC):
        raise TamperError(f"{name}: not an encrypted checkpoint file (bad header)")
    return int(struct.unpack(">I", header[len(MAGIC):])[0])


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

    def open_chunk(self, record: bytes, *, name: str, index: int, last: bool) -> bytes:
        """The plaintext of one sealed record; TamperError when it does not authenticate."""
        try:
            return self._aead.decrypt(record[:NONCE_BYTES], record[NONCE_BYTES:], self._aad(name, index, last=last))
        except InvalidTag as err:
            raise TamperError(f"{name}: authentication failed at chunk {index} (tampered or wrong key)") from err

    def open_stream(self, stream: IO[bytes], *, name: str) -> Iterator[bytes]:
        """Yield the plaintext chunks of an encrypted file; raise TamperError on any inconsistency."""
        chunk_bytes = read_header(stream, name=name)
        record_bytes = NONCE_BYTES + chunk_bytes + TAG_BYTES
        index = 0
        record = stream.read(record_bytes)
        while True:
            # Read one record ahead: the last record is the one followed by end of file.
            following = stream.read(record_bytes) if len(record) == record_bytes else b""
            last = not following
            if len(record) < NONCE_BYTES + TAG_BYTES or (not last and len(record) != record_bytes):
                raise TamperError(f"{name}: truncated encrypted record {index}")
            yield self.open_chunk(record, name=name, index=index, last=last)
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


class SealedRandomReader(io.RawIOBase):
    """The plaintext of an encrypted file read at any offset (seek, read): only the chunks a read touches are
    fetched and authenticated (each bound to its index, the file's last one to the last flag), the newest kept.
    DCP reads a rank's slices of a file by seeking; decrypting whole files made every rank read all of a file
    whose replicated entries it loads (the run's counters, held in one rank's shard file)."""

    def __init__(self, raw: IO[bytes], cipher: ChunkCipher, *, name: str) -> None:
        super().__init__()
        self._raw, self._cipher, self._name = raw, cipher, name
        raw.seek(0)
        self._chunk_bytes = read_header(raw, name=name)
        self._record_bytes = NONCE_BYTES + self._chunk_bytes + TAG_BYTES
        body = raw.seek(0, io.SEEK_END) - HEADER_BYTES
        self._chunks = max(1, -(-body // self._record_bytes))
        self._last_record = body - (self._chunks - 1) * self._record_bytes
        if self._last_record < NONCE_BYTES + TAG_BYTES:
            raise TamperError(f"{name}: truncated encrypted record {self._chunks - 1}")
        self.size = (self._chunks - 1) * self._chunk_bytes + self._last_record - NONCE_BYTES - TAG_BYTES
        self._pos = 0
        self._cached: tuple[int, bytes] = (-1, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self._name}: seek before the start")
        self._pos = base + offset
        return self._pos

    def _chunk(self, index: int) -> bytes:
        if self._cached[0] != index:
            last = index == self._chunks - 1
            self._raw.seek(HEADER_BYTES + index * self._record_bytes)
            record = self._raw.read(self._last_record if last else self._record_bytes)
            if len(record) != (self._last_record if last else self._record_bytes):
                raise TamperError(f"{self._name}: truncated encrypted record {index}")
            self._cached = (index, self._cipher.open_chunk(record, name=self._name, index=index, last=last))
        return self._cached[1]

    def readinto(self, buffer: Any) -> int:
        view, done = memoryview(buffer).cast("B"), 0
        while done < len(view) and self._pos < self.size:
            index, start = divmod(self._pos, self._chunk_bytes)
            piece = self._chunk(index)[start:start + len(view) - done]
            view[done:done + len(piece)] = piece
            done += len(piece)
            self._pos += len(piece)
        return done
