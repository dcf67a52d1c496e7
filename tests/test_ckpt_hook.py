"""The trainer adapter (ckpt/hook.py) with a tiny model: checkpoint requests, alerts and the failure limit,
lineage + registry, fallback with retention, and audit failures.

Run as a script (`python tests/test_ckpt_hook.py RUN_DIR LOG`) it is the training process of the Slurm
time-limit test in test_launch_slurm.py: the real adapter in a step loop until it stops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from leantrain.ckpt import CheckpointLoadError, CheckpointManager, CheckpointSaveError
from leantrain.ckpt.control import CHECKPOINT_REQUEST_NAME
from leantrain.ckpt.hook import TrainerCheckpointer
from leantrain.errors import LeantrainError
from leantrain.observe.alerts import AlertEngine
from leantrain.observe.metrics import MetricsLogger
from test_ckpt_manager import FailingStore, Sampler, events, make_app, make_spec, names, resume, train


def make_trainer(spec: Any, run_dir: Path, *, seed: int = 0, alerts: list[dict] | None = None) -> SimpleNamespace:
    """What the adapter reads from a Trainer; its metrics logger feeds a real alert engine."""
    app = make_app(seed)
    engine = AlertEngine(outputs=[alerts.append] if alerts is not None else [])
    return SimpleNamespace(spec=spec, run_dir=run_dir, runtime=SimpleNamespace(rank=0, world_size=1),
                           model=app["model"], optimizer=app["optimizer"], scheduler=app["scheduler"],
                           sampler=Sampler(), step=0, tokens_seen=0, skipped_steps=0, app=app,
                           metrics=MetricsLogger([engine]))


def step(trainer: SimpleNamespace, hook: TrainerCheckpointer, *, last: bool = False) -> None:
    """One step of Trainer.train's loop: train, count, then the checkpoint decision."""
    train(trainer.app, 1)
    trainer.step += 1
    trainer.tokens_seen += 8
    trainer.sampler.position += 1
    hook.maybe_save(trainer, force=last)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_request_is_saved_cleared_and_stops_the_loop(run_dir: Path, async_save: bool) -> None:
    spec = make_spec(checkpoint={"interval_steps": 2, "async_save": async_save})
    trainer = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(trainer)
    hook.load_latest(trainer)
    request = run_dir / CHECKPOINT_REQUEST_NAME
    for _ in range(2):
        step(trainer, hook)
    request.touch()  # the Slurm trap, between steps 2 and 3
    while trainer.step < 10 and not hook.preempt_requested:
        step(trainer, hook)
    hook.close()
    assert trainer.step == 3 and hook.stop_reason == "checkpoint requested"
    assert not request.exists()
    assert (run_dir / "checkpoints" / "step-00000003" / "COMMIT").is_file()  # committed before the file went
    assert [e["step"] for e in events(run_dir) if e["event"] == "checkpoint_requested"] == [3]
    done = next(e for e in events(run_dir) if e["event"] == "checkpoint_request_done")
    saved = next(e for e in events(run_dir) if e["event"] == "checkpoint_saved" and e["step"] == 3)
    assert done["step"] == 3 and saved["async"] is False and saved["time"] <= done["time"]
    again = make_trainer(spec, run_dir, seed=1)
    resumed = TrainerCheckpointer(again)
    assert resumed.load_latest(again) and (again.step, again.sampler.position) == (3, 3)
    resumed.close()


def test_failed_request_keeps_the_file_and_retries(run_dir: Path) -> None:
    spec = make_spec(checkpoint={"interval_steps": 100})
    store = FailingStore(run_dir / "checkpoints", budget_bytes=100)
    trainer = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(trainer, store=store)
    (run_dir / CHECKPOINT_REQUEST_NAME).touch()
    store.armed = True
    step(trainer, hook)
    assert (run_dir / CHECKPOINT_REQUEST_NAME).exists() and not hook.preempt_requested
    store.armed = False
    step(trainer, hook)
    hook.close()
    assert not (run_dir / CHECKPOINT_REQUEST_NAME).exists() and hook.preempt_requested
    assert [e["step"] for e in events(run_dir) if e["event"] == "checkpoint_saved"] == [2]


