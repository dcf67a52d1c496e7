"""The fast checkpoint tier: every `checkpoint.memory_interval_steps` steps each rank keeps its own shard of the
state on node-local storage (`checkpoint.memory_dir`, tmpfs by default: host memory) and a copy on a peer rank
`checkpoint.memory_peer_offset` ranks on (by default one node on: the same shard of the next node's ranks),
besides the durable tier on the store every `interval_steps`.

Layout, per run and parallel layout (`<memory_dir>/<run id>/layout-<hash>/`): `rank-R/step-S.pt` (R's own shard) and
`peer-of-R/step-S.pt` (the copy R sent to the rank that holds it), each with a `.sha256` sidecar written after it,
so a file without its sidecar is never trusted. The format is ckpt/memory_format.py: a JSON header and raw tensor
bytes, never a pickle, so nothing a peer sends can run code here.

A save, on every rank together (the hook decides to save from the step number and agreed flags only, never
from state a background thread writes): the previous step's files go first (the node never holds two steps:
2 × shard per local rank), this rank's shard is written, the ranks agree that every write succeeded, then
each rank sends its shard to its peer (its sha256 and sizes first, then the bytes straight from the
tensors) and checks what it received against the sender's hash before keeping it, and the ranks agree again.
Any failure (ENOSPC on tmpfs, a bad transfer) is caught, agreed (every rank learns which ranks failed), and
returned as a failed `SaveOutcome`: that step is not a fast checkpoint anywhere and the job goes on with the
durable tier. Agreements are tensors (all_gather of flags and steps), never pickled objects.

An exception inside one of the tier's collectives (a peer gone, a timeout) never turns the tier off on that rank
alone: its peers would enter the next save's collectives without it and wait out the group's timeout. The rank
marks itself broken, still joins the rest of that save's collectives (so no peer waits for it), and reports
BROKEN in the next save's first agreement, which every rank makes before any other collective of that save:
every rank sees it and the tier stops everywhere at that save, logged once by rank 0 naming the ranks. Only a
rank whose first agreement itself fails stops there, naming itself: the group is unusable (gloo closes the
connections of a collective that timed out, so every rank's next agreement fails too), or, not seen, the
agreement completed on its peers, whose next collective on the group then fails within its timeout.

Restart (same world size and layout): the ranks agree on the newest step every rank can restore, its own file
or the copy its peer holds; a rank that lost its own (a replaced node) gets it back from the peer, checked
against the hash the holder announces. Another world size or layout uses the durable tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from leantrain.ckpt.errors import one_line
from leantrain.ckpt.memory_format import (
    MAGIC,
    Encoded,
    decode,
    encode,
    fill_tree,
    read_verified,
    tree_mismatch,
    write_chunks,
)
from leantrain.plan.budget import FAST_TIER_COPIES

log = logging.getLogger("leantrain.ckpt")
STEP_FILE_RE = re.compile(r"^step-(\d{8})\.pt$")
FILES_PER_SHARD = FAST_TIER_COPIES  # its own shard and the copy it holds for a peer (the plan counts the same)
OK, FAILED, BROKEN = 0, 1, 2  # what a rank reports in a save's first agreement (BROKEN: a collective failed on it)
COLLECTIVE_ERRORS = (RuntimeError, dist.DistBackendError)  # what a failed or timed-out collective raises


def memory_root(memory_dir: Path, run_dir: Path, *, layout: str | None = None) -> Path:
    """This run's folder in the node-local memory dir: the same across restarts, another for another run dir;
    with `layout` (the world size and the parallel layout), the folder of that layout inside it. A rank's shard
    is its piece of the state in one layout only: an elastic job re-formed at another size, or the run started
    again on another layout, must not see it (copied into other shapes it crashed every restart, or broadcast
    into a larger tensor without a word)."""
    resolved = str(Path(run_dir).resolve())
    root = Path(memory_dir) / f"{Path(resolved).name}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}"
    return root if layout is None else root / f"layout-{hashlib.sha256(layout.encode()).hexdigest()[:12]}"


def forget_other_layouts(root: Path) -> None:
    """Remove the snapshots of the run's other layouts on this node (`root` is this layout's folder): they can
    never be loaded, and they hold the node's memory. Local ranks may race here; what one removes the others skip."""
    if root.parent.is_dir():
        for other in root.parent.iterdir():
            if other != root and other.name.startswith("layout-"):
                shutil.rmtree(other, ignore_errors=True)


