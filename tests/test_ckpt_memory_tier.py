"""The fast (in-memory) checkpoint tier: a round trip into the live objects, only the newest step kept, damage
never trusted, no pickle, sizing against memory_dir, and on two gloo ranks the peer copy checked against the
sender's hash, a failure agreed by every rank (the job goes on), and a lost shard restored from its peer."""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from leantrain.ckpt.dcp_io import apply_state_dict, build_state_dict
from leantrain.ckpt.memory_format import MAGIC
from leantrain.ckpt.memory_tier import MemoryTier, capacity_problem, estimate_shard_bytes, memory_root
from parallel_harness import spawn_gloo
from test_ckpt_manager import assert_same, make_app, snapshot, train


def test_round_trip_newest_only_and_damage_detected(tmp_path: Path) -> None:
    root = memory_root(tmp_path / "shm", tmp_path / "run")
    assert root == memory_root(tmp_path / "shm", tmp_path / "other" / ".." / "run")  # one run, one folder
    tier = MemoryTier(root=root, rank=0, world_size=1, peer_offset=1, process_group=None)
    assert tier.peer is None  # one rank: no peer to copy to
    app = make_app()
    train(app, 2)
    assert tier.save(2, build_state_dict(app), meta={"schedule": {"max_steps": 10}}).ok
    train(app, 1)
    outcome = tier.save(3, build_state_dict(app), meta={"schedule": {"max_steps": 10}})
    assert outcome.ok and outcome.num_bytes > 0
    expected = snapshot(app)
    assert sorted(p.name for p in (root / "rank-0").iterdir()) == ["step-00000003.pt", "step-00000003.pt.sha256"]
    assert (root / "rank-0" / "step-00000003.pt").read_bytes().startswith(MAGIC)  # JSON + raw bytes, no pickle

    fresh = make_app(seed=9)
    again = MemoryTier(root=root, rank=0, world_size=1, peer_offset=1, process_group=None)
    assert again.best_step() == 3
    filled = again.load(3, build_state_dict(fresh))
    assert filled is not None
    apply_state_dict(fresh, filled)
    assert_same(snapshot(fresh), expected)
    assert again.load(3, build_state_dict(fresh), check=lambda meta: f"changed {meta['schedule']}") == {
        "refusal": "changed {'max_steps': 10}"}

    path = root / "rank-0" / "step-00000003.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert again.load(3, build_state_dict(make_app(seed=1))) is None  # checksum mismatch: not trusted
    (root / "rank-0" / "step-00000003.pt.sha256").unlink()
    assert again.best_step() is None  # a file without its checksum is no checkpoint
    again.clear()
    assert not root.exists()
    assert torch.equal(snapshot(fresh)["params"][0], expected["params"][0])


def test_a_pickle_is_never_loaded_even_with_a_matching_hash(tmp_path: Path) -> None:
    import hashlib

    root = tmp_path / "shm" / "run"
    folder = root / "rank-0"
    folder.mkdir(parents=True)
    payload = pickle.dumps({"step": 1, "meta": {}, "state": {}})
    (folder / "step-00000001.pt").write_bytes(payload)
    (folder / "step-00000001.pt.sha256").write_text(hashlib.sha256(payload).hexdigest())
    tier = MemoryTier(root=root, rank=0, world_size=1, peer_offset=1, process_group=None)
    assert tier.best_step() == 1
    assert tier.load(1, build_state_dict(make_app())) is None


