"""`leantrain validate`: a healthy run passes; each broken run fails for the right reason, with evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from leantrain.cli import main
from leantrain.errors import CheckFailed, UserInputError
from leantrain.golive.validate import run as validate_command
from leantrain.golive.validate import validate_run, verdict
from test_observe_scenarios import GiB, make_run


def _by_name(run_dir: Path, **kwargs: object) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.evidence) for c in validate_run(run_dir, **kwargs)}  # type: ignore[arg-type]


def test_healthy_run_passes_and_writes_json(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    out = tmp_path / "verdict.json"
    checks = validate_command(console=Console(file=open(tmp_path / "out.txt", "w")), run_dir=run_dir,  # noqa: SIM115
                              plan_file=None, baseline=run_dir, json_out=out)
    assert verdict(checks) == "PASS"
    data = json.loads(out.read_text())
    assert data["verdict"] == "PASS"
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert all(s == "PASS" for s in statuses.values()), statuses
    assert {"every rank reported", "loss falling", "tokens/s vs plan", "MFU vs plan", "fault drill",
            "peak under limit with headroom", "communication share", "matches baseline"} <= set(statuses)


@pytest.mark.parametrize(("scenario", "check", "evidence"), [
    ("nan", "loss and grad norm finite", "non-finite loss at steps [22]"),
    ("spike", "no loss spikes", "robust z"),
    ("data_bound", "tokens/s vs plan", "data-bound"),
    ("data_bound", "MFU vs plan", "data-bound"),
    ("oom", "peak under limit with headroom", "out-of-memory"),
    ("oom", "no errors", "OutOfMemoryError"),
    ("resume_jump", "no unexpected restarts", "1 unexpected"),
])
def test_problem_runs_fail_for_the_right_reason(tmp_path: Path, scenario: str, check: str, evidence: str) -> None:
    checks = _by_name(make_run(tmp_path, scenario))
    status, text = checks[check]
    assert status == "FAIL" and evidence in text, (status, text)


def test_missing_rank_baseline_mismatch_and_failed_drill(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        record["rank_step_time_s"] = [record["step_time_s"]]  # rank 1 never reported
        record["loss"] *= 1.3
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "events.jsonl").write_text("")
    (run_dir / "drill.json").write_text(json.dumps({"passed": False, "reason": "loss curve not continuous"}))
    checks = _by_name(run_dir, baseline=make_run(tmp_path / "base", "healthy"))
    assert checks["every rank reported"] == ("FAIL", "missing ranks [1] of 2")
    assert checks["matches baseline"][0] == "FAIL" and "30.0%" in checks["matches baseline"][1]
    assert checks["fault drill"][0] == "FAIL" and "not continuous" in checks["fault drill"][1]


def test_plan_flag_overrides_and_cli_exit_codes(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    assert main(["validate", str(run_dir)]) == 0
    fast_plan = tmp_path / "fast-plan.json"
    plan = json.loads((run_dir / "plan.json").read_text())
    plan["throughput"]["tokens_per_s"] *= 3
    fast_plan.write_text(json.dumps(plan))
    checks = _by_name(run_dir, plan_file=fast_plan)
    assert checks["tokens/s vs plan"][0] == "FAIL"
    assert "neither data nor communication" in checks["tokens/s vs plan"][1]
    assert main(["validate", str(run_dir), "--plan", str(fast_plan)]) == 1
    assert main(["validate", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(CheckFailed, match="validation failed: .*no loss spikes"):
        validate_command(console=Console(quiet=True), run_dir=make_run(tmp_path, "spike"))
    with pytest.raises(UserInputError, match="--plan"):
        validate_run(run_dir, plan_file=tmp_path / "missing.json")
    for text, said in (("{cut", "not valid JSON"), ("[1]", "expected a JSON object, got a list")):
        (tmp_path / "bad-plan.json").write_text(text)
        with pytest.raises(UserInputError, match=f"--plan {tmp_path / 'bad-plan.json'}: {said}"):
            validate_run(run_dir, plan_file=tmp_path / "bad-plan.json")
    # A plan made for another job (another model or accelerator) judged this run against its targets without a
    # word (a false FAIL; alert-rules wrote its MFU floor): refused naming the fields.
    other_plan = tmp_path / "other-plan.json"
    plan["model"] = {"n_layers": 999}
    plan["resources"]["accelerator"] = "A100-80GB"
    other_plan.write_text(json.dumps(plan))
    with pytest.raises(UserInputError, match=r"planned for another job \(hardware.accelerator A100-80GB → H100-SXM"):
        validate_run(run_dir, plan_file=other_plan)
    from leantrain.observe.prometheus import rules_yaml
    from leantrain.spec import load_spec

    tiny = load_spec(Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml")
    with pytest.raises(UserInputError, match=r"planned for another job \(model.n_layers 999 → 2; "
                                             r"hardware.accelerator A100-80GB → cpu"):
        rules_yaml(tiny, plan_file=other_plan)


def _rank_log(run_dir: Path, *, attempt: int, rank: int, text: str, host: str = "node1") -> Path:
    """Write a line where torchrun puts rank logs: logs/<host>/<run id>/attempt_<k>/<local rank>/stderr.log."""
    path = run_dir / "logs" / host / "none_x1y2" / f"attempt_{attempt}" / str(rank) / "stderr.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("step 10 loss 4.2\n" + text + "\n", encoding="utf-8")
    return path


def _planned_restart(run_dir: Path) -> None:
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": 1.8e9 + 30, "kind": "restart", "step": 40, "planned": True,
                                 "cause": "drill", "recovery_s": 3.1}) + "\n")


def test_membership_change_restart_warns_and_a_failure_beside_it_still_fails(tmp_path: Path) -> None:
    """A restart because a node joined or left (no worker failed, ckpt/attempt.py) is the elastic job working:
    WARN naming it, never an unexpected restart; a worker failure in the same run still fails the check."""
    run_dir = make_run(tmp_path, "healthy")
    (run_dir / "drill.json").unlink()  # no drill: its kills would count as planned restarts
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": 1.8e9 + 30, "kind": "restart", "attempt": 1, "step": 40, "planned": False,
                                 "cause": "membership change", "recovery_s": 9.0}) + "\n")
    status, evidence = _by_name(run_dir)["no unexpected restarts"]
    assert status == "WARN" and "1 membership change(s)" in evidence and "unexpected" not in evidence, evidence
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": 1.8e9 + 60, "kind": "restart", "attempt": 2, "step": 60, "planned": False,
                                 "cause": "worker failure", "recovery_s": 9.0}) + "\n")
    status, evidence = _by_name(run_dir)["no unexpected restarts"]
    assert status == "FAIL" and "1 unexpected" in evidence and "1 membership change" in evidence, evidence


def test_cuda_oom_in_a_torchrun_rank_log_fails(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    assert _by_name(run_dir)["no errors"][0] == "PASS"
    _rank_log(run_dir, attempt=0, rank=3, text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8 GiB")
    checks = _by_name(run_dir)
    status, evidence = checks["no errors"]
    assert status == "FAIL" and "node1 attempt 0 local rank 3 (stderr)" in evidence and "CUDA out of memory" in evidence
    assert checks["peak under limit with headroom"][0] == "FAIL"
    assert main(["validate", str(run_dir)]) == 1
    # A passed drill (drill.json) does not excuse an OOM, not even in the attempt the planned kill ended.
    _planned_restart(run_dir)
    assert _by_name(run_dir)["no errors"][0] == "FAIL"


def test_slurm_and_pod_logs_are_read(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    (run_dir / "slurm-4242.out").write_text("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error\n")
    assert "slurm-4242.out: NCCL error" in _by_name(run_dir)["no errors"][1]
    (run_dir / "slurm-4242.out").unlink()
    (run_dir / "logs" / "pod-seed-worker-2.log").write_text("Segmentation fault (core dumped)\n")
    assert "pod-seed-worker-2.log: Segmentation fault" in _by_name(run_dir)["no errors"][1]


def test_of_many_rank_logs_every_error_counts_and_only_the_newest_keep_a_tail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job of 2,048 nodes leaves 16,384 ranks' stdout and stderr under logs/ (Slurm's and Kubernetes' training
    steps too, since launch.node_run): a 400-line tail of each, kept for `doctor`, came to gigabytes. Every file's
    error lines are still read; the tails only of the MAX_TAIL_FILES newest (3 here)."""
    import os

    from leantrain.observe import logs

    monkeypatch.setattr(logs, "MAX_TAIL_FILES", 3)
    for rank in range(8):
        path = tmp_path / "logs" / "node1" / "job_x" / "attempt_0" / str(rank) / "stderr.log"
        path.parent.mkdir(parents=True)
        path.write_text(f"rank {rank} starting\nRuntimeError: boom\n")
        os.utime(path, (1_000 + rank, 1_000 + rank))
    read = logs.read_logs(tmp_path)
    assert len(read) == 8 and all(log.error_lines == ["RuntimeError: boom"] for log in read)
    assert {log.local_rank: log.tail[0] for log in read if log.tail} == {r: f"rank {r} starting" for r in (5, 6, 7)}