def estimate_shard_bytes(model: torch.nn.Module, *, optimizer_bytes_per_param: int = 8) -> int:
    """This rank's fast-tier shard before the first step (the optimizer's state does not exist yet): its local
    parameters plus AdamW's two fp32 moments per trainable local element (an over-estimate for 8-bit states).
    Frozen parameters (a LoRA run's base) are not counted: the state dict leaves them out (ckpt/dcp_io.py)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * (local.element_size() + optimizer_bytes_per_param)
    return total


def capacity_problem(memory_dir: Path, *, shard_bytes: int, local_ranks: int) -> str | None:
    """Why `memory_dir` cannot hold this node's fast tier (FILES_PER_SHARD × shard × local ranks), or None."""
    need = FILES_PER_SHARD * shard_bytes * local_ranks
    probe = Path(memory_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as err:
        return f"checkpoint.memory_dir {memory_dir}: cannot read its free space ({err.strerror or err})"
    if need > free:
        return (f"checkpoint.memory_dir {memory_dir} has {free / 2**30:.1f} GiB free, and the fast tier needs "
                f"{need / 2**30:.1f} GiB on this node ({FILES_PER_SHARD} × {shard_bytes / 2**30:.2f} GiB shard × "
                f"{local_ranks} local ranks)")
    return None


@dataclass
class SaveOutcome:
    """What one fast-tier save did, the same on every rank (the failure flags are agreed), except after a
    collective that failed on some ranks only: those report a failed step, and the next save stops the tier."""

    step: int
    num_bytes: int = 0
    failed_ranks: list[int] = field(default_factory=list)
    error: str | None = None  # this rank's own failure, or the stage the ranks failed at

    @property
    def ok(self) -> bool:
        return not self.failed_ranks and self.error is None


class MemoryTier:
    """One rank's fast tier (see the module docstring). All ranks call `save` and `best_step`/`load` together."""

    def __init__(self, *, root: Path, rank: int, world_size: int, peer_offset: int,
                 process_group: dist.ProcessGroup | None) -> None:
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.group = process_group
        self.offset = peer_offset % world_size if world_size > 1 else 0
        self.peer = (rank + self.offset) % world_size if self.offset else None  # who holds my copy
        self.holds_for = (rank - self.offset) % world_size if self.offset else None  # whose copy I hold
        self.last_step: int | None = None
        self.disabled: str | None = None  # why the tier stopped (agreed by every rank; see the module docstring)
        self.broken: str | None = None  # a collective of the tier failed on this rank: reported at the next save

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
        for folder in self.node_folders():
            shutil.rmtree(folder, ignore_errors=True)
        for folder in (self.root, self.root.parent) if self.root.name.startswith("layout-") else (self.root,):
            with contextlib.suppress(OSError):  # another local rank's files may still be there
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()

    @staticmethod
    def _path(folder: Path, step: int) -> Path:
        return folder / f"step-{step:08d}.pt"

    def _write(self, folder: Path, step: int, chunks: Any) -> str:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self._path(folder, step)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            digest = write_chunks(fh, chunks)
        os.replace(tmp, path)
        (folder / f"{path.name}.sha256").write_text(digest)
        return digest

    @staticmethod
    def _forget(folder: Path, *, keep: int | None = None) -> None:
        if not folder.is_dir():
            return
        for old in folder.iterdir():
            match = STEP_FILE_RE.match(old.name.removesuffix(".sha256").removesuffix(".tmp") + (
                ".pt" if old.name.endswith(".tmp") else ""))
            if match and int(match.group(1)) != keep:
                old.unlink(missing_ok=True)

    def _read(self, folder: Path, step: int) -> tuple[bytearray, str] | None:
        path = self._path(folder, step)
        try:
            digest = (folder / f"{path.name}.sha256").read_text().strip()
        except OSError:
            return None
        buffer = read_verified(path, digest)
        return None if buffer is None else (buffer, digest)

    @staticmethod
    def _steps(folder: Path) -> list[int]:
        if not folder.is_dir():
            return []
        names = {p.name for p in folder.iterdir()}
        return sorted(int(m.group(1)) for n in names if (m := STEP_FILE_RE.match(n)) and f"{n}.sha256" in names)

    # ---- save -----------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, meta: dict[str, Any]) -> SaveOutcome:
        """Keep this rank's shard of `state` at `step` here and at the peer (see the module docstring)."""
        if self.disabled:
            return SaveOutcome(step=step, error=self.disabled)
        outcome = SaveOutcome(step=step)
        self._save_agreed(step, state, meta=meta, outcome=outcome)
        if not outcome.ok:
            for folder in self.node_folders():
                self._forget(folder)  # a step that is not complete everywhere is no fast checkpoint
        else:
            self.last_step = step
        return outcome

    def _save_agreed(self, step: int, state: dict[str, Any], *, meta: dict[str, Any], outcome: SaveOutcome) -> None:
        error = None
        encoded = None
        if self.broken is None:  # a broken rank writes nothing: this save only tells the others to stop
            try:
                encoded = encode(step=step, meta=meta, state=state)
                for folder in self.node_folders():
                    self._forget(folder)  # never two steps in memory at once
                encoded.sha256 = self._write(self._own(self.rank), step, encoded.chunks())  # hashed once, as written
                outcome.num_bytes = encoded.num_bytes
            except (OSError, TypeError, ValueError, RuntimeError) as err:  # local: no collective has run yet
                error = f"rank {self.rank}: writing {self._own(self.rank)}: {one_line(err)}"
        if not self._first_agreement(step, error, outcome):
            return
        if outcome.failed_ranks or self.peer is None or self.holds_for is None:
            outcome.error = error or (f"writing the shards failed on rank(s) {outcome.failed_ranks}"
                                      if outcome.failed_ranks else None)
            return
        assert encoded is not None
        error = None
        try:
            received = self._exchange(encoded, to=self.peer, source=self.holds_for)
            if received is None:
                raise ValueError(f"the copy from rank {self.holds_for} does not match the sha256 it sent")
            self._write(self._copy(self.holds_for), step, iter([received]))
        except (OSError, ValueError) as err:
            error = f"rank {self.rank}: keeping rank {self.holds_for}'s copy: {one_line(err)}"
        except COLLECTIVE_ERRORS as err:  # still joins the agreement below: no peer waits there for this rank
            error = self._break(step, "the peer transfer", err)
        try:
            outcome.failed_ranks = self.agree_failures(error, logged=self.broken is not None)
        except COLLECTIVE_ERRORS as err:
            error = self._break(step, "the agreement after the peer transfer", err)
            outcome.failed_ranks = [self.rank]
        if outcome.failed_ranks:
            outcome.error = error or f"the peer copy failed on rank(s) {outcome.failed_ranks}"

    def _first_agreement(self, step: int, error: str | None, outcome: SaveOutcome) -> bool:
        """The save's first collective: every rank's OK/FAILED/BROKEN. Whether the save goes on; when a rank is
        BROKEN the tier stops here on every rank, before any other collective of the save."""
        if error is not None:
            log.error("fast tier: %s", error)
        try:
            reports = [status for (status,) in self._all_gather(
                [BROKEN if self.broken is not None else FAILED if error is not None else OK])]
        except COLLECTIVE_ERRORS as err:  # nothing can be agreed on this group any more: this rank stops
            self.disabled = (f"the fast tier stopped on rank {self.rank} at step {step}: its agreement collective "
                             f"failed ({one_line(err)})" + (f", after {self.broken}" if self.broken else ""))
            log.error("fast tier: %s; this rank goes on with the durable tier only", self.disabled)
            outcome.failed_ranks, outcome.error = [self.rank], self.disabled
            return False
        broken = [rank for rank, status in enumerate(reports) if status == BROKEN]
        if broken:
            names = f"rank {broken[0]}" if len(broken) == 1 else f"ranks {', '.join(map(str, broken))}"
            self.disabled = (f"the fast tier stopped on every rank at step {step}: a collective of the tier failed "
                             f"on {names} (the error is in that rank's log)")
            if self.rank == 0:
                log.warning("fast tier: %s; the job goes on with the durable tier only", self.disabled)
            outcome.failed_ranks, outcome.error = broken, self.disabled
            return False
        outcome.failed_ranks = [rank for rank, status in enumerate(reports) if status != OK]
        return True

    def _break(self, step: int, stage: str, err: BaseException) -> str:
        """This rank saw a collective fail: it reports BROKEN at the next save's first agreement."""
        error = f"rank {self.rank}: {stage} at step {step} failed: {one_line(err)}"
        log.error("fast tier: %s; the tier stops on every rank at the next save", error)
        self.broken = self.broken or error
        return error

    def _exchange(self, outgoing: Encoded | None, *, to: int, source: int) -> bytearray | None:
        """Send `outgoing` to `to` and receive `source`'s stream: its sha256 and sizes first, then the header and
        the tensors' bytes (no copy on the sending side). The received stream when it matches the hash the
        sender announced; None when it does not; an empty bytearray when the sender had nothing."""
        views = [] if outgoing is None else [v for v in outgoing.views if v.numel()]
        digest = bytes.fromhex(outgoing.digest()) if outgoing is not None else bytes(32)
        prefix = b"" if outgoing is None else outgoing.prefix
        sizes_out = torch.tensor([len(prefix), len(views), *[v.numel() for v in views]], dtype=torch.int64)
        count_out = torch.tensor([sizes_out.numel()], dtype=torch.int64)
        count_in = torch.zeros(1, dtype=torch.int64)
        self._send_recv([count_out], [count_in], to=to, source=source)
        sizes_in = torch.zeros(int(count_in.item()), dtype=torch.int64)
        digest_in = torch.zeros(32, dtype=torch.uint8)
        self._send_recv([sizes_out, torch.frombuffer(bytearray(digest), dtype=torch.uint8)], [sizes_in, digest_in],
                        to=to, source=source)
        prefix_len, num_views = int(sizes_in[0]), int(sizes_in[1])
        buffer = bytearray(int(sizes_in[0] + sizes_in[2:].sum()))
        if not buffer:
            received: list[torch.Tensor] = []
        else:
            whole = torch.frombuffer(buffer, dtype=torch.uint8)
            received = [whole[:prefix_len]]
            offset = prefix_len
            for size in sizes_in[2: 2 + num_views].tolist():
                received.append(whole[offset: offset + size])
                offset += size
        sent = ([torch.frombuffer(bytearray(prefix), dtype=torch.uint8)] if prefix else []) + views
        self._send_recv(sent, received, to=to, source=source)
        if not buffer:
            return bytearray()
        ok = hashlib.sha256(buffer).digest() == bytes(digest_in.tolist()) and bytes(buffer[:len(MAGIC)]) == MAGIC
        return buffer if ok else None

    def _send_recv(self, out: list[torch.Tensor], into: list[torch.Tensor], *, to: int, source: int) -> None:
        # One tag per message: the i-th non-empty send meets the peer's i-th non-empty receive.
        sends, recvs = [t for t in out if t.numel()], [t for t in into if t.numel()]
        ops = [dist.P2POp(dist.isend, t, self._global(to), group=self.group, tag=i) for i, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, self._global(source), group=self.group, tag=i)
                for i, t in enumerate(recvs)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # ---- agreement (tensors, never pickles) ------------------------------------------------------------
    def _all_gather(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        if self.world_size == 1 or not dist.is_initialized():
            return [mine.tolist()]
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def agree_failures(self, error: str | None, *, logged: bool = False) -> list[int]:
        """The ranks whose step failed (every rank gets the same list); this rank's error goes to its log."""
        if error is not None and not logged:
            log.error("fast tier: %s", error)
        return [r for r, (flag,) in enumerate(self._all_gather([int(error is not None)])) if flag]

    # ---- restart ----------------------------------------------------------------------------------------
    def best_step(self) -> int | None:
        """The newest step every rank can restore (its own file, or the copy its peer holds); all ranks agree."""
        own = self._steps(self._own(self.rank))
        held = self._steps(self._copy(self.holds_for)) if self.holds_for is not None else []
        reports = self._all_gather([own[-1] if own else -1, held[-1] if held else -1])
        usable: set[int] | None = None
        for rank, (mine, _) in enumerate(reports):
            have = {mine}
            if self.offset:
                have.add(reports[(rank + self.offset) % self.world_size][1])
            have.discard(-1)
            usable = have if usable is None else usable & have
        return max(usable) if usable else None

    def load(self, step: int, template: dict[str, Any], *, check: Callable[[dict], str | None] | None = None
             ) -> dict[str, Any] | None:
        """This rank's state at `step` filled into `template` (its own file, else the peer sends its copy back);
        None on every rank when any rank's copy is missing or damaged; {"refusal": ...} when `check(meta)`
        refuses."""
        found = self._read(self._own(self.rank), step)
        need = [bool(flag) for (flag,) in self._all_gather([int(found is None)])]
        buffer = None if found is None else found[0]
        if self.peer is not None and self.holds_for is not None and any(need):
            buffer = self._restore_from_peer(step, buffer, need)
        decoded, problem = None, "no usable shard"
        if buffer is not None:
            try:
                decoded = decode(buffer)
                problem = tree_mismatch(template, decoded.state)  # a shard of another layout: never filled in
            except (ValueError, KeyError, TypeError, struct.error) as err:
                log.error("fast tier: rank %d: %s is unreadable: %s", self.rank, self._own(self.rank), err)
            if problem is not None and decoded is not None:
                log.error("fast tier: rank %d: step %d does not fit this layout: %s", self.rank, step, problem)
        if self.agree_failures(problem):
            return None
        assert decoded is not None
        refusal = check(decoded.meta) if check is not None else None
        if refusal:
            return {"refusal": refusal}
        return fill_tree(template, decoded.state)

    def _restore_from_peer(self, step: int, buffer: bytearray | None, need: list[bool]) -> bytearray | None:
        """Ranks that lost their own file get the copy back from the rank that holds it (checked by its hash)."""
        assert self.peer is not None and self.holds_for is not None
        outgoing = None
        if need[self.holds_for]:
            held = self._read(self._copy(self.holds_for), step)
            if held is not None:
                outgoing = _RawStream(held[0])
        incoming = self._exchange(outgoing, to=self.holds_for, source=self.peer)
        if buffer is None and incoming:
            buffer = incoming
            self._write(self._own(self.rank), step, iter([incoming]))  # the replaced node has its copy again
        return buffer


class _RawStream(Encoded):
    """A stream already in memory (a held copy, header included) sent back unchanged."""

    def __init__(self, data: bytearray) -> None:
        super().__init__(header=b"", views=[torch.frombuffer(data, dtype=torch.uint8)] if data else [])
        self._data = data

    @property
    def prefix(self) -> bytes:
        return b""

    def digest(self) -> str:
        return hashlib.sha256(self._data).hexdigest()