def test_failed_saves_alert_and_the_run_stops_after_the_limit(run_dir: Path) -> None:
    spec = make_spec(checkpoint={"interval_steps": 1, "max_consecutive_failures": 2})
    store = FailingStore(run_dir / "checkpoints", budget_bytes=100)
    alerts: list[dict] = []
    trainer = make_trainer(spec, run_dir, alerts=alerts)
    hook = TrainerCheckpointer(trainer, store=store)
    step(trainer, hook)  # 1: saved
    store.armed = True
    step(trainer, hook)  # 2: failed → the alert engine fires
    assert [(a["rule"], a["state"], a["step"]) for a in alerts] == [("checkpoint_failure", "firing", 2)]
    assert "No space left" in alerts[0]["message"] and str(run_dir) in alerts[0]["message"]
    store.armed = False
    step(trainer, hook)  # 3: saved → resolved, and the count of failures in a row starts again
    assert [(a["rule"], a["state"]) for a in alerts][-1] == ("checkpoint_failure", "resolved")
    store.armed = True
    step(trainer, hook)  # 4: failed (1 in a row)
    with pytest.raises(CheckpointSaveError) as raised:
        step(trainer, hook)  # 5: failed (2 in a row) → stop
    hook.close()
    err = raised.value
    assert isinstance(err, LeantrainError) and err.exit_code == 1
    message = str(err)
    assert "step 5" in message and str(run_dir) in message and "max_consecutive_failures=2" in message
    assert "newest good one is step 3" in message and "step-00000005" in message
    assert [e["step"] for e in events(run_dir) if e["event"] == "checkpoint_failed"] == [2, 4, 5]


def test_consecutive_failure_reason_survives_an_async_close(run_dir: Path) -> None:
    """Async saves: the stop is raised by the save after the failed ones, with a new save pending; that one
    fails too, and closing must not replace the "N saves in a row" reason with its own error."""
    spec = make_spec(checkpoint={"interval_steps": 1, "max_consecutive_failures": 2, "async_save": True})
    store = FailingStore(run_dir / "checkpoints", budget_bytes=100)
    trainer = make_trainer(spec, run_dir, alerts=[])
    hook = TrainerCheckpointer(trainer, store=store)
    step(trainer, hook)  # 1: saving in the background
    hook.manager.wait()
    store.armed = True
    step(trainer, hook)  # 2: fails in the background
    with pytest.raises(CheckpointSaveError) as raised:
        for _ in range(3):  # 3 reports 2's failure (1 in a row), 4 reports 3's (2 in a row) → stop
            step(trainer, hook)
    assert "saves in a row failed" in str(raised.value)
    hook.close()  # the pending save of the last step failed as well: logged, not raised over the reason
    assert hook.fatal_error is raised.value


