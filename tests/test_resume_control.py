"""Resume control on the command line: --resume auto|none|latest|STEP|PATH, --weights-only, --extend-schedule,
refusals that change nothing, a finished run, and SIGINT/SIGTERM saving the current step (exit 130/143)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from leantrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "data"
    assert main(["prepare", str(EXAMPLES / "tiny-cpu.yaml"), "--out", str(out)]) == 0
    return out


def argv(data_dir: Path, run_dir: Path, steps: int, *extra: str, interval: int = 4) -> list[str]:
    return ["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={data_dir}", "--set",
            f"checkpoint.interval_steps={interval}", "--set", "training.log_every=2", "--set",
            "security.audit_log=false", "--run-dir", str(run_dir), "--max-steps", str(steps), *extra]


def digests(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its sha256: proves a refusal changed nothing."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def test_changed_schedule_refused_then_extended_then_finished(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(argv(data_dir, run, 8)) == 0
    before = digests(run)  # checkpoints, and the run dir's spec.yaml, plan.json, lineage.json too
    capsys.readouterr()
    assert main(argv(data_dir, run, 12)) == 2  # max steps changed: not resumed silently
    err = capsys.readouterr().err
    assert "training.max_steps 8 → 12" in err and "--extend-schedule" in err and "--resume none" in err
    assert digests(run) == before
    assert main(argv(data_dir, run, 12, "--set", "training.lr=1e-3")) == 2  # the LR too
    assert "training.lr 0.003 → 0.001" in capsys.readouterr().err

    assert main(argv(data_dir, run, 12, "--extend-schedule")) == 0
    out = capsys.readouterr().out
    assert f"resuming from step 8, checkpoint {run / 'checkpoints' / 'step-00000008'}" in out
    assert steps_logged(run)[-2:] == [10, 12]  # went on from step 8, not from step 1
    kinds = [json.loads(line).get("kind") for line in (run / "events.jsonl").read_text().splitlines()]
    assert "schedule_extended" in kinds

    before = digests(run / "checkpoints")
    assert main(argv(data_dir, run, 12)) == 0  # finished: says so, trains nothing
    assert f"run {run} is finished: step 12 of 12" in capsys.readouterr().out
    assert digests(run / "checkpoints") == before and steps_logged(run)[-1] == 12


def test_resume_none_and_weights_only_start_new_runs_only(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    assert main(argv(data_dir, old, 4)) == 0
    before = digests(old / "checkpoints")
    capsys.readouterr()
    assert main(argv(data_dir, old, 4, "--resume", "none")) == 2  # would overwrite this run's checkpoints
    assert "already holds this run's checkpoints (steps 4)" in capsys.readouterr().err
    assert digests(old / "checkpoints") == before

    fresh = tmp_path / "fresh"
    assert main(argv(data_dir, fresh, 2, "--resume", "none")) == 0
    assert steps_logged(fresh) == [2]

    assert main(argv(data_dir, tmp_path / "w", 2, "--weights-only")) == 2  # needs --resume PATH
    assert "--resume PATH" in capsys.readouterr().err
    tuned = tmp_path / "tuned"
    assert main(argv(data_dir, tuned, 2, "--resume", str(old), "--weights-only", "--set", "training.lr=1e-4")) == 0
    out = capsys.readouterr().out
    assert f"starting a new run from the weights of step 4, checkpoint {old / 'checkpoints' / 'step-00000004'}" in out
    assert steps_logged(tuned) == [2]  # a new run: step 1 on, its own schedule
    first_fresh = json.loads((fresh / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    first_tuned = json.loads((tuned / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_tuned < first_fresh - 0.05  # trained weights, not a fresh initialisation
    assert digests(old / "checkpoints") == before


@pytest.mark.parametrize("damage", ["bit_flip", "markers_lost"])
def test_every_checkpoint_bad_refuses_and_leaves_files_bitwise_unchanged(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    run = tmp_path / "run"
    assert main(argv(data_dir, run, 8)) == 0
    for folder in sorted((run / "checkpoints").glob("step-*")):
        if damage == "markers_lost":
            (folder / "COMMIT").unlink()
        else:
            data = bytearray((folder / "__0_0.distcp").read_bytes())
            data[100] ^= 1
            (folder / "__0_0.distcp").write_bytes(bytes(data))
    before = digests(run / "checkpoints")
    described = {name: (run / name).read_bytes() for name in ("spec.yaml", "plan.json", "lineage.json")}
    capsys.readouterr()
    for _ in range(2):  # and again: nothing was marked the first time either
        assert main(argv(data_dir, run, 8)) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "2 checkpoint(s)" in err and "none is valid" in err and "Nothing was changed" in err
        assert "step 4 (" in err and "step 8 (" in err
        assert ("sha256 mismatch" if damage == "bit_flip" else "no commit marker") in err
        assert digests(run / "checkpoints") == before
        assert {name: (run / name).read_bytes() for name in described} == described  # nor the run's description


def test_resume_step_loads_that_step_and_marks_newer_abandoned(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(argv(data_dir, run, 8, "--set", "checkpoint.keep_last=3")) == 0
    capsys.readouterr()
    assert main(argv(data_dir, run, 8, "--resume", "6")) == 2  # no such step: names the ones there
    assert "steps there: 4, 8" in " ".join(capsys.readouterr().err.split())
    assert main(argv(data_dir, run, 8, "--resume", "4", "--set", "checkpoint.keep_last=3")) == 0
    assert "resuming from step 4" in capsys.readouterr().out
    assert steps_logged(run)[-2:] == [6, 8]
    kinds = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == "checkpoint_abandoned" and e["step"] == 8 for e in kinds)


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(s >= step for s in steps_logged(run_dir)):
            return
        time.sleep(0.2)
    raise AssertionError(f"training never logged step {step} (exit code {proc.poll()})")


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_signal_saves_the_current_step_exits_128_plus_n_and_a_rerun_resumes(
    data_dir: Path, tmp_path: Path, signame: str
) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "leantrain.cli", *argv(data_dir, run, 100_000, interval=100_000)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_for_step(run, 4, proc)
        proc.send_signal(getattr(signal, signame))
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + getattr(signal, signame), out
    saved = sorted((run / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    step = int(saved[0].name.split("-")[1])
    assert f"stopped by {signame} at step {step}: checkpoint saved at step {step}" in " ".join(out.split())
    assert step >= 4

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_for_step(run, step + 2, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"resuming from step {step}" in out and proc.returncode == 143


def test_a_restart_before_the_first_save_repeats_the_first_attempts_request(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun restarts a worker that failed before this run saved anything (a crash, or a refusal). The restart
    replaced `--resume OTHER_RUN` with auto and, finding no checkpoint of its own, trained from step 0, exit 0: the
    continued run silently started over. It repeats the first attempt's request now."""
    source = tmp_path / "source"
    assert main(argv(data_dir, source, 4)) == 0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # this start is the job's attempt 1
    capsys.readouterr()
    continued = tmp_path / "continued"
    assert main(argv(data_dir, continued, 8, "--resume", str(source), "--extend-schedule")) == 0
    assert "resuming from step 4" in capsys.readouterr().out
    assert steps_logged(continued) == [6, 8]  # steps 5-8 only: not trained from step 0
    # A refusal is repeated too (here: the other run has no checkpoint), not turned into a fresh start.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(argv(data_dir, tmp_path / "again", 8, "--resume", str(empty))) == 2
    assert not (tmp_path / "again" / "checkpoints").exists() or not any((tmp_path / "again" / "checkpoints").iterdir())


