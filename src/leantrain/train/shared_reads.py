"""Shared metadata read by one rank: rank 0 opens the file (the data dir's `manifest.json`, a Hugging Face
checkpoint's safetensors headers), checks it, and hands the result to the other ranks in one broadcast at
startup, so that on 4,096 ranks the shared file system sees one reader of the metadata instead of 4,096. A bad
input fails every rank with rank 0's message; none is left waiting."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from leantrain.data.layout import SPLITS, Manifest, load_manifest
from leantrain.data.sample_index import ensure_sample_index
from leantrain.errors import UserInputError

T = TypeVar("T")


class _Refused:
    """Rank 0's UserInputError, carried to the other ranks."""

    def __init__(self, message: str) -> None:
        self.message = message


def from_rank0(read: Callable[[], T]) -> T:
    """`read()` on rank 0 (every rank when there is no process group), its result broadcast to the others."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    payload: object = None
    if not distributed or dist.get_rank() == 0:
        try:
            payload = read()
        except UserInputError as err:
            payload = _Refused(str(err))
    if distributed:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    if isinstance(payload, _Refused):
        raise UserInputError(payload.message)
    return payload  # type: ignore[return-value]


def shared_manifest(data_dir: Path) -> Manifest:
    """The data dir's manifest on every rank; rank 0 also writes any missing sampler index (`data.sample_index`)
    before the others can map it (the broadcast is the barrier)."""

    def read() -> Manifest:
        manifest = load_manifest(Path(data_dir))
        for split in SPLITS:
            ensure_sample_index(Path(data_dir), manifest, split=split)
        return manifest

    return from_rank0(read)
