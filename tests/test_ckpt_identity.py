"""A checkpoint is known by its manifest: a misnamed folder is refused by name, another model's checkpoint is
named and skipped for the run's own newest, a checkpoints path that is a file is one line (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from leantrain.ckpt import CheckpointManager
from leantrain.ckpt.errors import CheckpointLoadError
from leantrain.ckpt.identity import identity_problem, model_identity
from leantrain.cli import main
from leantrain.errors import UserInputError
from test_ckpt_manager import assert_same, events, make_app, make_spec, snapshot, train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
THIS = {"shape": {"n_layers": 1, "d_model": 16}, "fingerprint": "aaaa"}
OTHER = {"shape": {"n_layers": 3, "d_model": 16}, "fingerprint": "bbbb"}


def manager(run_dir: Path, identity: dict[str, Any]) -> CheckpointManager:
    ckpt = CheckpointManager(make_spec(), run_dir=run_dir)
    ckpt.model_identity = identity
    ckpt.manifest_extra = lambda _step: {"model": identity}
    return ckpt


def test_the_fingerprint_follows_the_model_not_the_rest_of_the_spec() -> None:
    base = model_identity(make_spec())
    assert base == model_identity(make_spec(training={"lr": 1e-2}, checkpoint={"keep_last": 9}))
    assert base["fingerprint"] != model_identity(make_spec(model={"n_layers": 2}))["fingerprint"]
    assert base["shape"]["n_layers"] == 1
    assert identity_problem(folder_step=4, manifest={"step": 4}, expected=base) is None  # an older manifest


def test_a_renamed_folder_is_refused_by_name_and_the_run_falls_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = manager(run_dir, THIS)
    app = make_app()
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    expected = snapshot(app)
    train(app, 2)
    ckpt.save(4, app, blocking=True)
    ckpt.close()
    root = run_dir / "checkpoints"
    (root / "step-00000004").rename(root / "step-00000006")  # would resume at 6 and skip two steps
    fresh, loaded = manager(run_dir, THIS), make_app(seed=5)
    assert fresh.load_latest(loaded) == 2
    fresh.close()
    assert_same(snapshot(loaded), expected)
    misnamed = [e for e in events(run_dir) if e["event"] == "checkpoint_misnamed"]
    assert misnamed and misnamed[0]["step"] == 6 and misnamed[0]["saved_step"] == 4
    assert "manifest says step 4" in misnamed[0]["reason"] and "step-00000006" in misnamed[0]["folder"]
    assert not (root / "step-00000006" / "CORRUPT").exists()  # named, never condemned

    shutil.rmtree(root / "step-00000002")
    only = manager(run_dir, THIS)
    with pytest.raises(CheckpointLoadError) as refused:
        only.load_latest(make_app(seed=6))
    only.close()
    assert "step-00000006" in str(refused.value) and "manifest says step 4" in str(refused.value)
    assert refused.value.exit_code == 2


def test_a_refusal_is_its_one_line_error_and_a_fallback_still_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Two folders swapped (each manifest names the other's step): the refusal names both and is the only line
    on the console (the skipped checkpoints' warnings were held); a fallback that loads still shows them."""
    run_dir = tmp_path / "run"
    ckpt = manager(run_dir, THIS)
    app = make_app()
    for at in (2, 4):
        train(app, 2)
        ckpt.save(at, app, blocking=True)
    ckpt.close()
    root = run_dir / "checkpoints"
    (root / "step-00000002").rename(root / "x")
    (root / "step-00000004").rename(root / "step-00000002")
    (root / "x").rename(root / "step-00000004")
    caplog.set_level("WARNING", logger="leantrain.ckpt")
    refused_run = manager(run_dir, THIS)
    with pytest.raises(CheckpointLoadError) as refused:
        refused_run.load_latest(make_app(seed=6))
    refused_run.close()
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert "step-00000002" in str(refused.value) and "step-00000004" in str(refused.value)
    assert not [r for r in caplog.records if r.name == "leantrain.ckpt" and "checkpoint_" in r.getMessage()]
    assert [e["event"] for e in events(run_dir)].count("checkpoint_misnamed") == 2  # still in events.jsonl

    shutil.rmtree(root / "step-00000004")  # the folder named 2 (holding step 4) is left: refused, nothing good
    (root / "step-00000002").rename(root / "step-00000004")  # now named right: loads after a misnamed one
    shutil.copytree(root / "step-00000004", root / "step-00000006")
    fallback = manager(run_dir, THIS)
    assert fallback.load_latest(make_app(seed=7)) == 4
    fallback.close()
    shown = [r.getMessage() for r in caplog.records if r.name == "leantrain.ckpt"]
    assert any(m.startswith("checkpoint_misnamed:") and "step-00000006" in m for m in shown)