@pytest.mark.parametrize("encrypted", [False, True])
def test_checkpoints_carry_lineage_and_runs_lists_them(
    tmp_path: Path, encrypted: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from leantrain import cli
    from leantrain.provenance.lineage import write_lineage
    from leantrain.provenance.registry import list_runs, register_run
    from leantrain.spec.schema import SecuritySpec

    monkeypatch.setattr(cli.console, "width", 220)
    monkeypatch.setenv("LT_TEST_CKPT_KEY", bytes(range(32)).hex())
    run_dir, registry, data_dir = tmp_path / "run", tmp_path / "reg" / "runs.db", tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "manifest.json").write_text(json.dumps({"shards": []}))
    spec = make_spec(checkpoint={"interval_steps": 2, "keep_last": 3},
                     run={"registry": str(registry)}, data={"dir": str(data_dir)})
    if encrypted:
        spec.security = SecuritySpec(encrypt_checkpoints=True, encryption_key="${LT_TEST_CKPT_KEY}")
    run_lineage = write_lineage(run_dir, spec, data_dir=data_dir)  # what `leantrain train` does first (rank 0)
    run_id = register_run(run_lineage, registry=registry)
    trainer = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(trainer)
    for _ in range(4):
        step(trainer, hook)
    hook.close()

    folder = run_dir / "checkpoints" / "step-00000004"
    stored = (folder / "lineage.json").read_bytes()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["files"]["lineage.json"]["sha256"] == hashlib.sha256(stored).hexdigest()  # covered by COMMIT
    if encrypted:
        assert b"run_id" not in stored
    else:
        lineage = json.loads(stored)
        assert (lineage["run_id"], lineage["checkpoint"]["step"]) == (run_id, 4)
        assert lineage["spec"]["sha256"] == run_lineage["spec"]["sha256"]
        assert lineage["data"]["manifest_sha256"] == run_lineage["data"]["manifest_sha256"] is not None
        run_file = run_dir / "lineage.json"
        assert lineage["run_lineage"] == {"path": str(run_file.resolve()),
                                          "sha256": hashlib.sha256(run_file.read_bytes()).hexdigest()}
    (row,) = list_runs(registry=registry)
    assert (row["num_checkpoints"], row["latest_step"]) == (2, 4)
    assert cli.main(["runs", str(run_dir), "--registry", str(registry)]) == 0
    shown = capsys.readouterr().out
    table = shown[shown.index("checkpoints and what produced them"):]
    assert [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")] == ["2", "4"]
    assert table.count(run_lineage["spec"]["sha256"][:8]) == 2


def _reseal(folder: Path, name: str, data: bytes) -> None:
    """Replace a file and re-hash manifest and commit marker: bad bytes that were bad before hashing, so
    verification passes and only DCP's load fails (a failure that does not condemn the folder)."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_bytes = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(manifest_bytes)
    commit = json.loads((folder / "COMMIT").read_text())
    commit["manifest_sha256"] = hashlib.sha256(manifest_bytes).hexdigest()
    (folder / "COMMIT").write_text(json.dumps(commit))


def test_fallback_then_retention_keeps_the_resumable_timeline(run_dir: Path) -> None:
    """keep_last 1: step 4 fails to load, the run resumes from 2 and saves 3; retention must keep 3 (not the
    broken 4), the next restart resumes from 3, and the run's own step 4 replaces the abandoned one."""
    spec = make_spec(checkpoint={"keep_last": 1})
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    train(app, 2)
    ckpt.save(4, app, blocking=True)
    ckpt.close()
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004"]  # keep_last 1
    # Bring back a step-2 (an earlier run kept more) and break step 4 so that only the load notices.
    ckpt = CheckpointManager(spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"keep_last": 2})}), run_dir=run_dir)
    ckpt.save(2, make_app(5), blocking=True)
    ckpt.close()
    shard = root / "step-00000004" / "__0_0.distcp"
    _reseal(root / "step-00000004", "__0_0.distcp", shard.read_bytes()[:40])

    app = make_app(1)
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    assert ckpt.load_latest(app) == 2
    assert "checkpoint_fallback" in names(run_dir)
    assert "abandoned" in (root / "step-00000004" / "CORRUPT").read_text()
    train(app, 1)
    ckpt.save(3, app, blocking=True)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000004"]
    ckpt.close()

    app = make_app(2)
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    assert ckpt.load_latest(app) == 3  # before the fix: only the broken 4 was left → CheckpointLoadError
    train(app, 1)
    ckpt.save(4, app, blocking=True)  # replaces the abandoned folder of the same step
    ckpt.close()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004"]
    assert not (root / "step-00000004" / "CORRUPT").exists()
    expected = [p.detach().clone() for p in app["model"].parameters()]
    fresh = make_app(3)
    assert resume(spec, run_dir, fresh) == 4
    assert all(torch.equal(a, b) for a, b in zip(expected, fresh["model"].parameters(), strict=True))


