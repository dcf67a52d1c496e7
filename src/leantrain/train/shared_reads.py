"""The data dir's shared metadata, read by one rank: rank 0 opens `manifest.json`, writes any missing sampler
index (`data.sample_index`) and hands the manifest to the other ranks in one broadcast at startup, so that on
4,096 ranks the shared file system sees one reader of the metadata instead of 4,096, and no rank maps an index
before it exists (the broadcast is also the barrier)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from leantrain.data.layout import SPLITS, Manifest, load_manifest
from leantrain.data.sample_index import ensure_sample_index
from leantrain.errors import UserInputError


def shared_manifest(data_dir: Path, *, rank: int, distributed: bool) -> Manifest:
    """The data dir's manifest on every rank, read from disk by rank 0 only (a bad data dir fails every rank
    with rank 0's message, never leaves the others waiting)."""
    payload: Manifest | str | None = None
    if rank == 0:
        try:
            payload = load_manifest(Path(data_dir))
            for split in SPLITS:
                ensure_sample_index(Path(data_dir), payload, split=split)
        except UserInputError as err:
            payload = str(err)
    if distributed:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    if isinstance(payload, str) or payload is None:
        raise UserInputError(payload or f"{data_dir}: no manifest from rank 0")
    return payload
