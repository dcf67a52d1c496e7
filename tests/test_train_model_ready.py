"""`leantrain launch SPEC --nproc 2 --max-steps 0` (torchrun, `leantrain train` per rank): a 2-rank ZeRO-3 build
that never holds the whole model.

The model is ~100M parameters (400 MB in fp32) so that a full copy on a rank would stand out clearly against
the process's own memory: each rank must grow by its half (200 MB) plus one parameter being generated, well
under one full copy. bench/RESULTS.md records the same check by hand for a ~0.75B model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_train_loop import make_data, tiny_spec


@pytest.mark.slow
def test_two_rank_zero3_build_holds_only_its_shard(tmp_path: Path) -> None:
    spec = tiny_spec(make_data(tmp_path / "data"))
    raw = spec.model_dump(mode="json", exclude_defaults=True)
    raw["model"] |= {"n_layers": 6, "d_model": 1024, "n_heads": 16, "n_kv_heads": 16, "ffn_hidden": 4096,
                     "tie_embeddings": False}
    raw["parallelism"] = {"zero_stage": 3}
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [sys.executable, "-m", "leantrain.cli", "launch", str(spec_file), "--nproc", "2",
               "--run-dir", str(tmp_path / "run"), "--max-steps", "0"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (ready,) = [e for e in events if e["kind"] == "model_ready"]
    total = ready["param_bytes_total"]
    assert total > 380e6 and ready["world_size"] == 2 and [r["rank"] for r in ready["ranks"]] == [0, 1]
    assert sum(r["param_bytes_local"] for r in ready["ranks"]) == total  # ZeRO-3: the shards partition the model
    for rank in ready["ranks"]:
        assert rank["param_bytes_local"] == pytest.approx(total / 2, rel=0.02)
        grown = rank["host_rss_peak_bytes"] - rank["host_rss_base_bytes"]
        # Its shard (half) plus one parameter being generated plus allocator slack; a full copy would be ≥ 1.5.
        assert 0.9 * rank["param_bytes_local"] < grown < 0.8 * total, f"rank {rank['rank']} grew {grown / 1e6:.0f} MB"
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or '"loss"' not in (
        tmp_path / "run" / "metrics.jsonl").read_text()


def test_the_start_records_are_gathered_on_rank_0_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model_ready and the ranks' join (hosts, base hashes) went through all_gather_object: every rank received
    every rank's entry, world² objects at start (16,384² at 16,384 ranks) for records only rank 0 writes."""
    import torch.distributed as dist

    from leantrain.train.model_ready import record_model_ready
    from leantrain.train.run_setup import record_ranks_joined

    calls: list[tuple[str, int, bool]] = []

    def gather_object(obj: object, object_gather_list: list | None = None, dst: int = 0, **_: object) -> None:
        calls.append(("gather_object", dst, object_gather_list is not None))
        if object_gather_list is not None:
            object_gather_list[:] = [obj, obj]

    def all_gather_object(*args: object, **kwargs: object) -> None:
        raise AssertionError("an all-gather of start records")

    monkeypatch.setattr(dist, "gather_object", gather_object)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    entry = {"rank": 1, "host_rss_peak_bytes": 1, "host_rss_base_bytes": 1, "device_mem_peak_bytes": 0,
             "param_bytes_local": 8}
    assert record_model_ready(tmp_path, entry=entry, world_size=2, distributed=True) is None
    record_ranks_joined(tmp_path, rank=1, world_size=2, distributed=True)
    assert calls == [("gather_object", 0, False), ("gather_object", 0, False)]
    assert record_model_ready(tmp_path, entry={**entry, "rank": 0}, world_size=2, distributed=True) is not None
    record_ranks_joined(tmp_path, rank=0, world_size=2, distributed=True)
    assert calls[2:] == [("gather_object", 0, True), ("gather_object", 0, True)]
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kinds == ["model_ready", "start", "rank_joined", "rank_joined"]