def test_planned_drill_kill_explains_only_its_own_attempt(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    _planned_restart(run_dir)
    # The survivor's broken collective in the attempt the kill ended is the kill's echo.
    _rank_log(run_dir, attempt=0, rank=0, text="RuntimeError: [gloo] Connection closed by peer")
    checks = _by_name(run_dir)
    assert checks["no unexpected restarts"][0] == "PASS"
    assert checks["no errors"][0] == "PASS" and "1 log error line(s) from the planned fault" in checks["no errors"][1]
    # The same error after the restart is a new problem.
    _rank_log(run_dir, attempt=1, rank=0, text="RuntimeError: [gloo] Connection closed by peer")
    status, evidence = _by_name(run_dir)["no errors"]
    assert status == "FAIL" and "attempt 1" in evidence


def test_passed_drill_alone_does_not_excuse_log_errors(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")  # drill.json passed, but no restart happened in this run
    with (run_dir / "logs" / "rank-1.log").open("a") as handle:
        handle.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: rank 1 (SIGKILL)\n")
    assert _by_name(run_dir)["no errors"][0] == "FAIL"
    _planned_restart(run_dir)  # the kill happened here: a line naming the kill signal is its trace
    status, evidence = _by_name(run_dir)["no errors"]
    assert status == "PASS" and "ChildFailedError" in evidence


def test_throughput_tolerance_follows_the_runs_own_spread(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    plan = json.loads((run_dir / "plan.json").read_text())
    plan["throughput"]["tokens_per_s"] *= 1.25  # the run reaches 80 % of the plan: below the 90 % bar
    (run_dir / "plan.json").write_text(json.dumps(plan))
    quiet = _by_name(run_dir)["tokens/s vs plan"]
    assert quiet[0] == "WARN" and "pass ≥ 87% = 90% − 3% for this run's own spread" in quiet[1]  # ±1 % noise
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for i, record in enumerate(lines):  # a noisy shared host: ±12 % from record to record, same median
        record["tokens_per_s"] *= 1.12 if i % 2 else 0.88
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    status, evidence = _by_name(run_dir)["tokens/s vs plan"]
    assert status == "PASS" and "for this run's own spread" in evidence, evidence


def test_communication_share_is_of_the_profiled_step_it_was_measured_in(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in lines:  # comm_s is timed in the window's one profiled (slower) step, here 1.0 s
        record["comm_s"], record["profile_step_s"] = 0.1, 1.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    status, evidence = _by_name(run_dir)["communication share"]
    assert status == "PASS" and "collectives take 10% of the step" in evidence  # not 0.1 / 0.4 s = 25 %
    for record in lines:
        del record["profile_step_s"]  # older runs: the window's step time
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert "take 25%" in _by_name(run_dir)["communication share"][1]


def _rehearsal(params: int, peak: int) -> dict[str, object]:
    memory = {"params": params, "grads": params, "optimizer": 2 * params, "activations": 0, "temp": 0, "peak": peak}
    return {"world_size": 2, "ranks": [{"rank": 0, "memory_bytes": memory}, {"rank": 1, "memory_bytes": memory}]}


@pytest.mark.parametrize(("params", "peak", "ready_status", "peak_status"), [
    (10 * GiB, 56 * GiB, "PASS", "PASS"),  # as rehearsed (the measured 60 GiB peak is 1.07× the rehearsal's)
    (20 * GiB, 56 * GiB, "FAIL", "PASS"),  # the run holds half the parameters the rehearsal said
    (10 * GiB, 30 * GiB, "PASS", "WARN"),  # the run peaks at twice what was rehearsed
])
def test_a_run_is_compared_with_its_rehearsal(tmp_path: Path, params: int, peak: int, ready_status: str,
                                              peak_status: str) -> None:
    from leantrain.observe.report_data import append_event

    run_dir = make_run(tmp_path, "healthy")
    assert "model_ready vs rehearsal" not in _by_name(run_dir)  # no rehearsal.json: no such check
    append_event(run_dir, "model_ready", ranks=[{"rank": r, "param_bytes_local": 10 * GiB} for r in (0, 1)])
    (run_dir / "rehearsal.json").write_text(json.dumps(_rehearsal(params, peak)))
    checks = _by_name(run_dir)
    assert checks["model_ready vs rehearsal"][0] == ready_status, checks["model_ready vs rehearsal"]
    assert checks["step peak vs rehearsal"][0] == peak_status, checks["step peak vs rehearsal"]


@pytest.mark.parametrize(("name", "content", "check", "status", "named"), [
    ("plan.json", '{"throughput": {"tokens_per_s": 1e5', "tokens/s vs plan", "WARN", "not valid JSON"),
    ("plan.json", "[]", "MFU vs plan", "WARN", "expected a JSON object, got a list"),
    ("plan.json", {"throughput": "fast"}, "tokens/s vs plan", "WARN",
     "key 'throughput': expected an object with 'tokens_per_s', got a string"),
    ("plan.json", {"throughput": {"tokens_per_s": "fast", "mfu": 0.4}}, "tokens/s vs plan", "WARN",
     "key 'throughput.tokens_per_s': expected a number, got a string (\"fast\")"),
    ("rehearsal.json", {"ranks": []}, "model_ready vs rehearsal", "WARN", "key 'ranks' is empty"),
    ("rehearsal.json", {"ranks": [{"rank": 0, "memory_bytes": []}]}, "model_ready vs rehearsal", "WARN",
     "key 'ranks.0.memory_bytes': expected an object with 'params', got a list"),
    ("drill.json", "{", "fault drill", "WARN", "not valid JSON"),
    ("drill.json", {"passed": "yes", "num_kills": []}, "fault drill", "FAIL",
     "key 'passed': expected true or false, got a string (\"yes\")"),
])
def test_a_hand_edited_run_file_is_a_check_naming_the_file_and_key(
        tmp_path: Path, name: str, content: object, check: str, status: str, named: str) -> None:
    """A run dir's plan.json, rehearsal.json or drill.json edited by hand or cut short was a TypeError,
    AttributeError, KeyError or ValueError traceback, or was taken for a missing file ("no plan to compare").
    Like a missing file it makes its check warn (a drill verdict that cannot be read fails), naming the file
    and the key; a --plan FILE the user named is exit 2."""
    run_dir = make_run(tmp_path, "healthy")
    (run_dir / name).write_text(content if isinstance(content, str) else json.dumps(content))
    checks = _by_name(run_dir)
    assert checks[check][0] == status and str(run_dir / name) in checks[check][1] and named in checks[check][1], \
        checks[check]
    plan_file = tmp_path / "edited-plan.json"
    plan_file.write_text(json.dumps({"throughput": {"tokens_per_s": 1e5, "mfu": "40%"}}))
    with pytest.raises(UserInputError, match=r"--plan .*edited-plan.json: key 'throughput.mfu': expected a number"):
        validate_run(run_dir, plan_file=plan_file)


def test_a_restart_event_or_model_ready_entry_of_the_wrong_type_is_read_without_a_traceback(tmp_path: Path) -> None:
    """events.jsonl edited by hand: a restart's attempt that is not a number, a model_ready rank without its
    number (both ValueError/KeyError tracebacks before)."""
    from leantrain.observe.report_data import append_event

    run_dir = make_run(tmp_path, "healthy")
    append_event(run_dir, "restart", attempt="second", step=40)
    append_event(run_dir, "model_ready", ranks=[{"param_bytes_local": GiB}, "rank 1"])
    (run_dir / "rehearsal.json").write_text(json.dumps(_rehearsal(GiB, 56 * GiB)))
    checks = _by_name(run_dir)
    assert "1 restart event(s)" in checks["no unexpected restarts"][1]  # the drill's kill: planned
    assert checks["model_ready vs rehearsal"] == ("WARN", "no rank in both model_ready and rehearsal.json")


@pytest.mark.parametrize("content", ["", 'garbage\n{"step": "x"}\n[1]\n', '{"event": "start"}\n'])
def test_a_baseline_without_a_logged_loss_is_exit_2_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str) -> None:
    """A --baseline whose metrics.jsonl holds no training record (empty, unreadable lines, events only) was a
    FAIL "no logged step in common with the baseline" (exit 1), blaming the run. It is refused before any check
    runs, exit 2 naming --baseline and the file, as `report` refuses it."""
    run_dir = make_run(tmp_path, "healthy")
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    (baseline / "metrics.jsonl").write_text(content)
    out = tmp_path / "validate.json"
    assert main(["validate", str(run_dir), "--baseline", str(baseline), "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"--baseline {baseline}" in captured.err and str(baseline / "metrics.jsonl") in captured.err
    assert "Traceback" not in captured.err and "matches baseline" not in captured.out and not out.exists()
    assert main(["validate", str(run_dir), "--baseline", str(make_run(tmp_path / "base", "healthy"))]) == 0


@pytest.mark.parametrize("content", ["", 'garbage\n{"step": "x"}\n[1]\n'])
def test_a_folder_whose_metrics_file_holds_nothing_a_run_writes_is_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str) -> None:
    """A folder with a metrics.jsonl of garbage (or an empty one) and nothing else a run writes got every check
    run over no data: "0 finite losses" PASS beside a throughput FAIL, exit 1. It is refused, exit 2, naming the
    folder and the first unreadable line; a run that crashed before its first step (its spec.yaml and
    lineage.json written) still gets its verdict."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(content)
    assert main(["validate", str(folder)]) == 2
    captured = capsys.readouterr()
    assert str(folder) in captured.err and "Traceback" not in captured.err and "verdict" not in captured.out
    assert ("metrics.jsonl:1: not JSON" in captured.err) == bool(content)
    crashed = make_run(tmp_path / "crashed", "healthy")
    (crashed / "metrics.jsonl").write_text(content)
    assert main(["validate", str(crashed)]) == 1 and "verdict: FAIL" in capsys.readouterr().out


def test_a_critical_alert_an_earlier_attempt_left_firing_does_not_fail_once_cleared(tmp_path: Path) -> None:
    """Attempt 0's checkpoint_failure alert never resolved (the process ended); later saves succeeded, so the
    replay of the events clears it. A failure with no good save after it still fails."""
    run_dir = make_run(tmp_path, "healthy")
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[5])["time"]
    alert = {"time": first, "rule": "checkpoint_failure", "severity": "critical", "state": "firing",
             "message": "checkpoint write failed at step 12: EIO", "first_seen": first, "last_seen": first}
    (run_dir / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": first, "kind": "checkpoint_failed", "step": 12, "error": "EIO"}) + "\n")
    assert _by_name(run_dir)["no errors"][0] == "PASS"
    late = {**alert, "time": first + 1e6, "first_seen": first + 1e6, "last_seen": first + 1e6}
    (run_dir / "alerts.jsonl").write_text(json.dumps(late) + "\n")
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": first + 1e6, "kind": "checkpoint_failed", "step": 99, "error": "EIO"}) + "\n")
    status, evidence = _by_name(run_dir)["no errors"]
    assert status == "FAIL" and "alert still firing: checkpoint_failure" in evidence


def test_a_huge_world_size_in_a_record_is_judged_without_listing_every_rank(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines[-1]["world_size"] = 10**10
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    status, evidence = _by_name(run_dir)["every rank reported"]
    assert status == "FAIL" and evidence == f"missing ranks {list(range(2, 12))} and {10**10 - 12} more of {10**10}"
