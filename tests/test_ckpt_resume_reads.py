"""What a resume reads, rank by rank (two gloo ranks, FSDP2): only rank 0 lists the store and opens the commit
marker, the manifest and DCP's `.metadata`; every shard file is opened at most once per rank and read whole by
exactly one rank (the one that checks its sha256 as it loads it); the state comes back bit for bit; a flipped bit
in a file another rank checks makes both ranks fall back together; DCP loads on the save group (its long
timeout), not on the agreement group."""

from __future__ import annotations

import functools
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed as dist

from leantrain.ckpt.storage import LocalStore


class _Counted:
    """A read stream that adds what it hands out to its store's tally."""

    def __init__(self, raw: IO[bytes], tally: list[int]) -> None:
        self._raw, self._tally = raw, tally

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._tally[0] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        count = self._raw.readinto(buffer)
        self._tally[0] += count or 0
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()


class CountingStore(LocalStore):
    """A local store that records every open (with the bytes read from it), listing and existence check."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.opened: list[tuple[str, list[int]]] = []
        self.looked: list[str] = []

    def open_read(self, rel: str) -> IO[bytes]:
        tally = [0]
        self.opened.append((rel, tally))
        return _Counted(super().open_read(rel), tally)  # type: ignore[return-value]

    def exists(self, rel: str) -> bool:
        self.looked.append(rel)
        return super().exists(rel)

    def list_dir(self, rel: str) -> list[str]:
        self.looked.append(rel or ".")
        return super().list_dir(rel)

    def reads(self) -> list[tuple[str, int]]:
        return [(rel, tally[0]) for rel, tally in self.opened]


def _resume_reads(root: str) -> dict[str, Any]:
    from leantrain.ckpt import CheckpointManager
    from leantrain.ckpt import manager as manager_module
    from test_ckpt_distributed import _app, _full_state, _train
    from test_ckpt_manager import make_spec

    rank, world_size = dist.get_rank(), dist.get_world_size()
    run = Path(root) / "run"
    timeouts: dict[Any, float] = {}
    new_group = manager_module.dist.new_group

    def recording_new_group(*args: Any, timeout: timedelta, **kwargs: Any) -> Any:
        group = new_group(*args, timeout=timeout, **kwargs)
        timeouts[group] = timeout.total_seconds()
        return group

    manager_module.dist.new_group = recording_new_group
    load_groups: list[Any] = []
    import leantrain.ckpt.dcp_io as dcp_io

    dcp_load = dcp_io.dcp.load
    dcp_io.dcp.load = lambda *a, **kw: (load_groups.append(kw["process_group"]), dcp_load(*a, **kw))[1]

    torch.manual_seed(100 + rank)
    spec = make_spec(checkpoint={"interval_steps": 2, "keep_last": 5})
    app = _app(rank, world_size, seed=0)
    ckpt = CheckpointManager(spec, run_dir=run, rank=rank, world_size=world_size)
    _train(app, 2)
    ckpt.save(2, app, blocking=True)
    at_2 = _copy(_full_state(app["model"], app["optimizer"]))  # the optimizer's `step` tensors are live ones
    _train(app, 2)
    ckpt.save(4, app, blocking=True)
    at_4 = _copy(_full_state(app["model"], app["optimizer"]))
    ckpt.close()

    def resume(seed: int) -> tuple[CheckpointManager, CountingStore, int | None, bool]:
        store = CountingStore(run / "checkpoints")
        manager = CheckpointManager(spec, run_dir=run, rank=rank, world_size=world_size, store=store)
        fresh = _app(rank, world_size, seed=seed)
        step = manager.load_latest(fresh)
        full = _full_state(fresh["model"], fresh["optimizer"])
        want = at_4 if step == 4 else at_2
        differ = [k for k, a, b in zip(_paths(full), _leaves(full), _leaves(want), strict=True)
                  if not torch.equal(a, b)]
        return manager, store, step, differ

    manager, store, step, differ = resume(seed=1)
    group_timeouts = {"load": timeouts.get(load_groups[-1]), "load_is_save_group": load_groups[-1] is manager._save_pg,
                      "control": timeouts.get(manager._control_pg)}
    manager.close()
    first = {"step": step, "differ": differ, "reads": store.reads(), "looked": store.looked}
    dist.barrier()
    if rank == 0:  # a flipped bit in a file rank 1 checks (the one it wrote)
        shard = run / "checkpoints" / "step-00000004" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x04
        shard.write_bytes(bytes(data))
    dist.barrier()
    manager, store, step, differ = resume(seed=2)
    manager.close()
    fallback = {"step": step, "differ": differ}
    sizes = {p.name: p.stat().st_size for p in (run / "checkpoints" / "step-00000004").iterdir()}
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, {"first": first, "fallback": fallback, "groups": group_timeouts})
    return {"ranks": out, "sizes": sizes}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value


def _paths(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, torch.Tensor):
        return [prefix]
    if isinstance(value, dict):
        return [p for key in sorted(value, key=str) for p in _paths(value[key], f"{prefix}.{key}")]
    return []


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=str) for leaf in _leaves(value[key])]
    return []


@pytest.mark.slow
def test_resume_reads_metadata_on_rank0_and_each_shard_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from parallel_harness import spawn_gloo

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = spawn_gloo(functools.partial(_resume_reads, str(tmp_path)), world_size=2, out_dir=tmp_path / "out")
    ranks, sizes = result["ranks"], result["sizes"]
    shards = sorted(name for name in sizes if name.endswith(".distcp"))
    assert len(shards) >= 2
    whole_by: dict[str, list[int]] = defaultdict(list)
    for rank, info in enumerate(ranks):
        first = info["first"]
        assert first["step"] == 4 and not first["differ"], f"rank {rank} did not resume step 4 bit for bit: {first}"
        names = [rel.rsplit("/", 1)[1] for rel, _ in first["reads"]]
        assert all(rel.startswith("step-00000004/") for rel, _ in first["reads"]), first["reads"]
        assert len(names) == len(set(names)), f"rank {rank} opened a file twice: {names}"
        for rel, num_bytes in first["reads"]:
            name = rel.rsplit("/", 1)[1]
            assert num_bytes <= sizes[name], f"rank {rank} read {num_bytes} bytes of {name} ({sizes[name]})"
            if num_bytes == sizes[name]:
                whole_by[name].append(rank)
        control = {"COMMIT", "manifest.json", ".metadata"}
        if rank == 0:
            assert control <= set(names) and first["looked"], "rank 0 reads the control files and lists the store"
        else:
            assert not control & set(names) and not first["looked"], f"rank {rank}: {names}, {first['looked']}"
        # A rank opens its own files, and another rank's only for replicated state (a slice).
        assert {f"__{rank}_0.distcp", f"__{rank}_1.distcp"} & set(names)
        fallback = info["fallback"]
        assert fallback["step"] == 2 and not fallback["differ"], f"rank {rank}: no bit-for-bit fallback: {fallback}"
        groups = info["groups"]
        assert groups["load_is_save_group"] and groups["load"] >= 1800 > groups["control"], groups
    for name in shards:  # every shard checked (read whole) by exactly one rank: the one that wrote it
        assert whole_by[name] == [int(name.split("_")[2])], (name, dict(whole_by))


def test_a_failed_check_is_a_user_facing_error_that_survives_dcps_pickling() -> None:
    """A failed check is a LeantrainError: where no resume catches it to fall back, the CLI prints one line and
    exits 2 (a traceback before). DCP's trip of a rank's failure to the others (pickled) keeps `permanent`,
    which decides whether a resume condemns the checkpoint."""
    import pickle

    from leantrain.ckpt.integrity import IntegrityError, KeyMismatchError
    from leantrain.errors import LeantrainError

    for err in (IntegrityError("step-00000004/__0_0.distcp: sha256 mismatch (corrupted)"),
                IntegrityError("step-00000004/__0_0.distcp: read failed: EIO", permanent=False),
                KeyMismatchError("step-00000004: encrypted with another key")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.permanent == err.permanent
        assert isinstance(back, LeantrainError) and back.exit_code == 2
