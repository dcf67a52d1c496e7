"""`parallelism.fsdp_single_rank`: one rank wrapped in FSDP2 over a 1-rank mesh computes what the plain model does.

The trainer starts the 1-rank process group itself (an in-process store outside torchrun; torchrun's rendezvous
under `leantrain launch --nproc 1`, the slow test) and every parameter becomes an FSDP2 DTensor; the fp32
losses and gradient norms equal the plain one-process run's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from leantrain.launch import torchrun
from leantrain.launch.resources import TrainCommand
from leantrain.parallel.dims import layout_for_run
from leantrain.spec import spec_from_dict
from leantrain.train.trainer import Trainer
from test_parallel_trainer import STEPS, job, records
from test_train_loop import make_data


def _train(raw: dict, run_dir: Path) -> list[dict]:
    trainer = Trainer(spec_from_dict(raw), run_dir=run_dir)
    try:
        trainer.train()
    finally:
        trainer.close()
    return records(run_dir / "metrics.jsonl")[0]


def test_one_rank_fsdp2_matches_the_plain_model(tmp_path: Path) -> None:
    data_dir = make_data(tmp_path / "data")
    plain = _train(job(data_dir), tmp_path / "plain")
    trainer = Trainer(spec_from_dict(job(data_dir, fsdp_single_rank=True, zero_stage=3)), run_dir=tmp_path / "fsdp")
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert trainer.dims.fsdp_single_rank and trainer.dims.world_size == 1 and trainer.parallel.fsdp
        assert isinstance(trainer.parallel.model, FSDPModule)
        params = list(trainer.parallel.parameters())
        assert params and all(isinstance(p, DTensor) and p.device_mesh.size() == 1 for p in params)
        trainer.train()
    finally:
        trainer.close()
    assert not dist.is_initialized()  # the group the trainer started is ended with it
    got = records(tmp_path / "fsdp" / "metrics.jsonl")[0]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in plain], abs=1e-5, rel=0)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-5)


def test_without_a_process_group_the_plain_model_runs_with_a_note(tmp_path: Path) -> None:
    spec = spec_from_dict(job(tmp_path / "data", fsdp_single_rank=True))
    assert not dist.is_initialized()
    _, dims = layout_for_run(spec, world_size=1)
    assert not dims.fsdp_single_rank and not dims.fsdp_enabled
    assert any("fsdp_single_rank" in note for note in dims.notes)


@pytest.mark.slow
def test_launch_nproc_1_wraps_the_one_rank_in_fsdp2(tmp_path: Path) -> None:
    """Through torchrun's command line (`leantrain launch --nproc 1`): its rendezvous, the same losses."""
    data_dir = make_data(tmp_path / "data")
    plain = _train(job(data_dir), tmp_path / "plain")
    raw = job(data_dir, fsdp_single_rank=True)
    spec_path = tmp_path / "fsdp.yaml"
    spec_path.write_text(yaml.safe_dump(raw))
    argv = torchrun.torchrun_argv(spec_from_dict(raw), train=TrainCommand(spec_path=spec_path),
                                  run_dir=tmp_path / "fsdp", nproc=1, max_restarts=0)
    proc = subprocess.run(argv, env=torchrun.torchrun_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = records(tmp_path / "fsdp" / "metrics.jsonl")[0]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in plain], abs=1e-5, rel=0)
    info = json.loads((tmp_path / "fsdp" / "train_info.json").read_text())
    assert info["data_parallel"] == 1 and info["layout"].endswith("= 1 (FSDP2 on one rank)")
