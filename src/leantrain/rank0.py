"""Shared metadata read by one rank: rank 0 opens the file (a data dir's `manifest.json`, a Hugging Face
checkpoint's safetensors headers, a checkpoint's manifest and DCP `.metadata`), checks it, and hands the result
to the other ranks in one broadcast, so that on 4,096 ranks the shared file system sees one reader of the
metadata instead of 4,096. A bad input fails every rank with rank 0's message; none is left waiting.

It sits below `train/` and `ckpt/` (layer 0) because both read shared metadata this way."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from leantrain.errors import UserInputError

T = TypeVar("T")


class _Refused:
    """Rank 0's UserInputError, carried to the other ranks."""

    def __init__(self, message: str) -> None:
        self.message = message


def from_rank0(read: Callable[[], T], *, group: dist.ProcessGroup | None = None) -> T:
    """`read()` on rank 0 of `group` (the default group when None; every rank when there is no process group),
    its result broadcast to the others. A UserInputError on rank 0 is raised on every rank; `read` should turn
    any other failure it expects into its result, since the other ranks would wait for it at the broadcast."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    payload: object = None
    if not distributed or dist.get_rank(group) == 0:
        try:
            payload = read()
        except UserInputError as err:
            payload = _Refused(str(err))
    if distributed:
        box = [payload]
        dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        payload = box[0]
    if isinstance(payload, _Refused):
        raise UserInputError(payload.message)
    return payload  # type: ignore[return-value]