def test_a_restart_counts_only_the_checkpoints_its_job_saved_as_its_own(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--resume none` into a run dir that holds checkpoints is refused; torchrun restarts the refused worker, and
    the restart took those older checkpoints for the job's own and resumed them, exit 0, against the user's
    request. Now only checkpoints committed after the job's first start count (RUN_DIR/job_start.json); a job
    that saved its own goes on from them."""
    run = tmp_path / "run"
    assert main(argv(data_dir, run, 8)) == 0
    before = digests(run / "checkpoints")
    job = uuid.uuid4().hex  # torchrun's job id (agent notes are kept per job in the node's temp dir)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"{job}-a")
    for count in ("0", "1", "2"):  # the first start and two restarts: each refused, nothing written
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        assert main(argv(data_dir, run, 12, "--resume", "none")) == 2, count
        assert "already holds this run's checkpoints" in capsys.readouterr().err
    assert digests(run / "checkpoints") == before and steps_logged(run)[-1] == 8
    # a job that committed a checkpoint of its own goes on from it when restarted
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"{job}-b")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    fresh = argv(data_dir, tmp_path / "fresh", 8, "--resume", "none")
    killed = subprocess.run([sys.executable, "-m", "leantrain.cli", *fresh], capture_output=True, text=True,
                            env=os.environ | {"LEANTRAIN_FAULT_KILL_AT_STEP": "5", "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]  # after its save at step 4
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    assert main(fresh) == 0
    assert "resuming from step 4" in capsys.readouterr().out and steps_logged(tmp_path / "fresh") == [2, 4, 6, 8]


def test_a_restart_goes_on_from_the_fast_tier_and_ignores_a_save_cut_short(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What counts as the run's own state on a restart: a fast-tier snapshot does (the restart of a `--resume none`
    run killed before its first durable save went back to step 0 and threw the snapshot away), a folder of a save
    cut short does not (it turned a `--resume OTHER_RUN` restart into auto: a fresh start)."""
    source = tmp_path / "source"
    assert main(argv(data_dir, source, 4)) == 0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    # the fast tier: killed at step 5 with a snapshot every step and no durable checkpoint yet
    run, shm = tmp_path / "fast", tmp_path / "shm"
    fast = argv(data_dir, run, 8, "--set", "checkpoint.memory_interval_steps=1", "--set",
                f"checkpoint.memory_dir={shm}", "--resume", "none", interval=100)
    killed = subprocess.run([sys.executable, "-m", "leantrain.cli", *fast], capture_output=True, text=True,
                            env=os.environ | {"LEANTRAIN_FAULT_KILL_AT_STEP": "5", "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    assert main(fast) == 0
    assert "resuming from step 5" in capsys.readouterr().out
    # a save cut short in the continued run's own store: not a checkpoint to go on from
    continued = tmp_path / "continued"
    (continued / "checkpoints" / "step-00000006").mkdir(parents=True)
    assert main(argv(data_dir, continued, 8, "--resume", str(source), "--extend-schedule")) == 0
    assert "resuming from step 4" in capsys.readouterr().out
