"""`leantrain doctor`: environment checks, and each of the usual failures named with evidence, cause and fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from leantrain.cli import main
from leantrain.errors import UserInputError
from leantrain.golive.doctor import diagnose_run, doctor, environment_findings
from leantrain.observe.report_data import load_run
from test_observe_scenarios import make_run


def _problems(tmp_path: Path, scenario: str) -> dict[str, object]:
    findings = diagnose_run(load_run(make_run(tmp_path, scenario)))
    return {f.title: f for f in findings if f.severity in ("problem", "warning")}


@pytest.mark.parametrize(("scenario", "title", "in_evidence", "in_cause"), [
    ("stuck", "ranks stuck at start", "Connection refused", "ports"),
    ("hang", "run stalled", "no step for", "collective"),
    ("data_bound", "data-bound", "wait for data 50%", "storage"),
    ("straggler", "straggler rank", "rank 1", "slow"),
    ("oom", "out of memory", "optimizer 20.0 GiB", "optimizer"),
    ("spike", "divergence", "LR", "learning rate"),
    ("nan", "divergence", "non-finite at steps [22]", "learning rate"),
    ("bad_source", "divergence", "source 'zh'", "bad samples in source 'zh'"),
    ("flapping", "flapping node node3", "node3 failed 3 times", "hardware"),
    ("resume_jump", "metrics jump after resume", "+", "optimizer state"),
    ("lr_not_restored", "LR schedule not restored", "at the same step", "scheduler"),
    ("data_not_restored", "data position not restored", "tokens_seen", "sampler"),
])
def test_doctor_names_the_cause(tmp_path: Path, scenario: str, title: str, in_evidence: str, in_cause: str) -> None:
    problems = _problems(tmp_path, scenario)
    assert title in problems, list(problems)
    finding = problems[title]
    assert in_evidence in finding.evidence, finding.evidence  # type: ignore[attr-defined]
    assert in_cause in finding.cause, finding.cause  # type: ignore[attr-defined]
    assert finding.fix  # type: ignore[attr-defined]


def test_healthy_run_has_no_problem(tmp_path: Path) -> None:
    findings = diagnose_run(load_run(make_run(tmp_path, "healthy")))
    assert [(f.severity, f.title) for f in findings] == [("ok", "no known problem")]


def test_environment_checks(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    titles = {f.title: f for f in environment_findings(run_dir, load_run(run_dir))}
    assert "torch" in titles["torch and devices"].evidence
    assert "hostname resolves" in titles and "disk space" in titles
    # the scenario plans 1e9-byte checkpoints, 3 kept: 2.79 GiB (a tiny run's said "0.0 GiB")
    assert "planned checkpoints need 2.79 GiB" in titles["disk space"].evidence
    # spec.yaml names no data dir here; a spec that names a missing one is a problem with a fix.
    assert titles["data readable"].severity == "info"
    (run_dir / "spec.yaml").write_text(f"data: {{dir: {tmp_path / 'no-data'}}}\n")
    data = next(f for f in environment_findings(run_dir, load_run(run_dir)) if f.area == "env" and "data" in f.title)
    assert data.severity == "problem" and "manifest.json" in data.evidence and "prepare" in data.fix


def test_cli_doctor(tmp_path: Path) -> None:
    assert main(["doctor", str(make_run(tmp_path, "oom"))]) == 0
    assert main(["doctor"]) == 0
    with pytest.raises(UserInputError):
        doctor(tmp_path / "missing")
    console = Console(record=True, width=200)
    from leantrain.golive.doctor import run

    run(console=console, run_dir=make_run(tmp_path, "flapping"))
    assert "isolate node3" in console.export_text()


def test_a_failure_of_the_whole_job_is_no_flapping_node(tmp_path: Path) -> None:
    """Crashes that 3+ hosts recorded at once (an out-of-memory layout on every node) were the job's: doctor does
    not call those hosts flapping (launch.health.job_wide_crashes); a host that crashed twice alone still is."""
    run_dir = make_run(tmp_path, "healthy")

    def crashes(*times: float) -> dict[str, object]:
        return {"crashes": len(times), "events": [{"ts": t, "kind": "crash", "ranks": [0], "reason": "x"}
                                                   for t in times]}

    hosts = {"n1": crashes(100, 5_000, 9_000), "n2": crashes(110, 5_010), "n3": crashes(120, 5_020),
             "n4": crashes(20_000, 30_000)}
    (run_dir / "node_health.json").write_text(json.dumps({"version": 1, "hosts": hosts}))
    flapping = sorted(f.title for f in diagnose_run(load_run(run_dir)) if f.title.startswith("flapping node"))
    assert flapping == ["flapping node n4"], flapping


def test_doctor_reads_torchrun_rank_logs(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    rank_log = run_dir / "logs" / "node7" / "none_ab12" / "attempt_0" / "5" / "stderr.log"
    rank_log.parent.mkdir(parents=True)
    rank_log.write_text("Traceback (most recent call last):\n  File x\nRuntimeError: CUDA error: an illegal memory "
                        "access was encountered\n")
    problems = {f.title: f for f in diagnose_run(load_run(run_dir)) if f.severity == "problem"}
    finding = problems["errors in rank logs"]
    assert "node7 attempt 0 local rank 5 (stderr)" in finding.evidence and "illegal memory access" in finding.evidence
    assert "logs/node7/none_ab12/attempt_0/5/stderr.log" in finding.fix
    oom = rank_log.with_name("stdout.log")
    oom.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    problems = {f.title: f for f in diagnose_run(load_run(run_dir)) if f.severity == "problem"}
    assert "node7 attempt 0 local rank 5 (stdout)" in problems["out of memory"].evidence


@pytest.mark.parametrize("value", ["", "abc", "99999", "-1", "0"])
def test_a_master_port_that_is_not_a_port_is_a_finding_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """doctor runs when the environment is broken: a MASTER_PORT that is empty, not a number or out of range was
    a ValueError/OverflowError traceback; it is a problem naming MASTER_PORT, its value and the valid range."""
    monkeypatch.setenv("MASTER_PORT", value)
    findings = {f.title: f for f in environment_findings(None, None)}
    finding = findings["MASTER_PORT is not a port"]
    assert finding.severity == "problem" and f"MASTER_PORT={value!r}" in finding.evidence
    assert "1-65535" in finding.evidence and "MASTER_PORT" in finding.fix
    assert "rendezvous port free" not in findings
    assert main(["doctor", str(make_run(tmp_path, "healthy"))]) == 0


def test_a_folder_that_is_not_a_run_dir_is_refused_but_a_run_that_crashed_at_start_is_diagnosed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A data dir or an empty folder was diagnosed as "ranks stuck at start" (exit 0). It is exit 2 saying it
    is not a run dir; a run dir that crashed before its first metric record (only the files written before the
    first step, or only the launcher's rank logs) is still diagnosed."""
    data_dir, empty = tmp_path / "data", tmp_path / "empty"
    (data_dir / "train").mkdir(parents=True)
    (data_dir / "manifest.json").write_text('{"shards": []}')
    empty.mkdir()
    for folder in (data_dir, empty):
        assert main(["doctor", str(folder)]) == 2
        err = capsys.readouterr().err
        assert f"{folder} is not a run dir" in err and "spec.yaml" in err and "Traceback" not in err
    assert "data dir" in str(pytest.raises(UserInputError, doctor, data_dir).value)
    started = tmp_path / "started"
    started.mkdir()
    (started / "spec.yaml").write_text("run: {dir: started}\n")
    rank_log = tmp_path / "launched" / "logs" / "node1" / "none_x" / "attempt_0" / "0" / "stderr.log"
    rank_log.parent.mkdir(parents=True)
    rank_log.write_text("RuntimeError: Connection refused\n")
    for run_dir in (started, tmp_path / "launched"):
        stuck = next(f for f in doctor(run_dir) if f.title == "ranks stuck at start")
        assert "no metric records" in stuck.evidence
        assert main(["doctor", str(run_dir)]) == 0
    assert "Connection refused" in next(f for f in doctor(tmp_path / "launched") if f.area == "start").evidence


