"""The fast checkpoint tier: every `checkpoint.memory_interval_steps` steps each rank keeps its own shard of the
state on node-local storage (`checkpoint.memory_dir`, tmpfs by default: host memory) and a copy on a peer rank
`checkpoint.memory_peer_offset` ranks on (by default one node on: the same shard of the next node's ranks),
besides the durable tier on the store every `interval_steps`.

Layout, per run (`<memory_dir>/<run id>/`): `rank-R/step-S.pt` (R's own shard) and `peer-of-R/step-S.pt` (the
copy R sent to the rank that holds it), each with a `.sha256` sidecar written after it, so a file without
its sidecar is never trusted. Only the newest step is kept.

A save is one torch.save per rank into memory plus one point-to-point exchange of those bytes with the peers
(gloo, on the manager's save group): no collective over the whole state and no full model anywhere. On a
restart at the same world size the ranks agree on the newest step S for which every rank's shard exists,
its own or at its peer (a replaced node lost the own copies of its ranks; the peers send them back), and
resume from it when it is newer than the durable tier's newest checkpoint. A restart at another world size
or layout uses the durable tier (shards are per rank).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("leantrain.ckpt")
STEP_FILE_RE = re.compile(r"^step-(\d{8})\.pt$")


def memory_root(memory_dir: Path, run_dir: Path) -> Path:
    """This run's folder in the node-local memory dir: the same across restarts, another for another run dir."""
    resolved = str(Path(run_dir).resolve())
    return Path(memory_dir) / f"{Path(resolved).name}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}"


def to_local_tree(value: Any) -> Any:
    """A CPU copy of this rank's part of a state dict (a DTensor's local shard; other values as they are)."""
    if isinstance(value, DTensor):
        return value.to_local().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_local_tree(v) for v in value]
    return value


def fill_tree(template: Any, saved: Any) -> Any:
    """Copy `saved` (from to_local_tree, same layout) into the live tensors of `template`; the filled tree."""
    if isinstance(template, DTensor):
        template.to_local().copy_(saved)
        return template
    if isinstance(template, torch.Tensor):
        template.copy_(saved)
        return template
    if isinstance(template, dict):
        return {k: fill_tree(template[k], saved[k]) if k in template else saved[k] for k in saved}
    if isinstance(template, list):
        return [fill_tree(t, s) for t, s in zip(template, saved, strict=True)]
    return saved


