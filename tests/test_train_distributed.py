"""`leantrain train` under torchrun: two ranks of plain data parallel match one process on the same batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leantrain.train.trainer import Trainer
from test_train_loop import make_data, tiny_spec


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    spec = tiny_spec(make_data(tmp_path / "data"), max_steps=3)
    single = [r["loss"] for r in Trainer(spec, run_dir=tmp_path / "single").train()]
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True)), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "leantrain.cli", "train", str(spec_file), "--run-dir", str(tmp_path / "dp")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    distributed = [r["loss"] for r in lines if "loss" in r]
    assert distributed == pytest.approx(single, rel=1e-5)  # same global batch, split over two ranks
    info = json.loads((tmp_path / "dp" / "train_info.json").read_text())
    assert info["world_size"] == 2 and info["accum_steps"] == 1
