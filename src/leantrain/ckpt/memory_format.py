"""The fast tier's file and wire format: a JSON header and raw tensor bytes, no pickle.

    MAGIC | 8-byte little-endian header length | header (JSON) | tensor bytes, one after another

The header holds the step, the meta (e.g. the schedule settings), the state tree with every tensor replaced by
`{"__t": i}` (and NumPy arrays by `{"__np": i}`, tuples by `{"__tu": [...]}`, mappings with non-string keys by
`{"__d": [[k, v], ...]}`), and the tensor table (dtype, shape, bytes). Reading it back runs no code from the
file: JSON, then `torch.frombuffer` views of the bytes. The sha256 of the whole stream is the file's sidecar
and what a sender announces before a transfer, so a receiver checks what arrived against the sender's hash.

Host memory: a shard is written and sent from the tensors' own memory (a device tensor gets one CPU copy,
a contiguous CPU tensor none, a non-contiguous one a contiguous copy); a reader holds the file's bytes once
and views the tensors in it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

MAGIC = b"LTMEM001"
MARKERS = ("__t", "__np", "__tu", "__d")


@dataclass
class Encoded:
    """One rank's shard ready to write or send: the header bytes and the tensors' byte views."""

    header: bytes
    views: list[torch.Tensor]  # uint8, contiguous, CPU: what goes after the header, in order
    sha256: str | None = None  # of the whole stream, once written or hashed

    @property
    def prefix(self) -> bytes:
        return MAGIC + struct.pack("<Q", len(self.header)) + self.header

    @property
    def num_bytes(self) -> int:
        return len(self.prefix) + sum(v.numel() for v in self.views)

    def chunks(self) -> Iterator[memoryview | bytes]:
        yield self.prefix
        for view in self.views:
            if view.numel():
                yield memoryview(view.numpy())

    def digest(self) -> str:
        if self.sha256 is None:
            h = hashlib.sha256()
            for chunk in self.chunks():
                h.update(chunk)
            self.sha256 = h.hexdigest()
        return self.sha256


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    local = local.detach()
    if local.device.type != "cpu":
        local = local.cpu()  # the one host copy of a device tensor
    if not local.is_contiguous():
        local = local.contiguous()
    return local.reshape(-1).view(torch.uint8) if local.numel() else torch.empty(0, dtype=torch.uint8)


def encode(*, step: int, meta: dict[str, Any], state: dict[str, Any]) -> Encoded:
    """This rank's part of `state` (a DTensor's local shard) as header + byte views; TypeError for a value
    the format cannot hold."""
    table: list[dict[str, Any]] = []
    views: list[torch.Tensor] = []

    def add(tensor: torch.Tensor, kind: str) -> dict[str, int]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        table.append({"dtype": str(local.dtype).removeprefix("torch."), "shape": list(local.shape)})
        views.append(_byte_view(local))
        table[-1]["bytes"] = int(views[-1].numel())
        return {kind: len(table) - 1}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return add(value, "__t")
        if isinstance(value, np.ndarray):
            return add(torch.from_numpy(np.ascontiguousarray(value)), "__np")
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in MARKERS for k in value):
                return {k: walk(v) for k, v in value.items()}
            return {"__d": [[walk(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tu": [walk(v) for v in value]}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, str | int | float | bool):
            return value
        raise TypeError(f"the fast tier cannot keep a {type(value).__name__} value")

    tree = walk(state)
    header = json.dumps({"step": step, "meta": meta, "tensors": table, "tree": tree}).encode()
    return Encoded(header=header, views=views)


@dataclass
class Decoded:
    step: int
    meta: dict[str, Any]
    state: dict[str, Any]


def decode(buffer: bytearray) -> Decoded:
    """Parse a whole stream (already checked against its hash) into tensors viewing `buffer`."""
    if bytes(buffer[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a fast-tier file")
    (length,) = struct.unpack("<Q", bytes(buffer[len(MAGIC): len(MAGIC) + 8]))
    start = len(MAGIC) + 8
    header = json.loads(bytes(buffer[start: start + length]))
    offset = start + length
    tensors = []
    for entry in header["tensors"]:
        dtype = getattr(torch, entry["dtype"])
        if entry["bytes"]:
            flat = torch.frombuffer(buffer, dtype=torch.uint8, offset=offset, count=entry["bytes"])
            tensors.append(flat.view(dtype).reshape(entry["shape"]))
        else:
            tensors.append(torch.empty(entry["shape"], dtype=dtype))
        offset += entry["bytes"]

    def build(node: Any) -> Any:
        if isinstance(node, dict):
            if "__t" in node and len(node) == 1:
                return tensors[node["__t"]]
            if "__np" in node and len(node) == 1:
                return tensors[node["__np"]].numpy()
            if "__tu" in node and len(node) == 1:
                return tuple(build(v) for v in node["__tu"])
            if "__d" in node and len(node) == 1:
                return {build(k): build(v) for k, v in node["__d"]}
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v) for v in node]
        return node

    return Decoded(step=int(header["step"]), meta=header.get("meta") or {}, state=build(header["tree"]))


def write_chunks(stream: IO[bytes], chunks: Iterator[memoryview | bytes]) -> str:
    """Write and hash; the sha256 of what was written."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
        stream.write(chunk)
    return h.hexdigest()


def read_verified(path: Path, digest: str) -> bytearray | None:
    """The file's bytes when their sha256 is `digest`, else None (read once into one buffer)."""
    try:
        size = path.stat().st_size
        buffer = bytearray(size)
        with open(path, "rb") as fh:
            if fh.readinto(buffer) != size:
                return None
    except OSError:
        return None
    return buffer if hashlib.sha256(buffer).hexdigest() == digest else None


def tree_mismatch(template: Any, saved: Any, where: str = "state") -> str | None:
    """Where `saved` (decoded) does not fit the live tensors of `template` (another shape: a shard of another
    layout), or None; checked on every rank before any is filled."""
    if isinstance(template, torch.Tensor):
        local = template.to_local() if isinstance(template, DTensor) else template
        shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else None
        return None if shape == tuple(local.shape) else f"{where}: saved {shape}, live {tuple(local.shape)}"
    if isinstance(template, dict) and isinstance(saved, dict):
        return next((m for k in saved if k in template
                     if (m := tree_mismatch(template[k], saved[k], f"{where}.{k}"))), None)
    if isinstance(template, list) and isinstance(saved, list):
        if len(template) != len(saved):
            return f"{where}: {len(saved)} saved items, {len(template)} live"
        return next((m for i, (t, v) in enumerate(zip(template, saved, strict=True))
                     if (m := tree_mismatch(t, v, f"{where}.{i}"))), None)
    return None


def fill_tree(template: Any, saved: Any) -> Any:
    """Copy `saved` (decoded, same layout) into the live tensors of `template`; the filled tree. A saved tensor
    of another shape than the live one is a ValueError: `copy_` would broadcast it without a word."""
    if isinstance(template, torch.Tensor):
        local = template.to_local() if isinstance(template, DTensor) else template
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(local.shape):
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(f"a saved shard of shape {shape} for a live one of {tuple(local.shape)}")
        local.copy_(saved)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        return {k: fill_tree(template[k], saved[k]) if k in template else saved[k] for k in saved}
    if isinstance(template, list) and isinstance(saved, list):
        return [fill_tree(t, s) for t, s in zip(template, saved, strict=True)]
    return saved