def test_a_failed_write_is_an_outcome_not_an_exception(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    tier = MemoryTier(root=blocked / "run", rank=0, world_size=1, peer_offset=1, process_group=None)
    outcome = tier.save(2, build_state_dict(make_app()), meta={})
    assert not outcome.ok and outcome.failed_ranks == [0] and "rank 0: writing" in (outcome.error or "")


def test_sizing_counts_own_and_peer_copies_of_every_local_rank(tmp_path: Path) -> None:
    app = make_app()
    shard = estimate_shard_bytes(app["model"])
    num_params = sum(p.numel() for p in app["model"].parameters())
    assert shard == num_params * (4 + 8)  # fp32 weights + AdamW's two fp32 moments
    first = next(app["model"].parameters())
    first.requires_grad_(False)  # a frozen (LoRA base) weight is not in the state the tier keeps
    assert estimate_shard_bytes(app["model"]) == (num_params - first.numel()) * (4 + 8)
    assert capacity_problem(tmp_path, shard_bytes=shard, local_ranks=8) is None
    problem = capacity_problem(tmp_path / "not" / "yet", shard_bytes=2**50, local_ranks=8)
    assert problem is not None and "needs" in problem and "2 × " in problem and "8 local ranks" in problem


def _two_ranks(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    tier = MemoryTier(root=Path(root) / f"node-{rank}", rank=rank, world_size=2, peer_offset=1, process_group=group)
    app = make_app(seed=rank)
    train(app, 2)
    saved = tier.save(2, build_state_dict(app), meta={"schedule": {"max_steps": 4}})
    expected = snapshot(app)["params"]
    # A damaged transfer: rank 1's payload arrives with one byte changed after it announced its sha256.
    original, calls = tier._send_recv, []
    if rank == 1:
        def corrupting(out: list[torch.Tensor], into: list[torch.Tensor], **kwargs: Any) -> None:
            calls.append(1)
            if len(calls) == 3 and out:  # the third round carries the bytes (sizes and hash went first)
                out = [out[0].clone(), *out[1:]]
                out[0][-1] ^= 1
            original(out, into, **kwargs)
        tier._send_recv = corrupting  # type: ignore[method-assign]
    bad = tier.save(3, build_state_dict(make_app(seed=5)), meta={})
    tier._send_recv = original  # type: ignore[method-assign]
    after_bad = {"best": tier.best_step()}
    good = tier.save(4, build_state_dict(app), meta={"schedule": {"max_steps": 4}})
    # Rank 1's node is replaced: its own shard is gone; rank 0 holds its copy and sends it back.
    if rank == 1:
        import shutil

        shutil.rmtree(tier._own(1))
    fresh = make_app(seed=7)
    again = MemoryTier(root=Path(root) / f"node-{rank}", rank=rank, world_size=2, peer_offset=1, process_group=group)
    best = again.best_step()
    filled = again.load(best, build_state_dict(fresh)) if best is not None else None
    restored = filled is not None
    if filled is not None:
        apply_state_dict(fresh, filled)
    same = all(torch.equal(a, b) for a, b in zip(snapshot(fresh)["params"], expected, strict=True))
    flags = torch.tensor([int(restored and same)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"saved_ok": saved.ok, "bad_ok": bad.ok, "bad_failed": bad.failed_ranks, "bad_error": bad.error,
            "after_bad": after_bad, "good_ok": good.ok, "best": best, "restored_everywhere": bool(flags.item()),
            "disabled": tier.disabled}


def test_two_ranks_peer_copy_checked_failure_agreed_lost_shard_restored(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = spawn_gloo(functools.partial(_two_ranks, str(tmp_path / "shm")), world_size=2, out_dir=tmp_path)
    assert result["saved_ok"] and result["good_ok"] and result["disabled"] is None
    assert not result["bad_ok"] and result["bad_failed"] == [0]  # rank 0 received the damaged copy: refused
    assert "does not match the sha256" in result["bad_error"]
    assert result["after_bad"] == {"best": None}  # the failed step is nowhere a fast checkpoint
    assert result["best"] == 4 and result["restored_everywhere"]


def test_a_cpu_shard_is_encoded_without_a_copy() -> None:
    """The written and sent bytes are views of the tensors' own memory (a CPU tensor gets no host copy; a device
    tensor gets one, in _byte_view), and the stream's hash is the one of header + those bytes."""
    import hashlib

    from leantrain.ckpt.memory_format import encode

    weight, moment = torch.randn(64, 32), torch.randn(64, 32).t()  # the second is not contiguous: one copy
    encoded = encode(step=3, meta={"m": 1}, state={"w": weight, "opt": {"exp_avg": moment}, "n": 5})
    views = [v for v in encoded.views if v.numel()]
    assert views[0].data_ptr() == weight.data_ptr() and views[0].numel() == weight.numel() * 4
    assert views[1].data_ptr() != moment.data_ptr()  # made contiguous (the module docstring says so)
    whole = hashlib.sha256(encoded.prefix + b"".join(v.numpy().tobytes() for v in views)).hexdigest()
    assert encoded.digest() == whole


def test_a_shard_of_another_layout_is_never_loaded(tmp_path: Path) -> None:
    """The fast tier kept no layout: a job re-formed at another world size (or started again on another layout
    on the same node) found its ranks' old `rank-R/step-S.pt` and copied them into other shapes: a traceback on
    every restart, or, where the shapes broadcast, wrong weights without a word. Each layout has its own folder
    (the others' are removed when a tier starts), and a shard whose shapes do not fit is refused on every rank."""
    from leantrain.ckpt.memory_format import encode
    from leantrain.ckpt.memory_tier import forget_other_layouts

    two = memory_root(tmp_path / "shm", tmp_path / "run", layout="dp 2")
    one = memory_root(tmp_path / "shm", tmp_path / "run", layout="dp 1")
    assert two != one and two.parent == one.parent == memory_root(tmp_path / "shm", tmp_path / "run")
    for rank in (0, 1):  # two ranks' FSDP shards of w[2, 3]: rank r holds row r
        old = MemoryTier(root=two, rank=rank, world_size=2, peer_offset=2, process_group=None)
        old._write(old._own(rank), 40, encode(step=40, meta={}, state={"w": torch.full((1, 3), rank + 1.0)}).chunks())
    # the same files read by one rank whose w is the whole [2, 3]: broadcast into it before, now refused
    stale = MemoryTier(root=two, rank=0, world_size=1, peer_offset=1, process_group=None)
    live = {"w": torch.zeros(2, 3)}
    assert stale.best_step() == 40 and stale.load(40, live) is None and torch.equal(live["w"], torch.zeros(2, 3))
    forget_other_layouts(one)  # the tier of the new layout starts: the old layout's snapshots go
    assert not two.exists() and MemoryTier(root=one, rank=0, world_size=1, peer_offset=1,
                                           process_group=None).best_step() is None