def test_a_gap_across_a_preemption_or_a_resume_from_an_earlier_step_is_not_a_problem(tmp_path: Path) -> None:
    """The `hang` run's 1,000 s gap, explained by a preemption and its resume, is no stall; steps going back to
    an earlier checkpoint (its loss higher again) are no divergence."""
    run_dir = make_run(tmp_path, "hang")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gap_start, gap_end = records[30]["time"], records[31]["time"]
    with (run_dir / "events.jsonl").open("a") as handle:
        for event in ({"time": gap_start + 1, "kind": "preempted", "step": records[30]["step"]},
                      {"time": gap_end - 5, "kind": "resume", "from_step": records[30]["step"]}):
            handle.write(json.dumps(event) + "\n")
    assert "run stalled" in _problems(tmp_path / "before", "hang")
    assert "run stalled" not in {f.title for f in diagnose_run(load_run(run_dir))}
    resumed = records[:40] + [{**r, "time": r["time"] + 2000} for r in records[5:]]  # back to step 12
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in resumed))
    assert "divergence" not in {f.title for f in diagnose_run(load_run(run_dir))}


def _edit(run_dir: Path, name: str, change: str) -> None:
    if name == "metrics.jsonl":
        records = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        records[-1].update(json.loads(change))
        (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    elif name.endswith(".jsonl"):
        with (run_dir / name).open("a") as handle:
            handle.write(change + "\n")
    else:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(change)


@pytest.mark.parametrize(("name", "change"), [
    ("hang/rank-0-attempt-0.json", '{"idle_s": "long"}'),
    ("node_health.json", '{"hosts": {"n1": {"crashes": null}}}'),
    ("events.jsonl", '{"time": 1.8e9, "kind": "oom", "rank": 0, "step": 3}'),  # with plan.json's per_gpu a list
    ("metrics.jsonl", '{"rank_step_time_s": [null, null]}'),
    ("metrics.jsonl", '{"world_size": 10000000000}'),
    ("alerts.jsonl", '{"rule": "hang", "state": "resolved", "severity": "critical", "first_seen": 1e20}'),
    ("events.jsonl", '{"time": 1e20, "kind": "finish"}'),
    ("plan.json", '{"layout": "dp2"}'),
])
def test_odd_values_in_best_effort_run_files_are_read_past(tmp_path: Path, name: str, change: str) -> None:
    """Doctor and report read such a value as absent, without a traceback."""
    from leantrain.observe.report import write_report

    run_dir = make_run(tmp_path, "healthy")
    plan = json.loads((run_dir / "plan.json").read_text())
    (run_dir / "plan.json").write_text(json.dumps({**plan, "memory": {"per_gpu": [1, 2]}}))
    _edit(run_dir, name, change)
    assert diagnose_run(load_run(run_dir))
    write_report(run_dir, tmp_path / "report.html")
    assert (tmp_path / "report.html").is_file()


def test_a_spec_with_an_odd_virtual_stage_count_is_priced_as_one(tmp_path: Path) -> None:
    """The report's pipeline-bubble estimate (no measured bubble_s) divided by a spec.yaml's virtual_stages as it
    stood: "two" was a TypeError."""
    from leantrain.observe.report_cost import bubble_seconds

    run_dir = make_run(tmp_path, "healthy")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "bubble_s"}) + "\n"
                                                   for r in records))
    (run_dir / "plan.json").unlink()
    (run_dir / "spec.yaml").write_text("parallelism: {pipeline_parallel: 2, virtual_stages: two}\n"
                                       "training: {global_batch_tokens: 4096, micro_batch: 1}\ndata: {seq_len: 512}\n")
    seconds, how = bubble_seconds(load_run(run_dir), 100.0, np.ones(len(records)))
    assert seconds == pytest.approx(100.0 / 9) and "v=1" in how  # (pp-1)/(m+pp-1) with m = 8


def test_unreadable_metrics_are_said_not_diagnosed_as_a_stuck_start(tmp_path: Path) -> None:
    """A metrics.jsonl of garbage (bad UTF-8, cut short) was read as "no metric records" and diagnosed as ranks
    stuck at start (closed ports): the unreadable lines are a warning naming them, with no stuck-start finding."""
    run_dir = make_run(tmp_path, "healthy")
    (run_dir / "metrics.jsonl").write_bytes(b"\xff\xfe garbage\n{cut\n")
    findings = {f.title: f for f in diagnose_run(load_run(run_dir))}
    assert "ranks stuck at start" not in findings, list(findings)
    warning = findings["unreadable run files"]
    assert warning.severity == "warning" and "metrics.jsonl:1" in warning.evidence and warning.fix
    healthy = {f.title for f in diagnose_run(load_run(make_run(tmp_path / "ok", "healthy")))}
    assert "unreadable run files" not in healthy
