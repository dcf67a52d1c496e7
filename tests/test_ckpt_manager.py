"""Checkpoint manager on one process: round trip, corruption fallback, failing store, retention, async, preemption."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from leantrain.ckpt import CheckpointManager, CheckpointSaveError, RankRNGState
from leantrain.ckpt.integrity import StepEntry, retention_victims
from leantrain.ckpt.policy import LLAMA3_FAILURES_PER_GPU_DAY, job_mtbf_s, young_daly_interval_s
from leantrain.ckpt.storage import LocalStore
from leantrain.security import AuditLog
from leantrain.spec import spec_from_dict

BASE_SPEC: dict[str, Any] = {
    "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "vocab_size": 64},
    "data": {"tokens_total": 1e4, "seq_len": 8},
    "training": {"global_batch_tokens": 8, "device": "cpu"},
    "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1},
    "budget": {"target_days": None, "num_gpus": 1},
    "checkpoint": {"interval_steps": 2, "keep_last": 3, "save_retries": 0},  # retries: test_ckpt_s3
}


def make_spec(**sections: dict[str, Any]) -> Any:
    raw = json.loads(json.dumps(BASE_SPEC))
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return spec_from_dict(raw)


def make_app(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "trainer": {"step": 0, "tokens_seen": 0},
        "sampler": {"global_sample_index": 0},
        "rng": RankRNGState(0),
    }


def train(app: dict[str, Any], num_steps: int) -> None:
    """Steps that consume every kind of randomness the checkpoint must restore."""
    for _ in range(num_steps):
        x = torch.randn(4, 6) + random.random() + float(np.random.rand())
        loss = app["model"](x).square().mean()
        loss.backward()
        app["optimizer"].step()
        app["optimizer"].zero_grad()
        app["scheduler"].step()
        app["trainer"]["step"] += 1
        app["trainer"]["tokens_seen"] += 32
        app["sampler"]["global_sample_index"] += 4


def snapshot(app: dict[str, Any]) -> dict[str, Any]:
    """Everything that must come back bit for bit, plus the next random draws (proves RNG restore)."""
    state = {
        "params": [p.detach().clone() for p in app["model"].parameters()],
        "optim": {
            k: {kk: vv.clone() for kk, vv in v.items()} for k, v in app["optimizer"].state_dict()["state"].items()
        },
        "groups": json.dumps(app["optimizer"].state_dict()["param_groups"]),
        "sched": json.dumps(app["scheduler"].state_dict()),
        "trainer": dict(app["trainer"]),
        "sampler": dict(app["sampler"]),
    }
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    state["draws"] = (torch.rand(3), random.random(), float(np.random.rand()))
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])
    return state


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert a["optim"].keys() == b["optim"].keys()
    for key in a["optim"]:
        assert all(torch.equal(a["optim"][key][k], b["optim"][key][k]) for k in a["optim"][key])
    for key in ("groups", "sched", "trainer", "sampler"):
        assert a[key] == b[key], key
    assert torch.equal(a["draws"][0], b["draws"][0]) and a["draws"][1:] == b["draws"][1:]


def resume(spec: Any, run_dir: Path, app: dict[str, Any]) -> int | None:
    """What a restarted trainer does first: a new manager, load_latest, and (here) close."""
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    try:
        return ckpt.load_latest(app)
    finally:
        ckpt.close()


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def names(run_dir: Path) -> list[str]:
    return [e["event"] for e in events(run_dir)]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def test_round_trip_is_bit_identical_and_layout_is_documented(run_dir: Path) -> None:
    spec = make_spec()
    app = make_app()
    train(app, 2)
    lineage = {"lineage.json": b'{"run_id": "r1"}'}  # extra files are covered by the manifest too
    ckpt = CheckpointManager(spec, run_dir=run_dir, extra_files=lambda step: lineage)
    assert ckpt.should_save(2) and not ckpt.should_save(3)
    ckpt.save(2, app, blocking=True)
    expected = snapshot(app)
    folder = run_dir / "checkpoints" / "step-00000002"
    assert {"COMMIT", "manifest.json", ".metadata", "lineage.json"} <= {p.name for p in folder.iterdir()}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 2 and {".metadata", "__0_0.distcp", "lineage.json"} <= manifest["files"].keys()
    ckpt.close()

    fresh = make_app(seed=1)
    train(fresh, 5)  # different weights, optimizer moments, LR step, counters and RNG
    ckpt2 = CheckpointManager(spec, run_dir=run_dir)
    assert ckpt2.load_latest(fresh) == 2
    assert_same(snapshot(fresh), expected)
    assert not ckpt2.should_save(2)  # the resume point is not saved again
    ckpt2.close()
    saved = [e for e in events(run_dir) if e["event"] == "checkpoint_saved"][0]
    assert saved["kind"] == "checkpoint_saved" and saved["bytes"] > 0 and saved["duration_s"] >= 0
    assert "checkpoint_loaded" in names(run_dir)
    audit = AuditLog(run_dir / "audit.log")
    assert audit.verify().ok and [e["event"] for e in audit.entries()] == ["checkpoint.saved", "checkpoint.loaded"]


def _corrupt(folder: Path, how: str) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bit_flipped":
        data[len(data) // 3] ^= 0x10
        shard.write_bytes(bytes(data))
    elif how == "half_written":
        (folder / "COMMIT").unlink()
    elif how == "missing_file":
        (folder / ".metadata").unlink()
    elif how == "bad_commit":  # an IntegrityError (a LeantrainError, exit 2 where it is not caught): falls back
        marker = json.loads((folder / "COMMIT").read_text())
        (folder / "COMMIT").write_text(json.dumps({**marker, "manifest_sha256": "0" * 64}))


@pytest.mark.parametrize("how", ["truncated", "bit_flipped", "half_written", "missing_file", "bad_commit"])
def test_damaged_newest_checkpoint_is_skipped_with_fallback(run_dir: Path, how: str) -> None:
    spec = make_spec()
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    expected = snapshot(app)
    train(app, 2)
    ckpt.save(4, app, blocking=True)
    ckpt.close()
    _corrupt(run_dir / "checkpoints" / "step-00000004", how)
    # A crash mid-save leaves a temporary folder: never a candidate.
    (run_dir / "checkpoints" / ".tmp-step-00000006").mkdir()

    fresh = make_app(seed=3)
    ckpt2 = CheckpointManager(spec, run_dir=run_dir)
    assert ckpt2.load_latest(fresh) == 2
    assert_same(snapshot(fresh), expected)
    invalid = [e for e in events(run_dir) if e["event"] == "checkpoint_invalid"]
    assert [e["step"] for e in invalid] == [4]
    if how != "half_written":
        fallback = [e for e in events(run_dir) if e["event"] == "checkpoint_fallback"]
        assert fallback and fallback[0]["from_step"] == 4 and fallback[0]["to_step"] == 2
        assert (run_dir / "checkpoints" / "step-00000004" / "CORRUPT").exists()
    # Training goes on and re-saves step 4 over the condemned folder; retention clears the temporary one.
    train(fresh, 2)
    ckpt2.save(4, fresh, blocking=True)
    ckpt2.close()
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left == ["step-00000002", "step-00000004"]
    assert resume(spec, run_dir, make_app(seed=4)) == 4


class FailingStore(LocalStore):
    """A disk that fills up: once armed, a write raises ENOSPC after `budget_bytes` bytes."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        super().__init__(root)
        self.armed = False
        self.budget_bytes = budget_bytes

    def open_write(self, rel: str) -> Any:
        stream = super().open_write(rel)
        if not self.armed:
            return stream
        store = self

        class Full:
            def __init__(self) -> None:
                self.num_bytes = 0

            def write(self, data: Any) -> int:
                self.num_bytes += len(data)
                if self.num_bytes > store.budget_bytes:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return stream.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(stream, name)

            def __enter__(self) -> Full:
                return self

            def __exit__(self, *exc: object) -> None:
                stream.close()

        return Full()


