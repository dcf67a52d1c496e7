"""The run-dir lease: one writer per run dir; a second train/launch exits 2 naming the holder; stale takeover."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leantrain.ckpt.attempt import JobAttempt
from leantrain.ckpt.lease import (
    JOB_ENV,
    LEASE_ENV,
    LEASE_FILE,
    RESTART_ENV,
    acquire_lease,
    inherit_env,
    read_lease,
)
from leantrain.cli import main
from leantrain.errors import UserInputError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HOLDER = """
import sys, time
from leantrain.ckpt.lease import acquire_lease
lease = acquire_lease(sys.argv[1], command="train")
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """Another process on this host holding RUN_DIR's lease."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    proc.kill()
    proc.wait()


def _write_record(run_dir: Path, *, age_s: float, **fields: object) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": "other-host", "pid": 1, "start_time": "2026-01-01T00:00:00Z", "command": "train",
              "token": "t0", **fields}
    path = run_dir / LEASE_FILE
    path.write_text(json.dumps(record))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_live_holder_refuses_a_second_writer_then_a_dead_one_is_taken_over(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    run_dir, proc = holder
    with pytest.raises(UserInputError) as refused:
        acquire_lease(run_dir, command="train")
    message = str(refused.value)
    assert f"host {socket.gethostname()} pid {proc.pid}" in message and "leantrain train" in message
    assert str(run_dir / LEASE_FILE) in message
    proc.send_signal(signal.SIGKILL)  # dies without releasing
    proc.wait()
    lease = acquire_lease(run_dir, command="train")
    assert lease.took_over is not None and f"process {proc.pid} on this host has exited" in lease.took_over
    assert read_lease(run_dir)["pid"] == os.getpid()
    lease.release()
    assert not (run_dir / LEASE_FILE).exists()


def test_another_hosts_lease_is_stale_only_after_its_heartbeat_stops(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write_record(run_dir, age_s=5)
    with pytest.raises(UserInputError, match="in use by `leantrain train` on host other-host pid 1"):
        acquire_lease(run_dir, command="train")
    _write_record(run_dir, age_s=1000)
    lease = acquire_lease(run_dir, command="launch")
    assert "heartbeat is 1000 s old" in (lease.took_over or "")
    assert read_lease(run_dir)["command"] == "launch"
    lease.release()


def test_a_restart_of_the_same_torchrun_job_takes_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    _write_record(run_dir, age_s=1, job="job-7")
    monkeypatch.setenv(JOB_ENV, "job-7")
    monkeypatch.setenv(RESTART_ENV, "0")
    with pytest.raises(UserInputError):  # attempt 0 of a job with the same id: another job, not a restart
        acquire_lease(run_dir, command="train")
    monkeypatch.setenv(RESTART_ENV, "1")
    lease = acquire_lease(run_dir, command="train")
    assert "earlier attempt" in (lease.took_over or "")
    lease.release()


def test_the_takeover_rule_uses_the_jobs_agreed_attempt_not_this_nodes_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun counts a restart only on the failing node: a rank 0 on another node sees count 0 but the job's
    agreed attempt is 1, so its own job's earlier lease is taken over at once (not after LEASE_STALE_S)."""
    run_dir = tmp_path / "run"
    _write_record(run_dir, age_s=1, job="job-7")
    monkeypatch.setenv(JOB_ENV, "job-7")
    monkeypatch.setenv(RESTART_ENV, "1")
    with pytest.raises(UserInputError):  # the job agreed it is a first start: this node's count is not the job's
        acquire_lease(run_dir, command="train", attempt=0)
    monkeypatch.setenv(RESTART_ENV, "0")
    lease = acquire_lease(run_dir, command="train", attempt=1)
    assert "earlier attempt" in (lease.took_over or "")
    lease.release()


class _Reached(Exception):
    pass


def test_train_uses_the_agreed_attempt_for_the_lease_and_the_first_start_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted rank 0 whose own node did not fail (count 0; the job agreed on 1): train takes over its job's
    lease and skips the first-start refusals (`--resume none` over its own checkpoints)."""
    import leantrain.train.command as command
    from leantrain.ckpt.resume import ResumeRequest
    from leantrain.spec.load import load_spec

    run_dir = tmp_path / "run"
    _write_record(run_dir, age_s=1, job="job-7")
    monkeypatch.setenv(JOB_ENV, "job-7")
    monkeypatch.setenv(RESTART_ENV, "0")
    monkeypatch.setattr(command, "job_attempt", lambda spec: JobAttempt(1))
    monkeypatch.setattr(command, "_check_data_dir", lambda spec: None)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the first-start check ran on a restart")

    def reached(*args: object, **kwargs: object) -> None:
        raise _Reached

    monkeypatch.setattr(command, "precheck", refuse)
    monkeypatch.setattr(command, "description_snapshot", reached)
    monkeypatch.setattr("leantrain.ckpt.preflight.preflight_storage", lambda spec, run_dir: None)
    spec = load_spec(EXAMPLES / "tiny-cpu.yaml")
    with pytest.raises(_Reached):
        command.train(spec, run_dir=run_dir, max_steps=2, console=None, resume=ResumeRequest(mode="none"))
    assert not (run_dir / LEASE_FILE).exists()  # released on the way out


def test_workers_run_under_their_launchers_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    launcher = acquire_lease(run_dir, command="launch")
    launcher_record = read_lease(run_dir)
    for name, value in inherit_env(launcher).items():
        monkeypatch.setenv(name, value)
    worker = acquire_lease(run_dir, command="train")
    assert not worker.owned
    worker.release()  # the worker's exit leaves the launcher's lease in place
    assert read_lease(run_dir)["token"] == launcher_record["token"]
    monkeypatch.setenv(LEASE_ENV, f"{run_dir}\nsomeone-elses-token")
    with pytest.raises(UserInputError, match="leantrain launch"):
        acquire_lease(run_dir, command="train")
    launcher.release()
    assert not (run_dir / LEASE_FILE).exists()


def test_the_heartbeat_refreshes_the_lock_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    lease = acquire_lease(run_dir, command="train", heartbeat_s=0.05)
    path = run_dir / LEASE_FILE
    os.utime(path, (time.time() - 500, time.time() - 500))
    deadline = time.monotonic() + 30
    while read_lease(run_dir)["heartbeat_age_s"] > 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_lease(run_dir)["heartbeat_age_s"] < 100
    lease.release()


def test_an_unwritable_run_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserInputError, match="cannot create it"):
        acquire_lease(blocker / "run", command="train")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lease") / "data"
    assert main(["prepare", str(EXAMPLES / "tiny-cpu.yaml"), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_second_train_or_launch_exits_2_naming_the_holder_and_writes_nothing(
    command: str, data_dir: Path, holder: tuple[Path, subprocess.Popen[str]], capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir, proc = holder
    before = sorted(p.name for p in run_dir.iterdir())
    extra = ["--nproc", "1"] if command == "launch" else ["--max-steps", "2"]
    assert main([command, str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={data_dir}", "--run-dir",
                 str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert f"pid {proc.pid}" in err and "is in use by" in err and "Traceback" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == before == [LEASE_FILE]


def test_train_releases_the_lease_when_it_ends(data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={data_dir}", "--run-dir", str(run_dir),
            "--max-steps", "2"]
    assert main(argv) == 0
    assert not (run_dir / LEASE_FILE).exists() and (run_dir / "metrics.jsonl").exists()
    refused_dir = tmp_path / "never"
    assert main([*argv[:-3], str(refused_dir), "--max-steps", "-1"]) == 2  # refused: no empty run dir left behind
    assert not refused_dir.exists()
