"""`leantrain train` on the demo data that `leantrain prepare` writes: the loss falls, MoE stays balanced."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from leantrain.cli import main
from leantrain.data.layout import load_manifest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data_dir = tmp_path_factory.mktemp("demo") / "data"
    assert main(["prepare", str(EXAMPLES / "tiny-cpu.yaml"), "--out", str(data_dir)]) == 0
    return data_dir


def unigram_entropy_nats(data_dir: Path) -> float:
    """Entropy of the training tokens' unigram distribution: the loss of a model that ignores context."""
    manifest = load_manifest(data_dir)
    tokens = np.concatenate([np.fromfile(data_dir / s.path, dtype=manifest.dtype)
                             for s in manifest.shards if s.split == "train"])
    counts = np.bincount(tokens, minlength=manifest.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def train(spec: str, data_dir: Path, run_dir: Path, steps: int) -> list[dict[str, Any]]:
    argv = ["train", str(EXAMPLES / spec), "--set", f"data.dir={data_dir}", "--run-dir", str(run_dir),
            "--max-steps", str(steps)]
    assert main(argv) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_cpu_loss_falls_well_under_unigram_entropy(demo_data: Path, tmp_path: Path) -> None:
    records = train("tiny-cpu.yaml", demo_data, tmp_path / "run", 200)
    steps = [r for r in records if "loss" in r]
    entropy = unigram_entropy_nats(demo_data)
    assert steps[-1]["step"] == 200 and entropy > 4.0  # BPE-512 on the bundled corpus: about 5.4 nats
    threshold = 0.5 * entropy
    assert steps[-1]["loss"] < threshold, f"final loss {steps[-1]['loss']:.3f} ≥ {threshold:.3f}"
    assert set(steps[-1]["loss_by_source"]) == set(load_manifest(demo_data).source_names)
    evals = [r for r in records if "eval_loss" in r]
    assert evals and evals[-1]["eval_loss"] < threshold


def test_moe_example_trains_with_balanced_experts(demo_data: Path, tmp_path: Path) -> None:
    records = train("moe-small-cpu.yaml", demo_data, tmp_path / "run", 100)
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    # Expert load over the last quarter of training (5 log windows of equal token counts), per layer.
    last = [r for r in steps if r["step"] > 75]
    shares = np.mean([r["moe_expert_load"] for r in last], axis=0)  # (layers, experts)
    ratio = float((shares.max(axis=1) / shares.min(axis=1)).max())
    assert ratio < 2.0, shares


def test_missing_data_dir_is_a_user_error(tmp_path: Path) -> None:
    argv = ["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={tmp_path / 'nothing'}",
            "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2


def test_a_data_dir_and_a_run_dir_are_not_taken_for_each_other(demo_data: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`train`/`launch` into a dir `prepare` wrote, or `prepare` into a run dir, would mix the two dirs' files:
    each is exit 2 naming the option and the file that tells, before anything is written."""
    spec = str(EXAMPLES / "tiny-cpu.yaml")
    before = sorted(p.name for p in demo_data.iterdir())
    for argv, option in (
        (["train", spec, "--set", f"data.dir={demo_data}", "--run-dir", str(demo_data), "--max-steps", "1"],
         "--run-dir"),
        (["train", spec, "--set", f"data.dir={demo_data}", "--set", f"run.dir={demo_data}", "--max-steps", "1"],
         "run.dir"),
        (["launch", spec, "--nproc", "2", "--set", f"data.dir={demo_data}", "--run-dir", str(demo_data)],
         "--run-dir"),
    ):
        assert main(argv) == 2
        assert f"{option} {demo_data} holds prepared data (manifest.json)" in capsys.readouterr().err
    assert sorted(p.name for p in demo_data.iterdir()) == before
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "lineage.json").write_text("{}")
    assert main(["prepare", spec, "--out", str(run_dir)]) == 2
    assert f"--out {run_dir} is a training run's dir" in capsys.readouterr().err
    assert [p.name for p in run_dir.iterdir()] == ["lineage.json"]


def test_run_dir_describes_itself(demo_data: Path, tmp_path: Path) -> None:
    """What validate/report/doctor read besides metrics: spec, plan, lineage, rank events, audit, registry."""
    run_dir = tmp_path / "run"
    train("tiny-cpu.yaml", demo_data, run_dir, 3)
    for name in ("spec.yaml", "plan.json", "lineage.json", "audit.log", "events.jsonl"):
        assert (run_dir / name).is_file(), name
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e.get("kind") for e in events]
    assert kinds.count("start") == 1 and kinds.count("rank_joined") == 1
    assert all("time" in r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()))
    assert main(["runs"]) == 0


def _train_into_oom(demo_data: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """`leantrain train` whose first step runs out of memory; the run dir's events."""
    from leantrain.train.trainer import Trainer

    def oom(self: Trainer) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Trainer, "train_step", oom)
    with pytest.raises(torch.OutOfMemoryError):
        main(["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={demo_data}", "--run-dir", str(run_dir)])
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_out_of_memory_is_recorded_before_the_error(demo_data: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    events = _train_into_oom(demo_data, run_dir, monkeypatch)
    oom_events = [e for e in events if e.get("kind") == "oom"]
    assert oom_events and oom_events[0]["rank"] == 0 and "out of memory" in oom_events[0]["error"]
    assert oom_events[0]["attempt"] == 0 and (run_dir / "oom" / "rank-0-attempt-0.json").is_file()


def test_out_of_memory_records_the_jobs_agreed_attempt(demo_data: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """After a membership change (or a failure on another node) this node's restart count is lower than the job's
    agreed attempt: the OOM record and event carry the agreed one, as the hang records and restart events do."""
    import leantrain.train.command as command
    from leantrain.ckpt.attempt import JobAttempt

    monkeypatch.setattr(command, "job_attempt", lambda spec: JobAttempt(number=2, membership_change=True))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    run_dir = tmp_path / "run"
    events = _train_into_oom(demo_data, run_dir, monkeypatch)
    assert [e["attempt"] for e in events if e.get("kind") == "oom"] == [2]
    assert [p.name for p in (run_dir / "oom").iterdir()] == ["rank-0-attempt-2.json"]


def test_trainer_close_always_closes_metrics_and_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpointer whose close raises (a failed last save) must not leave the metrics or the process group
    open."""
    from types import SimpleNamespace

    import leantrain.train.trainer as trainer_module

    closed: list[str] = []

    def failing_close() -> None:
        raise RuntimeError("last save failed")

    monkeypatch.setattr(trainer_module, "close_runtime", lambda runtime: closed.append(f"runtime {runtime}"))
    fake = SimpleNamespace(checkpointer=SimpleNamespace(close=failing_close),
                           metrics=SimpleNamespace(close=lambda: closed.append("metrics")), runtime="rt")
    with pytest.raises(RuntimeError, match="last save failed"):
        trainer_module.Trainer.close(fake)  # type: ignore[arg-type]
    assert closed == ["metrics", "runtime rt"]


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_during_start_up_is_one_line_and_releases_the_lease(
        demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        signal_name: str) -> None:
    """A scheduler's SIGTERM while the model builds or loads (minutes at scale, before the checkpointer's own
    handler) used to end the process silently (exit -15) holding the run dir's lease; now: exit 128+signal with one
    line, the lease gone, the run marked interrupted, the process's handlers as they were, and a rerun trains."""
    import os
    import signal

    from leantrain.ckpt.lease import lease_path
    from leantrain.train.trainer import Trainer

    built = Trainer.__init__
    signum = int(getattr(signal, signal_name))

    def signalled(self: Trainer, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signum)  # arrives while the trainer is being built
        built(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", signalled)
    before = signal.getsignal(signum)
    run_dir = tmp_path / "run"
    args = ["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={demo_data}", "--run-dir", str(run_dir)]
    assert main(args) == 128 + signum
    err = capsys.readouterr().err
    assert f"stopped by {signal_name} during start-up" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    assert not lease_path(run_dir).exists() and signal.getsignal(signum) is before
    ends = [e["fields"] for e in map(json.loads, (run_dir / "audit.log").read_text().splitlines())
            if e["event"] == "command.end"]
    assert [e["status"] for e in ends] == ["interrupted"], ends
    monkeypatch.setattr(Trainer, "__init__", built)
    assert main(args + ["--max-steps", "2"]) == 0


BLOCKED_START = """
import socket, sys
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from leantrain.train.startup_signals import StartupSignals

signals = StartupSignals(grace_s=1.0)
signals.on_stuck = lambda: Path(sys.argv[1]).write_text("released")
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
print("waiting for the peer", flush=True)
# rank 1 never comes: the rendezvous blocks in C++, where a Python signal handler cannot run
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                        timeout=timedelta(seconds=120))
"""


def test_a_signal_while_start_up_is_blocked_in_cpp_still_ends_the_process(tmp_path: Path) -> None:
    """torchrun stops the survivors of a dead rank with SIGTERM; a survivor still starting waits in the rendezvous
    or a collective, in C++, and never runs a Python handler (before StartupSignals the default action ended it
    at once). The watcher thread ends it within the grace period: the lease released, one line, exit 143."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "lease-released"
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_START, str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting for the peer"
        time.sleep(1.0)  # inside init_process_group
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM during start-up" in err and "Traceback" not in err, err
    assert marker.read_text() == "released"


def test_a_registry_that_fails_at_the_end_does_not_fail_the_trained_run(
    demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run registry is an index beside the run: if it cannot be written when the run ends (locked past the
    timeout by another writer on a shared file system, made read-only), the trained run still exits 0 and its
    files stand; the failure is a warning naming the registry, not exit 2 after the whole run."""
    from leantrain.errors import UserInputError
    from leantrain.provenance import registry

    def locked(*args: Any, **kwargs: Any) -> None:
        raise UserInputError("run.registry /shared/runs.db: cannot be read (database is locked)")

    monkeypatch.setattr(registry, "set_run_status", locked)
    records = train("tiny-cpu.yaml", demo_data, tmp_path / "run", 2)
    assert [r["step"] for r in records if "loss" in r][-1] == 2
    (warning,) = [r.getMessage() for r in caplog.records if "run registry" in r.getMessage()]
    assert "as finished" in warning and "database is locked" in warning and str(tmp_path / "run") in warning


def test_a_held_out_index_one_rank_cannot_read_fails_that_rank_not_its_evaluation(
    demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Evaluation was turned off on a rank whose held-out index read failed (a stale view of a shared file
    system) while the other ranks evaluated and waited for it in their collectives. Whether a run evaluates comes
    from the manifest every rank shares; a read error on one rank is that rank's error, named."""
    from leantrain.data import sampler as sampler_module
    from leantrain.errors import UserInputError

    real = sampler_module.load_index

    def stale(data_dir: Path, *, split: str, **kwargs: Any) -> Any:
        if split == "valid":
            raise UserInputError(f"{data_dir}/index/valid: cannot be read (stale file handle)")
        return real(data_dir, split=split, **kwargs)

    monkeypatch.setattr(sampler_module, "load_index", stale)
    argv = ["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={demo_data}", "--run-dir",
            str(tmp_path / "run"), "--max-steps", "2"]
    assert main(argv) == 2
    assert "stale file handle" in capsys.readouterr().err
