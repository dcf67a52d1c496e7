"""The fast (in-memory) checkpoint tier on one process: a round trip into the live objects, only the newest
step kept, a damaged file never trusted. The peer copy across ranks is tested under torchrun in
tests/test_resume_distributed.py (a lost node's shard restored from its peer)."""

from __future__ import annotations

from pathlib import Path

import torch

from leantrain.ckpt.dcp_io import apply_state_dict, build_state_dict
from leantrain.ckpt.memory_tier import MemoryTier, memory_root
from test_ckpt_manager import assert_same, make_app, snapshot, train


def test_round_trip_newest_only_and_damage_detected(tmp_path: Path) -> None:
    root = memory_root(tmp_path / "shm", tmp_path / "run")
    assert root == memory_root(tmp_path / "shm", tmp_path / "other" / ".." / "run")  # one run, one folder
    tier = MemoryTier(root=root, rank=0, world_size=1, peer_offset=1, process_group=None)
    assert tier.peer is None  # one rank: no peer to copy to
    app = make_app()
    train(app, 2)
    tier.save(2, build_state_dict(app), meta={"schedule": {"max_steps": 10}})
    train(app, 1)
    tier.save(3, build_state_dict(app), meta={"schedule": {"max_steps": 10}})
    expected = snapshot(app)
    assert sorted(p.name for p in (root / "rank-0").iterdir()) == ["step-00000003.pt", "step-00000003.pt.sha256"]

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