@pytest.mark.parametrize("blocking", [True, False])
def test_failing_store_loses_nothing_and_run_continues(run_dir: Path, blocking: bool) -> None:
    spec = make_spec(checkpoint={"keep_last": 1})
    store = FailingStore(run_dir / "checkpoints", budget_bytes=1000)
    alerts: list[str] = []
    ckpt = CheckpointManager(spec, run_dir=run_dir, store=store, on_alert=lambda name, _: alerts.append(name))
    app = make_app()
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    expected = snapshot(app)
    store.armed = True
    train(app, 2)
    with pytest.raises(CheckpointSaveError, match="No space left") as raised:
        ckpt.save(4, app, blocking=blocking)
        ckpt.wait()
    message = str(raised.value)  # one line: the errno and the file, not DCP's per-rank traceback
    assert "\n" not in message and "Traceback" not in message and "[ENOSPC, file " in message
    assert "checkpoints/.tmp-step-00000004/" in message and "(write)" in message
    assert alerts == ["checkpoint_failed"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002"]
    fresh = make_app(seed=2)
    assert resume(spec, run_dir, fresh) == 2
    assert_same(snapshot(fresh), expected)
    store.armed = False  # the disk recovers: the next interval saves, and only then is step 2 retired
    ckpt.save(6, app, blocking=blocking)
    ckpt.close()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000006"]


def test_a_retry_after_a_commit_that_failed_in_place_keeps_that_checkpoint(run_dir: Path) -> None:
    """The commit renamed step 4 into place, then the fsync of the checkpoints folder failed (EIO): the save
    failed, and its retry deleted the committed step 4 as "another timeline's checkpoint" before writing again; a
    retry that failed too left nothing of step 4. The retry now keeps it (and syncs the folder again)."""
    spec = make_spec(checkpoint={"keep_last": 3, "save_retries": 1, "retry_backoff_s": 0})
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    app = make_app()
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    store, real_sync, real_open = ckpt.store, ckpt.store.sync_dir, ckpt.store.open_write
    failures = {"sync": 1}

    def sync_dir(rel: str) -> None:
        if rel == "" and failures["sync"]:
            failures["sync"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        real_sync(rel)

    def open_write(rel: str) -> Any:
        if not failures["sync"] and rel.endswith(".distcp"):  # the retry's write would fail as well
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(rel)

    store.sync_dir, store.open_write = sync_dir, open_write  # type: ignore[method-assign]
    train(app, 2)
    expected = snapshot(app)
    ckpt.save(4, app, blocking=True)
    ckpt.close()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert "checkpoint_deleted" not in names(run_dir) and "checkpoint_failed" not in names(run_dir)
    fresh = make_app(seed=2)
    assert resume(spec, run_dir, fresh) == 4
    assert_same(snapshot(fresh), expected)


def test_retention_never_deletes_the_newest_good() -> None:
    entries = [
        StepEntry(step=2, name="step-00000002", committed=True, corrupt=False),
        StepEntry(step=4, name="step-00000004", committed=True, corrupt=False),
        StepEntry(step=6, name="step-00000006", committed=True, corrupt=True),
        StepEntry(step=8, name="step-00000008", committed=False, corrupt=False),
    ]
    victims = dict(retention_victims(entries, keep_last=1))
    assert victims == {"step-00000002": "beyond keep_last=1"}  # 6 and 8 are newer than the newest good (4)
    assert retention_victims([e for e in entries if not e.good_candidate], keep_last=1) == []
    # Counted back from the step just committed (3, after a fallback): the abandoned 4 neither counts nor goes.
    resumed = [*entries, StepEntry(step=3, name="step-00000003", committed=True, corrupt=False)]
    victims = dict(retention_victims(sorted(resumed, key=lambda e: e.step), keep_last=1, committed_step=3))
    assert victims == {"step-00000002": "beyond keep_last=1"}


def test_async_save_snapshots_state_while_training_continues(run_dir: Path) -> None:
    spec = make_spec(checkpoint={"async_save": True})
    app = make_app()
    train(app, 2)
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    ckpt.save(2, app)  # async per the spec
    expected = snapshot(app)
    train(app, 3)  # mutates parameters and counters in place while the write may still run
    ckpt.wait()
    ckpt.close()
    saved = [e for e in events(run_dir) if e["event"] == "checkpoint_saved"][0]
    assert saved["async"] is True and saved["stall_s"] <= saved["duration_s"]
    fresh = make_app(seed=5)
    assert resume(spec, run_dir, fresh) == 2
    assert_same(snapshot(fresh), expected)


def test_preemption_signal_triggers_immediate_blocking_save(run_dir: Path) -> None:
    spec = make_spec(checkpoint={"interval_steps": 1000, "async_save": True})
    before = signal.getsignal(signal.SIGUSR1)
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    app = make_app()
    train(app, 3)
    assert not ckpt.should_save(3)
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):  # delivery is asynchronous: poll, never sleep
        if ckpt.preemption.received:
            break
    assert ckpt.preemption.received == "SIGUSR1"
    assert ckpt.should_save(3) and ckpt.preempt_requested
    ckpt.save(3, app)  # blocking despite async_save: the process is about to exit
    assert (run_dir / "checkpoints" / "step-00000003" / "COMMIT").exists()
    assert not ckpt.should_save(3)
    ckpt.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert names(run_dir)[:2] == ["preemption_requested", "checkpoint_save_started"]


def test_young_daly_interval_and_auto_retune(run_dir: Path) -> None:
    # Daly's higher-order optimum (the planner's): √(2δM)·(1 + √(δ/2M)/3 + δ/(18M)) − δ ≈ Young's √(2δM).
    assert young_daly_interval_s(save_s=50.0, mtbf_s=10_000.0) == pytest.approx(
        1000.0 * (1 + 0.05 / 3 + 0.0025 / 9) - 50.0)
    assert young_daly_interval_s(save_s=1e-3, mtbf_s=1e5) == pytest.approx((2 * 1e-3 * 1e5) ** 0.5, rel=1e-3)
    mtbf = job_mtbf_s(failures_per_gpu_day=None, num_gpus=16384)
    assert mtbf == pytest.approx(54 * 86400 / 419)  # Llama 3: 419 interruptions in 54 days
    assert abs(LLAMA3_FAILURES_PER_GPU_DAY - 4.736e-4) < 1e-6
    now = [0.0]
    spec = make_spec(checkpoint={"interval_steps": "auto"}, fault={"failures_per_gpu_day": 8640.0})
    # 8640 failures per GPU-day: M = 10 s; with δ = 0.2 s the interval is 2·(1 + 0.1/3 + 0.01/9) − 0.2 s.
    ckpt = CheckpointManager(spec, run_dir=run_dir, expected_save_s=0.2, clock=lambda: now[0])
    expected_s = 2.0 * (1 + 0.1 / 3 + 0.01 / 9) - 0.2
    assert ckpt.auto is not None and ckpt.auto.interval_s == pytest.approx(expected_s)
    now[0] = expected_s - 0.1
    assert not ckpt.should_save(1)
    now[0] = expected_s + 0.1
    assert ckpt.should_save(2)
    app = make_app()

    def slow_clock() -> float:  # the save "takes" 0.8 s of the injected clock
        now[0] += 0.4
        return now[0]

    ckpt.clock = slow_clock
    ckpt.save(2, app, blocking=True)
    assert ckpt.auto.save_s == pytest.approx(0.8, abs=0.41)  # measured δ replaces the estimate
    assert ckpt.auto.interval_s == pytest.approx(young_daly_interval_s(save_s=ckpt.auto.save_s, mtbf_s=10.0))
    ckpt.close()
    kinds = names(run_dir)
    assert kinds[0] == "checkpoint_interval" and "checkpoint_saved" in kinds


def test_same_step_is_not_saved_twice(run_dir: Path) -> None:
    """A resumed run skips re-saving the step it resumed from; a run that did not resume from that folder (it
    holds another timeline's state) replaces it instead of keeping it."""
    spec = make_spec()
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    ckpt.save(2, app, blocking=True)
    ckpt.close()
    again = CheckpointManager(spec, run_dir=run_dir)
    assert again.load_latest(make_app(1)) == 2
    again.save(2, app, blocking=True)
    again.close()
    assert names(run_dir).count("checkpoint_saved") == 1 and "checkpoint_skipped" in names(run_dir)
    fresh = CheckpointManager(spec, run_dir=run_dir)  # started over without resuming: step 2 is not its own
    fresh.save(2, make_app(2), blocking=True)
    fresh.close()
    assert names(run_dir).count("checkpoint_saved") == 2
    assert any(e["event"] == "checkpoint_deleted" and "another timeline" in e["reason"] for e in events(run_dir))
    loaded = make_app(3)
    assert resume(spec, run_dir, loaded) == 2
    assert torch.equal(loaded["model"][0].weight, make_app(2)["model"][0].weight)


class Sampler:
    """The sampler's checkpoint surface: one integer position."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"global_sample_index": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["global_sample_index"]


def test_trainer_hook_saves_on_interval_and_resumes_counters(run_dir: Path) -> None:
    from types import SimpleNamespace

    from leantrain.ckpt.hook import TrainerCheckpointer

    def make_trainer(seed: int) -> SimpleNamespace:
        app = make_app(seed)
        return SimpleNamespace(spec=make_spec(), run_dir=run_dir, runtime=SimpleNamespace(rank=0, world_size=1),
                               model=app["model"], optimizer=app["optimizer"], scheduler=app["scheduler"],
                               sampler=Sampler(), step=0, tokens_seen=0, skipped_steps=0)

    trainer = make_trainer(0)
    hook = TrainerCheckpointer(trainer)
    assert not hook.load_latest(trainer)
    for _ in range(3):
        trainer.step += 1
        trainer.tokens_seen += 10
        trainer.sampler.position += 4
        hook.maybe_save(trainer, force=trainer.step == 3)
    hook.close()
    assert [e["step"] for e in events(run_dir) if e["event"] == "checkpoint_saved"] == [2, 3]
    again = make_trainer(1)
    hook2 = TrainerCheckpointer(again)
    assert hook2.load_latest(again)
    hook2.close()
    assert (again.step, again.tokens_seen, again.sampler.position) == (3, 30, 12)
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), again.model.parameters(), strict=True))


def test_condemned_folder_stays_until_a_good_save_replaces_it(run_dir: Path) -> None:
    """A lost commit marker may hide good data: the folder is kept through a failed save of its step and
    replaced only by that step's committed save."""
    spec = make_spec()
    store = FailingStore(run_dir / "checkpoints", budget_bytes=100)
    ckpt = CheckpointManager(spec, run_dir=run_dir, store=store)
    app = make_app()
    for step in (2, 4):
        train(app, 2)
        ckpt.save(step, app, blocking=True)
    ckpt.close()
    lost = run_dir / "checkpoints" / "step-00000004"
    (lost / "COMMIT").unlink()
    kept = {p.name: p.read_bytes() for p in lost.iterdir()}
    fresh = make_app(seed=1)
    ckpt = CheckpointManager(spec, run_dir=run_dir, store=store)
    assert ckpt.load_latest(fresh) == 2
    train(fresh, 2)
    store.armed = True
    with pytest.raises(CheckpointSaveError):
        ckpt.save(4, fresh, blocking=True)
    assert {p.name: p.read_bytes() for p in lost.iterdir()} == kept  # untouched by the failed save
    store.armed = False
    ckpt.save(4, fresh, blocking=True)
    ckpt.close()
    assert (lost / "COMMIT").is_file() and resume(spec, run_dir, make_app(seed=2)) == 4


def private_manager_uses(source: str) -> list[str]:
    """`manager._x` / `self.manager._x` / `mgr._x` in Python source: a reach into the manager's private state."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("manager", "mgr"):
                found.append(f"{node.lineno}: {name}.{node.attr}")
    return found


def test_the_loader_hook_and_tiers_use_the_managers_public_interface() -> None:
    """The loader, the trainer's hook, the fast tier and the fault hook reach the manager only through its
    public methods (agree, highest, read_on_rank0, load_group, sealed_fs, adopt_group, ...), never its
    private groups or file system."""
    assert private_manager_uses("x = self.manager._control_pg\nmanager._agree(1)\nmgr.agree(1)\n") == [
        "1: manager._control_pg", "2: manager._agree"]
    ckpt = Path(__file__).resolve().parents[1] / "src" / "leantrain" / "ckpt"
    offenders = {p.name: uses for p in sorted(ckpt.glob("*.py")) if p.name != "manager.py"
                 if (uses := private_manager_uses(p.read_text(encoding="utf-8")))}
    assert offenders == {}


def test_a_run_dir_that_cannot_take_an_event_does_not_fail_the_save(run_dir: Path, caplog: Any) -> None:
    """events.jsonl that cannot be appended to (the run dir's volume full or read-only, checkpoints stored
    elsewhere) raised out of rank 0's save between its agreed steps, leaving the other ranks in the save's
    collectives, and out of the failure path as a traceback. The event is lost with a warning; the save stands."""
    ckpt = CheckpointManager(make_spec(), run_dir=run_dir)
    (run_dir / "events.jsonl").unlink(missing_ok=True)
    (run_dir / "events.jsonl").mkdir()  # appending to it raises IsADirectoryError, an OSError
    app = make_app()
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    ckpt.close()
    assert (run_dir / "checkpoints" / "step-00000002" / "COMMIT").is_file()
    warnings = [r.getMessage() for r in caplog.records if "events.jsonl: cannot append" in r.getMessage()]
    assert len(warnings) == 1
