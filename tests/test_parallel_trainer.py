"""The real Trainer under torchrun in each layout matches one process: same losses, gradient norms, held-out loss.

One process (this pytest process) is the ground truth; the layouts run `leantrain train` on 2 ranks through
`launch.torchrun`'s command line (fp32, fixed seed and data), started together so their start-up overlaps.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from leantrain.errors import UserInputError
from leantrain.launch import torchrun
from leantrain.launch.resources import TrainCommand
from leantrain.spec import spec_from_dict
from leantrain.spec.schema import JobSpec
from leantrain.train.trainer import Trainer
from test_train_loop import SEQ, VOCAB, make_data

STEPS = 6
# Per data-parallel rank (FSDP: 2 each) and a whole pipeline schedule (4 micro-batches): the same 4 samples in all.
EVAL_BATCHES = 4
LAYOUTS: dict[str, dict[str, Any]] = {
    "fsdp": {"zero_stage": 3},
    "tp": {"tensor_parallel": 2, "zero_stage": 3},
    "pp_1f1b": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "zero_stage": 3},
}  # EP and the compositions: tests/test_parallel_layouts.py (the same layer, without the trainer)


def job(data_dir: Path, *, eval_batches: int = EVAL_BATCHES, **parallelism: Any) -> dict[str, Any]:
    """A tiny fp32 job: 4 sequences per step in micro-batches of 1 (4 micro-steps on one rank, 2 on each of 2)."""
    return {
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "vocab_size": VOCAB,
                  "tie_embeddings": False},
        "parallelism": parallelism,
        "precision": {"compute": "fp32", "optimizer_state": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(data_dir)},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 1, "lr": 3e-3, "warmup_steps": 2,
                     "max_steps": STEPS, "device": "cpu", "log_every": 1, "eval_every": STEPS,
                     "eval_batches": eval_batches},
        "checkpoint": {"interval_steps": 1000},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
    }


def records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "grad_norm" in r], [r for r in lines if "eval_loss" in r]


@pytest.mark.slow
def test_trainer_layouts_match_one_process(tmp_path: Path) -> None:
    data_dir = make_data(tmp_path / "data")
    single = Trainer(spec_from_dict(job(data_dir)), run_dir=tmp_path / "single")
    try:
        single.train()
    finally:
        single.close()
    ref_steps, ref_eval = records(tmp_path / "single" / "metrics.jsonl")
    procs = {}
    for name, parallelism in LAYOUTS.items():
        raw = job(data_dir, eval_batches=EVAL_BATCHES // (2 if name == "fsdp" else 1), **parallelism)
        spec_path = tmp_path / f"{name}.yaml"
        spec_path.write_text(yaml.safe_dump(raw))
        argv = torchrun.torchrun_argv(spec_from_dict(raw),
                                      train=TrainCommand(spec_path=spec_path), run_dir=tmp_path / name, nproc=2,
                                      max_restarts=0)
        procs[name] = subprocess.Popen(argv, env=torchrun.torchrun_env() | {"OMP_NUM_THREADS": "1"},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    outputs = {name: proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-4000:]}"
        steps, evals = records(tmp_path / name / "metrics.jsonl")
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), name  # rank 0 alone writes, each step once
        got = [r["loss"] for r in steps]
        assert got == pytest.approx([r["loss"] for r in ref_steps], rel=1e-4), name
        assert [r["grad_norm"] for r in steps] == pytest.approx([r["grad_norm"] for r in ref_steps], rel=1e-4), name
        assert evals[-1]["eval_loss"] == pytest.approx(ref_eval[-1]["eval_loss"], rel=1e-4), name
        # measured, not a constant, in one logging window of monitoring.comm_profile_every (10): the first here
        assert 0 < steps[0]["comm_s"] < steps[0]["step_time_s"] * 2, name
        assert all(r["comm_s"] is None for r in steps[1:]), name  # STEPS < 10 windows
        # Memory: every rank's peak, and the heaviest one as mem_bytes.
        assert all(len(r["rank_mem_bytes"]) == 2 and r["mem_bytes"] == max(r["rank_mem_bytes"]) > 0
                   for r in steps), name
        for source, value in ref_steps[-1]["loss_by_source"].items():
            assert steps[-1]["loss_by_source"][source] == pytest.approx(value, rel=1e-4), (name, source)
        info = json.loads((tmp_path / name / "train_info.json").read_text())
        dp = 2 if name == "fsdp" else 1
        assert (info["data_parallel"], info["accum_steps"]) == (dp, 4 // dp), name  # dp, not the world size


def test_one_process_runs_every_axis_at_one(tmp_path: Path) -> None:
    data_dir = make_data(tmp_path / "data")
    spec: JobSpec = spec_from_dict(job(data_dir, tensor_parallel=2, zero_stage=3))
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    try:
        assert trainer.dims.world_size == 1 and trainer.parallel.mesh is None
        assert any("tensor_parallel 2 run at 1" in note for note in trainer.dims.notes)
        state = copy.deepcopy(trainer.state_dict())  # through get_state_dict (live tensors): single-process names
        assert "layers.0.attention.wq.weight" in state["model"]
        assert "layers.0.attention.wq.weight" in state["optimizer"]["param_groups"][0]["params"]
        before = trainer.model.layers["0"].attention.wq.weight.detach().clone()
        trainer.train_step()
        trainer.load_state_dict(state)
        assert torch.equal(trainer.model.layers["0"].attention.wq.weight, before) and trainer.step == 0
    finally:
        trainer.close()


def test_global_batch_must_split_over_data_parallel_ranks(tmp_path: Path) -> None:
    raw = job(tmp_path / "data", zero_stage=3)
    raw["training"]["global_batch_tokens"] = 3 * SEQ
    spec = spec_from_dict(raw)
    with pytest.raises(UserInputError, match=r"global_batch_tokens .* at 2 ranks"):
        torchrun.check_layout(spec, nproc=2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
