"""Resume reads at scale: DCP's `.metadata` read by rank 0 alone, and shard files verified by the read that loads
them.

DCP's `FileSystemReader` opens `.metadata` on every rank (torch/distributed/checkpoint/state_dict_loader.py,
`local_step`); `VerifiedReader` hands every rank the copy rank 0 read and broadcast instead.

Integrity at resume. Neither torchtitan (it calls `dcp.load` as is) nor Megatron-Core's distributed checkpoints
hash shard contents on load, and DCP records no checksums; this project's checkpoints do (the manifest's sha256 per
file) and a resume must not train on a flipped bit. A separate hashing pass before the load read every file twice
(a whole pass, then DCP's reads). Instead each file is checked by exactly one rank, the one loading the most of it
(picked by the coordinator from every rank's plan, in `prepare_global_plan`), as it loads: that rank reads the
file once front to back, hands DCP its slices and hashes the rest (`integrity.OnePassReader`); the other ranks
read only their slices. A mismatch fails DCP's read step, which DCP reports on every rank, so all ranks fall back
together. In the usual resume (same layout) each rank is the checker of the files it wrote, and reads nothing
but them plus the slices of replicated state; of an encrypted file the other ranks read and authenticate only
the 4 MiB chunks under their slices (`crypto.SealedRandomReader`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

import leantrain.ckpt.integrity as integ
from leantrain.ckpt.crypto import TamperError
from leantrain.ckpt.dcp_io import SealedFileSystem, SealedReader

METADATA_NAME = ".metadata"


def read_checked(fs: SealedFileSystem, rel: str, record: dict) -> bytes:
    """A whole stored file, read once and checked against its manifest record (decrypted when encrypted)."""
    with _open_checked(fs, rel, record) as stream:
        if isinstance(stream, integ.OnePassReader):
            return stream.slice(0, record["bytes"])
        return stream.read()


def read_metadata(fs: SealedFileSystem, folder: str, manifest: dict) -> Metadata:
    """DCP's metadata of a checkpoint, checked against the manifest (rank 0 calls this; the rest get a copy)."""
    record = manifest.get("files", {}).get(METADATA_NAME)
    if record is None:
        raise integ.IntegrityError(f"{folder}: manifest lists no DCP {METADATA_NAME}")
    return pickle.loads(read_checked(fs, f"{folder}/{METADATA_NAME}", record))  # noqa: S301 - DCP's own format


def unread_files(manifest: dict, metadata: Metadata) -> list[str]:
    """Files of the manifest that no DCP load reads (the extra files of a save, e.g. lineage.json)."""
    dcp_files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(set(manifest.get("files", {})) - dcp_files - {METADATA_NAME})


@contextmanager
def _open_checked(fs: SealedFileSystem, rel: str, record: dict) -> Iterator[IO[bytes] | integ.OnePassReader]:
    """A read of `rel` that is checked when the `with` block ends without an error."""
    folder, name = rel.rsplit("/", 1)
    try:
        with fs.store.open_read(rel) as raw:
            if fs.cipher is None:
                reader = integ.OnePassReader(raw, rel=fs.store.describe(rel), record=record)
                yield reader
                reader.finish()
                return
            hashing = integ.HashingReader(raw)
            plain = b"".join(fs.cipher.open_stream(hashing, name=f"{integ.step_name(folder)}/{name}"))  # type: ignore[arg-type]
            while hashing.read(integ.READ_CHUNK_BYTES):
                pass
            integ.check_read(fs.store.describe(rel), record, num_bytes=hashing.num_bytes,
                             sha256=hashing.digest.hexdigest())
            yield io.BytesIO(plain)
    except FileNotFoundError as err:
        raise integ.IntegrityError(f"{fs.store.describe(rel)}: missing") from err
    except TamperError as err:
        raise integ.IntegrityError(f"{folder}: {err}") from err
    except OSError as err:
        raise integ.IntegrityError(f"{fs.store.describe(rel)}: read failed: {err}", permanent=False) from err


class _CheckingFs:
    """The reader's file system: the files this rank checks are opened through `_open_checked`."""

    def __init__(self, fs: SealedFileSystem, reader: VerifiedReader) -> None:
        self._fs, self._reader = fs, reader

    def concat_path(self, path: str | Any, suffix: str) -> str:
        return self._fs.concat_path(path, suffix)

    def create_stream(self, path: str | Any, mode: str) -> Any:
        name = str(path).rsplit("/", 1)[1]
        if mode == "rb" and name in self._reader.to_check:
            return _open_checked(self._fs, str(path), self._reader.records[name])
        return self._fs.create_stream(path, mode)


class VerifiedReader(SealedReader):
    """DCP's reader with rank 0's metadata on every rank and each file checked by one rank as it loads it."""

    def __init__(self, fs: SealedFileSystem, folder: str, *, metadata: Metadata, records: dict[str, dict]) -> None:
        super().__init__(fs, folder)
        self.fs = _CheckingFs(fs, self)  # type: ignore[assignment]
        self.records = records
        self.to_check: frozenset[str] = frozenset()
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to rank-local metadata: this format has none
            raise FileNotFoundError("no rank-local DCP metadata")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator, with every rank's plan: each file goes to the rank that loads the most of it."""
        plans = super().prepare_global_plan(plans)
        loaded: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for rank, plan in enumerate(plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                loaded[info.relative_path][rank] += info.length
        checker = {path: max(by_rank, key=lambda r: (by_rank[r], -r)) for path, by_rank in loaded.items()}
        return [dataclasses.replace(plan, storage_data=sorted(p for p, r in checker.items() if r == rank))
                for rank, plan in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.to_check = frozenset(plan.storage_data or ())

        def where(item: Any) -> tuple[str, int, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset, info.length

        # One pass per file needs its slices in file order; DCP keeps the order of the plan's items per file.
        return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=where)), planner)

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        if isinstance(file, integ.OnePassReader):
            return io.BytesIO(file.slice(sinfo.offset, sinfo.length))
        return super()._slice_file(file, sinfo)
