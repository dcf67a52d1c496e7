"""Exact resume on one rank: SIGKILL in the middle of an async save, restart, same losses bit for bit.

The fault comes from the product's drill hook (ckpt/fault.py, armed by environment variables), in a real
`leantrain train` subprocess, so the process dies the way a crashed host does: no handler, no flush.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from leantrain.ckpt.fault import (
    ENV_COMMIT_POINT,
    ENV_CORRUPT_LATEST,
    ENV_DURING_SAVE,
    ENV_KILL_AT_STEP,
    ENV_KILL_RANK,
    MARKER_FILE,
    FaultInjector,
    FaultPlan,
)
from leantrain.ckpt.hook import TrainerCheckpointer
from leantrain.spec import JobSpec, load_spec
from leantrain.train.trainer import Trainer
from test_train_loop import SEQ, make_data, tiny_spec

MAX_STEPS = 6
INTERVAL = 2


def write_resume_spec(tmp_path: Path, *, async_save: bool = False, micro_batch: int = 1) -> Path:
    """The trainer tests' tiny job with checkpoints every 2 steps, written as a spec file for subprocesses.

    micro_batch 1 and 4 sequences per step: 4 micro-batches at 1 rank, 2 at 2 ranks, 1 at 4 ranks.
    """
    spec = tiny_spec(make_data(tmp_path / "data"), max_steps=MAX_STEPS, micro_batch=micro_batch,
                     global_batch_tokens=4 * SEQ)
    raw: dict[str, Any] = spec.model_dump(mode="json", exclude_defaults=True)
    raw["checkpoint"] = {"interval_steps": INTERVAL, "keep_last": 10, "async_save": async_save}
    raw["fault"] = {"max_restarts": 1}
    raw["run"] = {"registry": str(tmp_path / "runs.db")}
    raw["security"] = {"audit_log": False}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def logged_losses(run_dir: Path) -> dict[int, list[float]]:
    """Every logged training loss per step (a step redone after a resume appears twice)."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out.setdefault(record["step"], []).append(record["loss"])
    return out


def reference_losses(spec: JobSpec, run_dir: Path) -> dict[int, float]:
    trainer = Trainer(spec, run_dir=run_dir, checkpointer_factory=TrainerCheckpointer)
    try:
        return {r["step"]: r["loss"] for r in trainer.train() if "loss" in r}
    finally:
        trainer.close()


def test_fault_plan_reads_the_environment_and_fires_once(tmp_path: Path) -> None:
    assert FaultPlan.from_env({}) is None
    plan = FaultPlan.from_env({ENV_KILL_AT_STEP: "7", ENV_KILL_RANK: "1", ENV_DURING_SAVE: "1",
                               ENV_CORRUPT_LATEST: "0"})
    assert plan == FaultPlan(kill_at_step=7, kill_rank=1, during_save=True, corrupt_latest=False)
    assert FaultPlan.from_env(plan.to_env()) == plan
    with pytest.raises(ValueError, match=ENV_KILL_AT_STEP):
        FaultPlan.from_env({ENV_KILL_AT_STEP: "soon"})
    # Every rank forces the mid-save checkpoint at step 7 until the marker says the fault has fired.
    assert FaultInjector(plan, run_dir=tmp_path, rank=0).forced_save_step == 7
    (tmp_path / MARKER_FILE).write_text(json.dumps({"step": 7, "attempt": 0, "time": 0.0}))
    assert FaultInjector(plan, run_dir=tmp_path, rank=0).forced_save_step is None


