"""The drill's judgement (no processes): kill-step choice, loss comparison, verdict and drill.json numbers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from leantrain.ckpt.fault import MARKER_FILE, FaultPlan
from leantrain.errors import CheckFailed, UserInputError
from leantrain.golive import drill
from leantrain.golive.drill import analyse, choose_kill_step, compare_losses, losses_by_step


def write_run(
    run_dir: Path, losses: list[tuple[int, float]], *, events: list[dict[str, Any]] | None = None, marker: bool = False
) -> Path:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": v, "step_time_s": 0.1}) for s, v in losses]
    lines.append(json.dumps({"step": 6, "eval_loss": 3.0}))  # evaluation records are not training losses
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n{torn")
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events or []))
    if marker:
        (run_dir / MARKER_FILE).write_text(json.dumps({"step": 4, "attempt": 0, "time": 0.0}))
    return run_dir


REFERENCE = [(s, 4.0 - 0.1 * s) for s in range(1, 7)]
RESTART = {"kind": "restart", "attempt": 1, "resumed_from": 2, "recovery_s": 3.0, "planned": True}
RUNS_OK = {"reference": {"exit_code": 0, "wall_s": 5.0}, "faulted": {"exit_code": 0, "wall_s": 9.0}}


def test_kill_step_is_checked_or_drawn_after_the_first_checkpoint() -> None:
    assert choose_kill_step(kill_at=7, max_steps=60, interval=20, corrupt_latest=False, rng=random.Random(0)) == 7
    with pytest.raises(UserInputError, match="--kill-at 60"):
        choose_kill_step(kill_at=60, max_steps=60, interval=20, corrupt_latest=False, rng=random.Random(0))
    drawn = {choose_kill_step(kill_at=None, max_steps=60, interval=20, corrupt_latest=False, rng=random.Random(i))
             for i in range(50)}
    assert min(drawn) >= 21 and max(drawn) <= 59 and len(drawn) > 5
    corrupt = {choose_kill_step(kill_at=None, max_steps=60, interval=20, corrupt_latest=True, rng=random.Random(i))
               for i in range(50)}
    assert min(corrupt) >= 41  # two checkpoints exist: the newest is damaged, the older one is resumed


def test_loss_comparison_covers_every_record_including_redone_steps() -> None:
    reference = {1: [3.0], 2: [2.5], 3: [2.0]}
    assert compare_losses(reference, {1: [3.0], 2: [2.5], 3: [2.0, 2.0]}, tolerance=0.0) == (0.0, None)
    diff, problem = compare_losses(reference, {1: [3.0], 2: [2.5], 3: [2.01, 2.0]}, tolerance=0.0)
    assert diff == pytest.approx(0.01) and "step 3" in problem  # the pre-kill record differs
    assert compare_losses(reference, {1: [3.0], 2: [2.5], 3: [2.01]}, tolerance=0.01)[1] is None
    assert "never logged" in compare_losses(reference, {1: [3.0]}, tolerance=0.0)[1]


def test_a_recovered_run_passes_with_recovery_steps_lost_and_goodput(tmp_path: Path) -> None:
    reference = write_run(tmp_path / "ref", REFERENCE)
    faulted = write_run(tmp_path / "faulted", REFERENCE[:4] + REFERENCE[2:], events=[RESTART], marker=True)
    assert losses_by_step(json.loads(x) for x in (faulted / "metrics.jsonl").read_text().splitlines()[:1]) == {
        1: [3.9]}
    result = analyse(reference_dir=reference, faulted_dir=faulted, plan=FaultPlan(kill_at_step=4), max_steps=6,
                     deterministic=True, runs=RUNS_OK, corrupt_latest=False)
    assert result["passed"] and result["reason"] is None
    assert (result["steps_lost"], result["recovery_s"], result["max_loss_diff"]) == (2, 3.0, 0.0)
    # goodput = 6 steps × 0.1 s / (0.6 s + 3 s recovery + 2 redone steps × 0.1 s)
    assert result["goodput"] == pytest.approx(0.6 / 3.8)


@pytest.mark.parametrize("problem", ["no_restart", "diverged", "crashed", "undetected_corruption"])
def test_a_drill_fails_for_each_missing_guarantee(tmp_path: Path, problem: str) -> None:
    reference = write_run(tmp_path / "ref", REFERENCE)
    losses = list(REFERENCE)
    if problem == "diverged":
        losses[-1] = (6, losses[-1][1] + 1e-6)
    faulted = write_run(tmp_path / "faulted", losses, events=[] if problem == "no_restart" else [RESTART],
                        marker=True)
    runs = {**RUNS_OK, "faulted": {"exit_code": 1, "wall_s": 9.0}} if problem == "crashed" else RUNS_OK
    result = analyse(reference_dir=reference, faulted_dir=faulted, plan=FaultPlan(kill_at_step=4), max_steps=6,
                     deterministic=True, runs=runs, corrupt_latest=problem == "undetected_corruption")
    assert not result["passed"]
    expected = {"no_restart": "no restart event", "diverged": "differs from the reference",
                "crashed": "did not recover", "undetected_corruption": "was not detected"}[problem]
    assert expected in result["reason"]


def test_cli_entry_raises_check_failed_on_a_failed_drill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = {"passed": False, "reason": "no restart event was recorded", "drill_file": str(tmp_path / "d.json"),
              "kill_rank": 1, "kill_at": 4, "during_save": False, "corrupt_latest": False, "num_restarts": 0,
              "resumed_from": None, "recovery_s": None, "steps_lost": None, "goodput": None,
              "max_loss_diff": 0.0, "loss_tolerance": 0.0, "reference_wall_s": 1.0, "faulted_wall_s": 1.0}
    monkeypatch.setattr(drill, "run_drill", lambda *a, **k: failed)
    console = Console(file=None, record=True, width=200)
    with pytest.raises(CheckFailed, match="no restart event"):
        drill.run(console=console, spec=_spec(tmp_path), spec_path=tmp_path / "s.yaml", overrides=[], profile=None,
                  run_dir=tmp_path, kill_at=4, during_save=False, corrupt_latest=False)
    assert "FAIL" in console.export_text()


def _spec(tmp_path: Path) -> Any:
    from leantrain.demo_context import DEMO_SPEC
    from leantrain.spec import load_spec

    return load_spec(DEMO_SPEC, overrides=[f"run.dir={tmp_path}"])


def test_each_drill_run_gets_its_own_checkpoint_location(tmp_path: Path) -> None:
    """checkpoint.url set: the reference and faulted runs keep their checkpoints under the drill's run dir
    (local) or under a sibling prefix of the job's (object store), never in the job's location."""
    from leantrain.golive.drill import drill_checkpoint_url
    from leantrain.spec import spec_from_dict

    drill_dir = tmp_path / "run" / "drill"
    base = {"model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32,
                      "vocab_size": 64}, "data": {"tokens_total": 1e4, "seq_len": 8}}
    plain = spec_from_dict(base)
    assert drill_checkpoint_url(plain, drill_dir=drill_dir, name="faulted") is None  # run dirs differ already
    local = spec_from_dict({**base, "checkpoint": {"url": "/shared/job/ckpts"}})
    urls = {name: drill_checkpoint_url(local, drill_dir=drill_dir, name=name) for name in ("reference", "faulted")}
    assert urls == {name: str(drill_dir / name / "checkpoints") for name in urls}
    s3 = spec_from_dict({**base, "checkpoint": {"storage": "object_store", "url": "s3://bucket/jobs/llama"}})
    urls = {name: drill_checkpoint_url(s3, drill_dir=drill_dir, name=name) for name in ("reference", "faulted")}
    assert urls == {"reference": "s3://bucket/jobs/llama.drill/run/reference",
                    "faulted": "s3://bucket/jobs/llama.drill/run/faulted"}
    assert not any(u.startswith("s3://bucket/jobs/llama/") for u in urls.values())


def test_progress_lines_while_a_drill_run_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import time

    monkeypatch.setattr(drill, "PROGRESS_EVERY_S", 0.05)
    out = Console(file=io.StringIO(), width=200)
    metrics = tmp_path / "metrics.jsonl"
    with drill._progress(out, name="faulted", run_dir=tmp_path, max_steps=40):
        for steps in ([5, 6], [3]):  # the second attempt resumes from an earlier checkpoint
            with metrics.open("a") as f:
                f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)
            time.sleep(0.3)
    text = out.file.getvalue()
    assert "drill: faulted run at step 6 of 40" in text
    assert "drill: faulted run at step 3 of 40 (restarted from a checkpoint)" in text


def _finished_run(run_dir: Path, spec: Any, *, losses: list[tuple[int, float]], world_size: int = 2,
                  events: list[dict[str, Any]] | None = None) -> Path:
    import yaml

    write_run(run_dir, losses, events=events)
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    (run_dir / "train_info.json").write_text(json.dumps({"world_size": world_size, "max_steps": losses[-1][0]}))
    (run_dir / "lineage.json").write_text(json.dumps({"run_id": "r", "attempt": 0, "code": _code()}))
    return run_dir


def _code() -> dict[str, Any]:
    from leantrain.provenance.lineage import code_info

    return code_info()


def test_a_finished_run_of_the_same_training_can_be_the_reference(tmp_path: Path) -> None:
    from leantrain.golive.drill import reusable_reference

    spec = _spec(tmp_path)
    same = _finished_run(tmp_path / "same", spec, losses=REFERENCE)
    assert reusable_reference(same, spec=spec, nproc=2, max_steps=6) is None
    # what does not decide a loss may differ (the drill's own checkpoint cadence and run dir)
    other_dir = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"interval_steps": 3})})
    assert reusable_reference(same, spec=other_dir, nproc=2, max_steps=6) is None
    lr = spec.model_copy(update={"training": spec.training.model_copy(update={"lr": 1e-4})})
    assert "differs in training" in reusable_reference(same, spec=lr, nproc=2, max_steps=6)
    assert "on 2 ranks, the drill needs 6 on 4" in reusable_reference(same, spec=spec, nproc=4, max_steps=6)
    short = _finished_run(tmp_path / "short", spec, losses=REFERENCE[:4])
    assert "ran 4 steps" in reusable_reference(short, spec=spec, nproc=2, max_steps=6)
    restarted = _finished_run(tmp_path / "restarted", spec, losses=REFERENCE, events=[RESTART])
    assert "restarted" in reusable_reference(restarted, spec=spec, nproc=2, max_steps=6)
    assert "no finished run" in reusable_reference(tmp_path / "nothing", spec=spec, nproc=2, max_steps=6)
    # a damaged run dir is no reference, said so (an AttributeError or ValueError before)
    for name, text in (("spec.yaml", "[]"), ("train_info.json", "[1]")):
        broken = _finished_run(tmp_path / f"broken-{name}", spec, losses=REFERENCE)
        (broken / name).write_text(text)
        assert "not a mapping" in reusable_reference(broken, spec=spec, nproc=2, max_steps=6)
    # a run that other code trained, or that was started again after it finished, may hold other code's losses
    # (make demo run again after an upgrade drilled against the old version's losses and failed)
    for name, lineage in (("upgraded", {"run_id": "r", "code": {"package_version": "0.0.1", "git": None}}),
                          ("again", {"run_id": "r", "code": _code(), "previous_attempts": [{"attempt": 0}]})):
        old_code = _finished_run(tmp_path / name, spec, losses=REFERENCE)
        (old_code / "lineage.json").write_text(json.dumps(lineage))
        assert "other code" in reusable_reference(old_code, spec=spec, nproc=2, max_steps=6) or \
            "another version" in reusable_reference(old_code, spec=spec, nproc=2, max_steps=6)
    (old_code / "lineage.json").unlink()
    assert "is missing" in reusable_reference(old_code, spec=spec, nproc=2, max_steps=6)
    odd = _finished_run(tmp_path / "odd", spec, losses=REFERENCE)
    with (odd / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": "x", "loss": 1}\n[1]\n{"step": 7}\n')
    assert reusable_reference(odd, spec=spec, nproc=2, max_steps=6) is None


@pytest.mark.parametrize("reusable", [True, False])
def test_the_drill_launches_only_the_faulted_run_when_it_reuses_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reusable: bool
) -> None:
    """With a reusable reference one torchrun launch (the faulted run) instead of two; otherwise both."""
    spec = _spec(tmp_path).model_copy(deep=True)
    spec.data.dir = tmp_path / "data"
    spec.data.dir.mkdir()
    (spec.data.dir / "manifest.json").write_text("{}")  # the drill prepares no data
    steps = [(s, 4.0 - 0.01 * s) for s in range(5, 61, 5)]
    train_run = _finished_run(tmp_path / "run", spec, losses=steps, world_size=2 if reusable else 1)
    launched: list[str] = []

    def fake_launch(spec: Any, *, train: Any, run_dir: Path, **_: Any) -> int:
        launched.append(run_dir.name)
        faulted = run_dir.name == "faulted"
        write_run(run_dir, steps[:5] + steps[3:] if faulted else steps,
                  events=[{**RESTART, "resumed_from": 20}] if faulted else [], marker=faulted)
        return 0

    monkeypatch.setattr(drill, "launch_local", fake_launch)
    out = Console(file=None, record=True, width=200)
    result = drill.run_drill(spec, spec_path=tmp_path / "s.yaml", overrides=[], profile=None, run_dir=train_run,
                             kill_at=22, during_save=False, corrupt_latest=False, console=out,
                             reference_run=train_run)
    assert result["passed"], result["reason"]
    assert launched == (["faulted"] if reusable else ["reference", "faulted"])
    assert result["reference_reused"] is reusable
    assert result["reference_dir"] == str(train_run.resolve() if reusable else train_run / "drill" / "reference")
    drill.render(result, console=out)
    assert ("reference reused" in out.export_text()) is reusable


def test_the_drill_logs_so_that_every_checkpoint_starts_a_logging_window(tmp_path: Path) -> None:
    """A logged loss is the mean since the previous record: with a checkpoint every 2 steps and a record every 5,
    the run resumed at step 2 logged steps 3-4 where the reference logged 1-4 at step 4, and the drill failed a
    run that had resumed exactly (loss diff 0.025). The drill runs now log every gcd(log_every, intervals)."""
    from leantrain.golive.drill import _interval_steps, drill_log_every, reusable_reference

    spec = _spec(tmp_path)  # log_every 5
    with_interval = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"interval_steps": 2})})
    assert drill_log_every(with_interval, interval=2) == 1
    assert _interval_steps(with_interval, 4) == (2, ["monitoring.log_every=1"])
    assert drill_log_every(spec, interval=10) == 5 and drill_log_every(spec, interval=15) == 5
    tier = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"memory_interval_steps": 3})})
    assert drill_log_every(tier, interval=10) == 1
    finished = _finished_run(tmp_path / "run", spec, losses=REFERENCE)  # logged every 5
    assert reusable_reference(finished, spec=spec, nproc=2, max_steps=6, log_every=5) is None
    assert "logged every 5 step(s), the drill every 1" in reusable_reference(
        finished, spec=spec, nproc=2, max_steps=6, log_every=1)


@pytest.mark.parametrize("under", [False, True])
def test_a_run_dir_that_is_a_file_is_refused_before_any_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               under: bool) -> None:
    """`drill --run-dir FILE` (or a path under a file) ran the reference and the faulted launch, each failing with
    NotADirectoryError, then pointed at rank logs that could not exist."""
    from leantrain.cli import main

    spec = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    run_dir = file / "drill-run" if under else file
    assert main(["drill", str(spec), "--run-dir", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert f"run dir {run_dir}: " in captured.err and "is a file, not a directory" in captured.err
    assert "drill:" not in captured.out and "Traceback" not in captured.err
    assert file.read_text() == "mine\n"