def test_another_models_checkpoint_is_skipped_for_the_runs_own_and_kept(tmp_path: Path) -> None:
    run_dir, other_dir = tmp_path / "run", tmp_path / "other"
    ours = manager(run_dir, THIS)
    app = make_app()
    train(app, 2)
    ours.save(2, app, blocking=True)
    ours.close()
    theirs = manager(other_dir, OTHER)
    train(app, 2)
    theirs.save(4, app, blocking=True)
    theirs.close()
    root = run_dir / "checkpoints"
    shutil.copytree(other_dir / "checkpoints" / "step-00000004", root / "step-00000004")

    resumed = manager(run_dir, THIS)
    fresh = make_app(seed=7)
    assert resumed.load_latest(fresh) == 2
    other = [e for e in events(run_dir) if e["event"] == "checkpoint_other_model"]
    assert other and other[0]["step"] == 4 and "another model (n_layers 3" in other[0]["reason"]
    assert [e for e in events(run_dir) if e["event"] == "checkpoint_fallback"][0]["to_step"] == 2
    assert not (root / "step-00000004" / "CORRUPT").exists()  # not abandoned either: it is not ours
    train(fresh, 2)
    resumed.save(4, fresh, blocking=True)  # this run's step 4: the other model's folder is moved aside, kept
    resumed.close()
    aside = [p for p in root.iterdir() if p.name.startswith("foreign-step-00000004")]
    assert len(aside) == 1 and json.loads((aside[0] / "manifest.json").read_text())["model"] == OTHER
    assert json.loads((root / "step-00000004" / "manifest.json").read_text())["model"] == THIS
    assert "checkpoint_moved_aside" in [e["event"] for e in events(run_dir)]


def test_a_checkpoints_path_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder")
    with pytest.raises(UserInputError, match=r"checkpoint location .*checkpoints is a file, not a folder"):
        CheckpointManager(make_spec(), run_dir=run_dir)
    blocked = tmp_path / "blocked"
    blocked.write_text("x")
    with pytest.raises(UserInputError, match="cannot create it"):
        CheckpointManager(make_spec(checkpoint={"url": str(blocked / "ckpts")}), run_dir=run_dir)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("identity") / "data"
    assert main(["prepare", str(EXAMPLES / "tiny-cpu.yaml"), "--out", str(out)]) == 0
    return out


def _train(data_dir: Path, run_dir: Path, *sets: str) -> list[str]:
    extra = [a for s in sets for a in ("--set", s)]
    return ["train", str(EXAMPLES / "tiny-cpu.yaml"), "--set", f"data.dir={data_dir}", "--set",
            "checkpoint.interval_steps=4", "--set", "checkpoint.async_save=false", "--set", "security.audit_log=false",
            *extra, "--run-dir", str(run_dir), "--max-steps", "12"]


def test_train_resumes_past_another_models_checkpoint(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    assert main(_train(data_dir, run)) == 0
    assert main(_train(data_dir, other, "model.n_layers=1")) == 0
    root = run / "checkpoints"
    shutil.rmtree(root / "step-00000012")  # this run's step 12 lost (a crash before it committed) ...
    shutil.copytree(other / "checkpoints" / "step-00000012", root / "step-00000012")  # ... another model's there
    (run / "events.jsonl").unlink()
    capsys.readouterr()
    assert main(_train(data_dir, run)) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    names = [r.get("event", r.get("kind")) for r in records]
    assert "checkpoint_other_model" in names and "checkpoint_moved_aside" in names
    loaded = [r for r in records if r.get("event") == "checkpoint_loaded"]
    assert loaded[0]["step"] == 8
    manifest = json.loads((root / "step-00000012" / "manifest.json").read_text())
    assert manifest["model"]["shape"]["n_layers"] != 1