@pytest.mark.slow
def test_one_rank_killed_mid_async_save_resumes_bit_for_bit(tmp_path: Path) -> None:
    spec_file = write_resume_spec(tmp_path, async_save=True)
    spec = load_spec(spec_file)
    reference = reference_losses(spec, tmp_path / "reference")
    run_dir = tmp_path / "faulted"
    env = {**os.environ, "OMP_NUM_THREADS": "1", ENV_KILL_AT_STEP: "4", ENV_DURING_SAVE: "1"}
    command = [sys.executable, "-m", "leantrain.cli", "train", str(spec_file), "--run-dir", str(run_dir)]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [".tmp-step-00000004", "step-00000002"]  # step 4 died half-written:
    half = {p.name for p in (run_dir / "checkpoints" / ".tmp-step-00000004").iterdir()}
    assert any(name.endswith(".distcp") for name in half) and "COMMIT" not in half  # data, no commit
    marker = json.loads((run_dir / MARKER_FILE).read_text())
    assert marker["step"] == 4 and marker["during_save"] is True
    # Same command, same environment: the marker keeps the fault from firing again.
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = logged_losses(run_dir)
    assert logged[4] == [reference[4]] * 2 and logged[3] == [reference[3]] * 2  # redone after resuming at 2
    assert {step: values[-1] for step, values in logged.items()} == reference  # bit for bit, every step
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert [e["step"] for e in loaded] == [2]
    assert [e["from_step"] for e in events if e["kind"] == "resume"] == [2]
    assert not [e for e in events if e["kind"] == "restart"]  # restarted by hand, not by torchrun


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_marker", "before_retention"])
def test_killed_inside_the_commit_resumes_bit_for_bit(tmp_path: Path, point: str) -> None:
    """SIGKILL inside step 4's commit (ckpt/fault.py LEANTRAIN_FAULT_COMMIT_POINT): with the manifest written
    and no COMMIT marker the step does not exist and the rerun resumes from step 2; after the publish and
    before retention step 4 is good and the rerun resumes from it. Either way the losses are the reference's,
    bit for bit, and the dead process's run-dir lease is taken over (same host, pid gone)."""
    spec_file = write_resume_spec(tmp_path)
    reference = reference_losses(load_spec(spec_file), tmp_path / "reference")
    run_dir = tmp_path / "faulted"
    env = {**os.environ, "OMP_NUM_THREADS": "1", ENV_KILL_AT_STEP: "4", ENV_COMMIT_POINT: point}
    command = [sys.executable, "-m", "leantrain.cli", "train", str(spec_file), "--run-dir", str(run_dir)]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (run_dir / "run.lock").exists()  # SIGKILL: nothing released it
    root = run_dir / "checkpoints"
    if point == "before_marker":
        half = {p.name for p in (root / ".tmp-step-00000004").iterdir()}
        assert "manifest.json" in half and "COMMIT" not in half
        assert not (root / "step-00000004").exists()
    else:
        assert (root / "step-00000004" / "COMMIT").is_file() and (root / "step-00000002" / "COMMIT").is_file()
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = logged_losses(run_dir)
    assert {step: values[-1] for step, values in logged.items()} == reference  # bit for bit, every step
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_loaded"] == [2 if point == "before_marker" else 4]
    assert not (run_dir / "run.lock").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # retention cleared the half-written


def test_restarted_worker_records_restart_with_recovery_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unplanned restart (no drill marker): recovery is measured from the dead attempt's last metrics write."""
    from types import SimpleNamespace

    from test_ckpt_manager import make_app, make_spec

    class Sampler:
        def state_dict(self) -> dict[str, int]:
            return {"global_sample_index": 0}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    def make_trainer() -> SimpleNamespace:
        app = make_app(0)
        return SimpleNamespace(spec=make_spec(), run_dir=tmp_path, runtime=SimpleNamespace(rank=0, world_size=1),
                               model=app["model"], optimizer=app["optimizer"], scheduler=app["scheduler"],
                               sampler=Sampler(), step=2, tokens_seen=0, skipped_steps=0)

    first = make_trainer()
    hook = TrainerCheckpointer(first)
    hook.maybe_save(first, force=True)
    hook.close()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 2, "loss": 1.0}\n')
    died_at = time.time() - 5.0
    for path in (metrics, tmp_path / "events.jsonl"):  # the dead attempt's last writes
        os.utime(path, (died_at, died_at))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = make_trainer()
    hook = TrainerCheckpointer(again)
    assert hook.load_latest(again)
    hook.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    restart = next(e for e in events if e["kind"] == "restart")
    assert (restart["attempt"], restart["resumed_from"], restart["planned"]) == (1, 2, False)
    assert restart["cause"] == "worker failure" and 5.0 <= restart["recovery_s"] < 60.0