def test_load_error_names_the_run_steps_and_files(run_dir: Path) -> None:
    spec = make_spec()
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    ckpt.save(2, app, blocking=True)
    ckpt.close()
    folder = run_dir / "checkpoints" / "step-00000002"
    _reseal(folder, "__0_0.distcp", (folder / "__0_0.distcp").read_bytes()[:40])
    with pytest.raises(CheckpointLoadError) as raised:
        resume(spec, run_dir, make_app(1))
    message = str(raised.value)
    assert raised.value.exit_code == 1 and isinstance(raised.value, LeantrainError)
    assert str(run_dir) in message and "step 2" in message and str(folder) in message


def test_audit_failure_never_stops_a_save_or_a_resume(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = make_spec()
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    ckpt.save(2, app, blocking=True)
    audit = run_dir / "audit.log"
    lines = audit.read_text().splitlines()
    audit.write_text("\n".join([*lines[:-1], lines[-1][:-5] + "edited"]) + "\n")
    with caplog.at_level(logging.WARNING, logger="leantrain.ckpt"):
        ckpt.save(4, app, blocking=True)
        ckpt.close()
        assert resume(spec, run_dir, make_app(1)) == 4
    assert names(run_dir).count("checkpoint_saved") == 2
    assert any("audit.log append failed" in r.getMessage() for r in caplog.records)


def drive(run_dir: Path, log: Path, *, deadline_s: float = 60.0) -> None:
    """The training process of test_launch_slurm's Slurm test: steps until the adapter stops (or the deadline)."""
    spec = make_spec(checkpoint={"interval_steps": 1000})
    trainer = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(trainer)
    hook.load_latest(trainer)
    Path(f"{log}.train-started").touch()
    end = time.monotonic() + deadline_s
    while not hook.preempt_requested and time.monotonic() < end:
        step(trainer, hook)
    hook.close()
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"trainer stopped at step {trainer.step}: {hook.stop_reason}\n")


if __name__ == "__main__":
    drive(Path(sys.argv[1]), Path(sys.argv[2]))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_fast_tier_save_is_an_event_and_the_job_goes_on(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """The fast tier every step beside the durable tier every 4 (async or not): a full tmpfs at step 3 is
    caught, reported as `memory_checkpoint_failed` naming the rank, no fast checkpoint is left anywhere, and
    the job goes on: step 5 saves the fast tier again, steps 4 and 6 the durable tier (which are no fast-tier
    steps: decided on the main thread from the step and the agreed durable decision)."""
    from leantrain.ckpt.memory_tier import MemoryTier

    spec = make_spec(checkpoint={"interval_steps": 4, "async_save": async_save, "memory_interval_steps": 1,
                                 "memory_dir": str(tmp_path / "shm")})
    trainer = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(trainer)
    assert hook.memory is not None
    write = MemoryTier._write

    def full_at_step_3(self: MemoryTier, folder: Path, step: int, chunks: Any) -> str:
        if step == 3:
            raise OSError(28, "No space left on device")
        return write(self, folder, step, chunks)

    monkeypatch.setattr(MemoryTier, "_write", full_at_step_3)
    kept = {}
    for n in range(1, 7):
        step(trainer, hook, last=n == 6)
        kept[n] = sorted(p.name for p in (tmp_path / "shm").rglob("*.pt"))
    hook.close()
    kinds = events(run_dir)
    saved = [e["step"] for e in kinds if e["kind"] == "memory_checkpoint_saved"]
    (failed,) = [e for e in kinds if e["kind"] == "memory_checkpoint_failed"]
    assert saved == [1, 2, 5] and failed["step"] == 3 and failed["failed_ranks"] == [0], kinds
    assert "No space left" in failed["error"] and "durable tier" in failed["action"]
    assert kept[2] == ["step-00000002.pt"] and kept[3] == [] and kept[5] == ["step-00000005.pt"]
    assert kept[6] == []  # the run's end is durable: the node's memory is given back
    assert hook.memory is not None and not hook.memory.disabled  # a failed write does not turn the tier off
    assert [e["step"] for e in kinds if e["kind"] == "checkpoint_saved"] == [4, 6]
