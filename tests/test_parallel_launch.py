"""torchrun launch: the command line, refusing a bad layout before any rank starts, the dry run, the sweep."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from rich.console import Console

from leantrain.data.layout import write_token_data_dir
from leantrain.errors import UserInputError
from leantrain.launch import torchrun
from leantrain.launch.resources import TrainCommand
from leantrain.model.transformer import Transformer, model_args_from_spec, num_params
from leantrain.parallel.dryrun import dry_run
from leantrain.spec import load_spec
from parallel_harness import make_spec

VOCAB, SEQ = 64, 16


def write_job(tmp_path: Path, **parallelism: Any) -> Path:
    """A tiny spec file (and its token data dir) that `leantrain train` can run on 1 or 2 ranks."""
    rng = np.random.default_rng(0)
    docs = [[int((s + i) % (VOCAB - 1)) + 1 for i in range(40)] for s in rng.integers(0, VOCAB, 80)]
    write_token_data_dir(tmp_path / "data", {"easy": docs}, vocab_size=VOCAB, eos_id=0)
    raw = {
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "vocab_size": VOCAB,
                  "tie_embeddings": True},
        "parallelism": {"zero_stage": 0, **parallelism},
        "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": "data"},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 2, "warmup_steps": 1, "max_steps": 4,
                     "device": "cpu", "log_every": 1, "eval_every": 0},
        "checkpoint": {"interval_steps": 1000},
        "fault": {"max_restarts": 2},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "peak_flops": 1e11},
        "monitoring": {"tensorboard": False},
        "run": {"dir": "run"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_single_node_command_is_standalone_with_restarts_and_rank_logs(tmp_path: Path) -> None:
    spec = make_spec()
    argv = torchrun.torchrun_argv(spec, train=TrainCommand(spec_path=Path("job.yaml"), overrides=("a.b=1",)),
                                  run_dir=tmp_path, nproc=2, max_steps=5)
    assert argv[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in argv
    assert "--nproc-per-node=2" in argv and f"--max-restarts={spec.fault.max_restarts}" in argv
    assert f"--log-dir={tmp_path / 'logs' / socket.gethostname()}" in argv and "--redirects=3" in argv
    tail = argv[argv.index("leantrain.cli"):]
    assert tail == ["leantrain.cli", "train", "job.yaml", "--set", "a.b=1", "--run-dir", str(tmp_path),
                    "--max-steps", "5"]


def test_multi_node_command_uses_c10d_rendezvous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(torchrun.RDZV_ENV, "head:29400")
    argv = torchrun.torchrun_argv(make_spec(), train=TrainCommand(spec_path=Path("j.yaml")), run_dir=tmp_path,
                                  nproc=8, nnodes="2:4", max_restarts=7)
    assert {"--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--max-restarts=7"} <= set(argv)
    assert "--standalone" not in argv
    assert torchrun.torchrun_env()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize(
    ("parallelism", "nproc", "nnodes", "message"),
    [
        ({"tensor_parallel": 2}, 3, None, "parallelism.tensor_parallel (2) does not divide the world size (3"),
        ({"tensor_parallel": 2}, 1, "1:3", "parallelism.tensor_parallel (2) does not divide the world size (1"),
        ({"data_parallel": 2, "data_parallel_replicate": 2}, 3, None,
         "parallelism.data_parallel_replicate (2) does not divide data_parallel (3"),
    ],
)
def test_bad_layout_fails_before_torchrun_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallelism: dict[str, Any], nproc: int, nnodes: str | None,
    message: str,
) -> None:
    started: list[object] = []
    monkeypatch.setattr(torchrun, "run_torchrun", lambda *a, **k: started.append(a))
    spec = make_spec(**parallelism)
    with pytest.raises(UserInputError, match=re.escape(message)):
        torchrun.launch_local(spec, train=TrainCommand(spec_path=Path("j.yaml")), run_dir=tmp_path, nproc=nproc,
                              nnodes=nnodes, max_restarts=None, console=Console(quiet=True))
    assert not started and not (tmp_path / "logs").exists()


def test_dry_run_reports_every_rank_and_matches_the_plan() -> None:
    spec = make_spec(data_parallel=4)
    report = dry_run(spec, world_size=4)
    assert [r.rank for r in report.ranks] == [0, 1, 2, 3]
    full = num_params(Transformer(model_args_from_spec(spec.model, max_seq_len=SEQ)))
    assert report.total_params(full_model_params=full) == pytest.approx(1.0)  # FSDP: every weight once
    assert report.heaviest.optimizer_bytes == 2 * report.heaviest.params_bytes  # AdamW fp32: two moments
    assert report.heaviest.total_bytes == pytest.approx(report.plan["total"], rel=0.05)
    pipelined = dry_run(make_spec(data_parallel=2, pipeline_parallel=2), world_size=4)
    stage_params = {r.rank: r.num_params for r in pipelined.ranks}
    assert stage_params[0] == stage_params[1] and stage_params[0] != stage_params[2]  # ranks 2, 3: last stage


def test_sweep_arguments_and_inflection() -> None:
    assert torchrun.parse_sweep("nproc=4,1,2") == [1, 2, 4]
    with pytest.raises(UserInputError, match="nproc=N1,N2"):
        torchrun.parse_sweep("gpus=1,2")
    point = torchrun.SweepPoint
    points = [point(1, 100.0, 1.0, 1, 0, 0), point(2, 190.0, 0.95, 1, 0, 0), point(4, 200.0, 0.5, 1, 0, 0)]
    assert torchrun.stops_paying_at(points) == 4
    assert torchrun.stops_paying_at(points[:2]) is None


@pytest.mark.slow
def test_launch_two_ranks_writes_one_metrics_stream_and_sweeps(tmp_path: Path) -> None:
    spec_path = write_job(tmp_path)
    spec = load_spec(spec_path)
    train = TrainCommand(spec_path=spec_path)
    points = torchrun.scaling_sweep(spec, train=train, run_dir=tmp_path / "run", sizes=[1, 2], steps=4,
                                    console=Console(quiet=True), timeout_s=240)
    assert [p.nproc for p in points] == [1, 2] and all(p.exit_code == 0 for p in points), points
    assert points[0].efficiency == pytest.approx(1.0) and points[1].tokens_per_s
    two = tmp_path / "run" / "sweep" / "nproc-2"
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r and "tokens_per_s" in r]
    assert steps == [1, 2, 3, 4]  # one stream: rank 0 alone writes, each step once
    assert all("comm_s" in r for r in records if "tokens_per_s" in r)
    rank_dirs = {p.parent.name for p in torchrun.rank_logs(two) if p.name == "stdout.log"}
    assert rank_dirs == {"0", "1"}
    summary = json.loads((tmp_path / "run" / "sweep.json").read_text())
    assert [p["nproc"] for p in summary["points"]] == [1, 2]


def test_bf16_fully_sharded_model_state_matches_the_plan_exactly() -> None:
    """FSDP2 with bf16 compute keeps only the fp32 shards (the master copy): the plan counts the same."""
    report = dry_run(make_spec(data_parallel=4, compute="bf16"), world_size=4)
    heaviest = report.heaviest
    assert heaviest.params_bytes == pytest.approx(4 * heaviest.num_params)  # fp32 shard, no bf16 copy at rest
    assert heaviest.total_bytes == pytest.approx(report.plan["total"], rel=0.02)