class MemoryTier:
    """One rank's fast tier (see the module docstring). All ranks call `save` and `best_step`/`load` together."""

    def __init__(self, *, root: Path, rank: int, world_size: int, peer_offset: int,
                 process_group: dist.ProcessGroup | None) -> None:
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.group = process_group
        offset = peer_offset % world_size if world_size > 1 else 0
        self.peer = (rank + offset) % world_size if offset else None  # who holds my copy
        self.holds_for = (rank - offset) % world_size if offset else None  # whose copy I hold
        self.last_step: int | None = None

    # ---- files ----------------------------------------------------------------------------------------
    def _own(self, rank: int) -> Path:
        return self.root / f"rank-{rank}"

    def _copy(self, rank: int) -> Path:
        return self.root / f"peer-of-{rank}"

    def node_folders(self) -> list[Path]:
        """What this rank keeps on its node: its own shard and the copy it holds for another rank."""
        return [self._own(self.rank), *([self._copy(self.holds_for)] if self.holds_for is not None else [])]

    def clear(self) -> None:
        """Remove what this rank keeps (at the end of a run whose last step is on the durable tier)."""
        import shutil

        for folder in self.node_folders():
            shutil.rmtree(folder, ignore_errors=True)
        if self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()

    @staticmethod
    def _write(folder: Path, step: int, data: bytes) -> None:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"step-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        (folder / f"{path.name}.sha256").write_text(hashlib.sha256(data).hexdigest())
        for old in folder.iterdir():  # only the newest step is kept
            match = STEP_FILE_RE.match(old.name.removesuffix(".sha256"))
            if match and int(match.group(1)) != step:
                old.unlink(missing_ok=True)

    @staticmethod
    def _read(folder: Path, step: int) -> bytes | None:
        path = folder / f"step-{step:08d}.pt"
        try:
            data = path.read_bytes()
            digest = (folder / f"{path.name}.sha256").read_text().strip()
        except OSError:
            return None
        return data if hashlib.sha256(data).hexdigest() == digest else None

    @staticmethod
    def _steps(folder: Path) -> list[int]:
        if not folder.is_dir():
            return []
        names = {p.name for p in folder.iterdir()}
        return sorted(int(m.group(1)) for n in names if (m := STEP_FILE_RE.match(n)) and f"{n}.sha256" in names)

    # ---- save -----------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, meta: dict[str, Any]) -> int:
        """Keep this rank's shard of `state` at `step` here and at the peer; returns the bytes kept here."""
        buffer = io.BytesIO()
        torch.save({"step": step, "meta": meta, "state": to_local_tree(state)}, buffer)
        data = buffer.getvalue()
        self._write(self._own(self.rank), step, data)
        if self.peer is not None and self.holds_for is not None:
            received = self._exchange(data)
            self._write(self._copy(self.holds_for), step, received)
        self.last_step = step
        return len(data)

    def _exchange(self, data: bytes) -> bytes:
        """Send my bytes to my peer, receive the bytes of the rank I hold a copy for (sizes first; one leading
        byte so that no message is empty)."""
        assert self.peer is not None and self.holds_for is not None
        payload = torch.frombuffer(bytearray(b"\x01" + data), dtype=torch.uint8)
        size_out, size_in = torch.tensor([payload.numel()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self._send_recv(size_out, size_in)
        incoming = torch.empty(int(size_in.item()), dtype=torch.uint8)
        self._send_recv(payload, incoming)
        return incoming.numpy().tobytes()[1:]

    def _send_recv(self, out: torch.Tensor, into: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, out, self._global(self.peer), group=self.group),
               dist.P2POp(dist.irecv, into, self._global(self.holds_for), group=self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def _global(self, group_rank: int | None) -> int:
        assert group_rank is not None
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # ---- restart ----------------------------------------------------------------------------------------
    def best_step(self) -> int | None:
        """The newest step every rank can restore (its own file, or the copy its peer holds); all ranks agree."""
        own = set(self._steps(self._own(self.rank)))
        held = set(self._steps(self._copy(self.holds_for))) if self.holds_for is not None else set()
        reports = self._gather((sorted(own), sorted(held)))
        usable: set[int] | None = None
        for rank, (mine, _) in enumerate(reports):
            at_peer = set()
            if self.peer is not None:
                holder = (rank + (self.peer - self.rank)) % self.world_size
                at_peer = set(reports[holder][1])
            have = set(mine) | at_peer
            usable = have if usable is None else usable & have
        return max(usable) if usable else None

    def load(self, step: int, template: dict[str, Any], *, check: Callable[[dict], str | None] | None = None
             ) -> dict[str, Any] | None:
        """This rank's state at `step` filled into `template` (its own file, else the peer sends its copy back);
        None on every rank when any rank's copy is missing or damaged, or `check(meta)` refuses (raised)."""
        data = self._read(self._own(self.rank), step)
        need = self._gather(data is None)
        if self.peer is not None and any(need):
            data = self._restore_from_peer(step, data, need)
        ok = self._gather(data is not None)
        if not all(ok):
            return None
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)  # our own file, checksummed
        refusal = check(saved["meta"]) if check is not None else None
        if refusal:
            return {"refusal": refusal}
        return fill_tree(template, saved["state"])

    def _restore_from_peer(self, step: int, data: bytes | None, need: list[bool]) -> bytes | None:
        """Ranks that lost their own file get the copy back from the rank that holds it."""
        assert self.peer is not None and self.holds_for is not None
        outgoing = b""
        if need[self.holds_for]:
            outgoing = self._read(self._copy(self.holds_for), step) or b""
        incoming = self._swap_back(outgoing)
        if data is None and incoming:
            data = incoming
            self._write(self._own(self.rank), step, data)  # the replaced node has its copy again
        return data

    def _swap_back(self, outgoing: bytes) -> bytes:
        """The reverse of `_exchange`: the holder sends a copy back to its owner."""
        peer, holds_for = self.peer, self.holds_for
        self.peer, self.holds_for = holds_for, peer
        try:
            return self._exchange(outgoing)
        finally:
            self.peer, self.holds_for = peer, holds_for

    def _gather(self, value: Any) -> list[Any]:
        if self.world_size == 1 or not dist.is_initialized():
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out
