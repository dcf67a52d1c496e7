"""low_disk watches every folder a run writes to: the run dir, a local checkpoint.url elsewhere, staged data."""

from __future__ import annotations

import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest

import leantrain.observe.disk as disk
from leantrain.observe.alerts import AlertEngine, AlertRules, LowDiskRule
from leantrain.observe.disk import watched_dirs
from leantrain.spec import spec_from_dict

Usage = namedtuple("Usage", "total used free")
BASE = {"model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "vocab_size": 64},
        "data": {"tokens_total": 1e4, "seq_len": 8}}


def test_watched_dirs_include_a_checkpoint_location_elsewhere(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert watched_dirs(spec_from_dict(BASE), run_dir=run_dir) == [run_dir]
    spec = spec_from_dict({**BASE, "checkpoint": {"url": str(tmp_path / "fast-disk" / "ckpts")}})
    assert watched_dirs(spec, run_dir=run_dir) == [run_dir, tmp_path / "fast-disk" / "ckpts"]
    s3 = spec_from_dict({**BASE, "checkpoint": {"storage": "object_store", "url": "s3://b/p"}})
    assert watched_dirs(s3, run_dir=run_dir) == [run_dir]  # an object store has no local disk to fill


def test_low_disk_fires_for_the_checkpoint_disk_when_the_run_dir_is_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpts"
    run_dir.mkdir()
    ckpt_dir.mkdir()
    real = shutil.disk_usage

    def usage(path: Path) -> Usage:  # the checkpoint folder is on a nearly full disk
        if Path(path) == ckpt_dir:
            return Usage(total=100 * 2**30, used=99.5 * 2**30, free=0.5 * 2**30)
        return Usage(*real(path))

    monkeypatch.setattr(disk.shutil, "disk_usage", usage)
    rules = AlertRules(low_disk=LowDiskRule(min_free_bytes=2**30, min_free_fraction=0.0, check_every_s=1))
    engine = AlertEngine(rules=rules, disk_paths=[run_dir])
    engine.check_idle(time.time())
    assert "low_disk" not in engine.firing  # the run dir alone looks fine
    later = ckpt_dir / "not-created-yet"  # checked on the disk it will be created on (its parent's)
    engine = AlertEngine(rules=rules, disk_path=run_dir, disk_paths=[later])
    engine.check_idle(time.time())
    message = engine.firing["low_disk"].message
    assert str(later) in message and "0.5 GiB free" in message and f"at {run_dir} " not in message
