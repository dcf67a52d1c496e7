"""`leantrain launch`: a real 2-rank launch of the demo spec, refusals before any rank starts, --dry-run, --sweep,
crash recording against the host; and the MoE balance reduction over the data-parallel group only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from leantrain.cli import main
from leantrain.errors import REFUSAL_ENV, record_refusal
from leantrain.launch import command as launch_mod
from leantrain.launch import torchrun
from leantrain.launch.health import read_health, record_failure
from leantrain.model.transformer import Transformer, model_args_from_spec
from leantrain.parallel import ParallelDims, parallelize
from leantrain.parallel.dryrun import fake_process_group
from parallel_harness import make_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-cpu.yaml"


@dataclass
class Result:
    exit_code: int
    output: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run the CLI in this process the way the console script does (errors → exit codes); stdout + stderr."""

    def invoke(*args: str) -> Result:
        code = main(list(args))
        out = capsys.readouterr()
        return Result(code, out.out + out.err)

    return invoke


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record instead of starting torchrun."""
    started: list[object] = []
    monkeypatch.setattr(torchrun, "run_torchrun", lambda *a, **k: started.append(a) or 0)
    return started


@pytest.mark.slow
def test_launch_demo_spec_on_two_ranks_trains_one_metrics_stream(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    data = [f"data.dir={tmp_path / 'data'}"]
    prep = subprocess.run([sys.executable, "-m", "leantrain.cli", "prepare", str(TINY), "--set", data[0],
                           "--set", "data.tokens_total=20000"], env=env, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stdout[-2000:] + prep.stderr[-2000:]
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "leantrain.cli", "launch", str(TINY), "--nproc", "2", "--set", data[0],
         "--set", "training.max_steps=3", "--set", "training.log_every=1", "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "layout at 2 rank(s)" in done.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # one stream: rank 0 alone writes, each step once
    # measured in the collectives of one logging window in monitoring.comm_profile_every (10): the first here
    assert steps[0]["comm_s"] > 0 and all(r["comm_s"] is None for r in steps[1:]), steps
    assert json.loads((run_dir / "train_info.json").read_text())["world_size"] == 2
    assert {p.parent.name for p in torchrun.rank_logs(run_dir) if p.name == "stdout.log"} == {"0", "1"}


@pytest.mark.parametrize(
    ("sets", "nproc", "message"),
    [
        (["parallelism.tensor_parallel=3"], "3", "tensor_parallel"),  # 3 does not divide 4 heads (spec check)
        # a valid spec (1 × 2 × 1 = 2 GPUs) launched on 3 ranks: the product does not match the world size
        (["parallelism.data_parallel=1", "parallelism.tensor_parallel=2"], "3",
         "parallelism.tensor_parallel (2) does not divide the world size (3"),
        (["parallelism.data_parallel=1", "parallelism.pipeline_parallel=2"], "2", "tie_embeddings"),
    ],
)
def test_bad_layout_exits_2_before_any_rank_starts(
    tmp_path: Path, no_torchrun: list[object], cli: Callable[..., Result], sets: list[str], nproc: str,
    message: str,
) -> None:
    args = [a for s in sets for a in ("--set", s)]
    result = cli("launch", str(TINY), "--nproc", nproc, *args, "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not no_torchrun and not (tmp_path / "run").exists()


def test_dry_run_prints_every_rank_against_the_plan(
    tmp_path: Path, no_torchrun: list[object], cli: Callable[..., Result]
) -> None:
    result = cli("launch", str(TINY), "--nproc", "2", "--dry-run", "--set", "parallelism.zero_stage=3",
                 "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    text = result.output
    assert "dry run at 2 rank(s)" in text and "dp_shard 2" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(("│ 0 ", "│ 1 ", "│ plan"))]
    assert len(rows) == 3, text  # rank 0, rank 1, the plan
    assert "× the plan's" in text and not no_torchrun


def test_excluded_host_is_refused_and_a_crash_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_torchrun: list[object], cli: Callable[..., Result]
) -> None:
    run_dir = tmp_path / "run"
    data = f"data.dir={tmp_path / 'data'}"

    def crash(argv: object, *, console: object, timeout_s: object = None, failed_ranks: list[int] | None = None,
              trace_filter: torchrun.TraceFilter | None = None, **_: object) -> int:
        assert failed_ranks is not None and trace_filter is not None
        for line in ("Traceback (most recent call last):", "  File x", "torch...ChildFailedError: ", "=" * 20,
                     "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
                     "  exitcode  : -9 (pid: 8)", "=" * 20):
            trace_filter.keep(line + "\n")  # what torchrun's failure summary would say
        failed_ranks.append(1)
        return 1

    monkeypatch.setattr(torchrun, "run_torchrun", crash)
    result = cli("launch", str(TINY), "--nproc", "2", "--set", data, "--run-dir", str(run_dir))
    assert result.exit_code == 1 and "failed rank(s) 1" in " ".join(result.output.split()), result.output
    host = read_health(run_dir)[socket.gethostname()]
    assert host.crashes == 1 and host.ranks == [1]
    record_failure(run_dir, host=socket.gethostname(), kind="crash", reason="again")  # now at the threshold (2)
    monkeypatch.setattr(torchrun, "run_torchrun", lambda *a, **k: no_torchrun.append(a) or 0)
    result = cli("launch", str(TINY), "--nproc", "2", "--set", data, "--run-dir", str(run_dir))
    assert result.exit_code == 2 and "is excluded" in result.output and not no_torchrun


def failing_torchrun(failures: list[tuple[str, str | None]], *, refused: str | None = None,
                     before: Callable[[], None] = lambda: None) -> Callable[..., int]:
    """A stand-in for run_torchrun: local rank i fails with exit code `failures[i][0]` (local rank 0 first, torchrun's
    root cause), its stderr log holding `failures[i][1]` (None: no log) where torchrun writes it, under the
    `--log-dir` of the command (this host's); with `refused`, rank 0 first records the refusal where the launch said
    (errors.record_refusal)."""

    def run(argv: list[str], *, console: object, timeout_s: object = None, failed_ranks: list[int] | None = None,
            trace_filter: torchrun.TraceFilter | None = None, refusal: Path | None = None, **_: object) -> int:
        assert trace_filter is not None and failed_ranks is not None and refusal is not None
        (log_dir,) = [a.removeprefix("--log-dir=") for a in argv if a.startswith("--log-dir=")]
        for local, (_, text) in enumerate(failures):
            if text is not None:
                log = Path(log_dir) / "run-id_x1" / "attempt_0" / str(local) / "stderr.log"
                log.parent.mkdir(parents=True)
                log.write_text(text)
        if refused is not None:
            with mock.patch.dict(os.environ, {REFUSAL_ENV: str(refusal), "RANK": "0", "LOCAL_RANK": "0"}):
                record_refusal(refused)
        before()
        summary = ["Failures:"]
        for local, (code, _) in enumerate(failures[1:], start=1):
            summary += [f"[{local}]:", f"  rank      : {local} (local_rank: {local})", f"  exitcode  : {code} (pid: 9)"]
        summary += ["Root Cause (first observed failure):", "[0]:", "  rank      : 0 (local_rank: 0)",
                    f"  exitcode  : {failures[0][0]} (pid: 8)"]
        for line in ("Traceback (most recent call last):", "  File x", "torch...ChildFailedError: ", "=" * 20,
                     *summary, "=" * 20):
            trace_filter.keep(line + "\n")
        failed_ranks.extend(range(len(failures)))
        return 1

    return run


def refusing_torchrun(*, root_exit: str, refused: str | None, log_text: str = "",
                      before: Callable[[], None] = lambda: None) -> Callable[..., int]:
    """Local rank 0 fails first with `root_exit`, its log holding `log_text`; local rank 1 follows, exit 1."""
    return failing_torchrun([(root_exit, log_text), ("1", None)], refused=refused, before=before)


# as torch 2.13's gloo words it, behind torch's prefix of a rank's exception lines
PEER_GONE = ("[rank{}]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:9639. "
             "This is typically caused by a remote worker crashing.\n")


@pytest.mark.parametrize(("failures", "blamed"), [
    # another host's rank died: these failed in their next collective
    ([("1", PEER_GONE.format(0)), ("1", PEER_GONE.format(1))], False),
    ([("75", None), ("75", None)], False),  # the hang watchdog's abort: the group stopped stepping
    ([("1", PEER_GONE.format(0)), ("-15", None)], False),  # one saw the peer go, the agent stopped the other
    ([], False),  # the agent stopped without a failed rank of its own (the failed host closed the rendezvous)
    ([("1", PEER_GONE.format(0)), ("-9", None)], True),  # an OOM kill here, whichever torchrun observed first
    ([("1", "[rank0]: RuntimeError: CUDA error: uncorrectable ECC error encountered\n"), ("1", PEER_GONE.format(1))],
     True),
    ([("1", PEER_GONE.format(1))], True),  # another rank's line (agents sharing a host name) is not this rank's
])
def test_a_host_is_blamed_only_for_a_rank_that_failed_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_torchrun: list[object], cli: Callable[..., Result],
    failures: list[tuple[str, str | None]], blamed: bool,
) -> None:
    """When any rank of a multi-node job dies, every host's torchrun fails: the other hosts' ranks fail in their
    next collective. Each launch used to record a crash against its own host, so one bad host excluded every host
    of the job after `cluster.unhealthy_after_crashes` failures. A host is blamed only for a rank of its own that
    failed of its own (torchrun.host_fault)."""
    run_dir = tmp_path / "run"
    stub = failing_torchrun(failures) if failures else lambda *a, **k: 1
    monkeypatch.setattr(torchrun, "run_torchrun", stub)
    result = cli("launch", str(TINY), "--nproc", "2", "--set", f"data.dir={tmp_path / 'data'}", "--run-dir",
                 str(run_dir))
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    if blamed:
        assert read_health(run_dir)[socket.gethostname()].crashes == 1 and "failed of its own" in text, text
    else:
        assert socket.gethostname() not in read_health(run_dir), text
        assert f"not counted against {socket.gethostname()}" in text, text


@pytest.mark.parametrize(("root_exit", "refused"), [
    ("2", "run X would resume from step 2 with other schedule settings"), ("1", None), ("2", None)])
def test_a_job_its_ranks_refuse_is_exit_2_and_not_the_hosts_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_torchrun: list[object], cli: Callable[..., Result],
    root_exit: str, refused: str | None,
) -> None:
    """A rank that refused the job's input (e.g. a resume with other schedule settings) recorded why in the
    launch's refusal file: the launch is exit 2 with that reason, and the host gets no crash (two crashes exclude
    it). A rank that failed first otherwise is a crash, as before; so is an exit 2 with nothing recorded (an
    error that may pass on retry: the file is the one way a launch learns of a refusal, its logs are not read for
    one, whatever error line they hold)."""
    run_dir = tmp_path / "run"
    log = "starting\nerror: a line in the rank's log\n"
    monkeypatch.setattr(torchrun, "run_torchrun", refusing_torchrun(root_exit=root_exit, refused=refused,
                                                                    log_text=log))
    result = cli("launch", str(TINY), "--nproc", "2", "--set", f"data.dir={tmp_path / 'data'}", "--run-dir",
                 str(run_dir))
    text = " ".join(result.output.split())
    if refused is not None:
        assert result.exit_code == 2, result.output
        assert "the ranks refused the job: run X would resume from step 2 with other schedule settings" in text
        assert socket.gethostname() not in read_health(run_dir)
    else:
        assert result.exit_code == 1 and "before the host is excluded" in text, result.output
        assert "refused" not in text and "a line in the rank's log" not in text
        assert read_health(run_dir)[socket.gethostname()].crashes == 1


def test_the_failed_ranks_log_is_read_from_this_hosts_logs_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_torchrun: list[object], cli: Callable[..., Result],
) -> None:
    """A run dir on shared storage holds every node's torchrun logs (RUN_DIR/logs/HOST/...). This host's failed
    local rank 0's log is read from this host's log dir: another node's local rank 0, whose log is newer, is not
    it (before, every node's logs were globbed and the newest one was reported as this host's)."""
    run_dir = tmp_path / "run"
    other = run_dir / torchrun.LOGS_DIR / "other-node-17" / "run-id_x1" / "attempt_1" / "0" / "stderr.log"

    def other_node_logs_later() -> None:
        other.parent.mkdir(parents=True)
        other.write_text("error: another node's message\n")
        later = time.time() + 60
        os.utime(other, (later, later))

    monkeypatch.setattr(torchrun, "run_torchrun", refusing_torchrun(
        root_exit="2", refused="data.dir /x has no manifest.json", before=other_node_logs_later))
    result = cli("launch", str(TINY), "--nproc", "2", "--set", f"data.dir={tmp_path / 'data'}", "--run-dir",
                 str(run_dir))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "the ranks refused the job: data.dir /x has no manifest.json" in text, text
    assert "another node" not in text and "other-node-17" not in text
    mine = run_dir / torchrun.LOGS_DIR / socket.gethostname() / "run-id_x1" / "attempt_0" / "0" / "stderr.log"
    assert mine.is_file() and f"its log: {mine}" in text
    assert torchrun.newest_rank_log(run_dir, "0") == mine


@pytest.mark.slow
def test_ranks_that_refuse_the_job_are_not_restarted(tmp_path: Path) -> None:
    """Real torchrun, 2 ranks, `--max-restarts 2`, a data dir without a manifest (every rank refuses it, exit 2):
    the first refusing rank writes why (errors.record_refusal) and the launch stops torchrun there, exit 2 with the
    reason, one attempt. Before, torchrun restarted both ranks twice into the same refusal (three attempts; at
    scale each a full start of every rank) and the launch said exit 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "leantrain.cli", "launch", str(TINY), "--nproc", "2", "--max-restarts", "2",
         "--set", f"data.dir={tmp_path / 'no-data'}", "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, text[-3000:]
    assert "the ranks refused the job: data.dir" in text and "has no manifest.json" in text
    attempts = {p.name for p in (run_dir / torchrun.LOGS_DIR).glob("*/*/attempt_*")}
    assert attempts == {"attempt_0"}, attempts
    assert socket.gethostname() not in read_health(run_dir)


def test_a_restarted_rank_refuses_at_once_what_a_rank_of_its_launch_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Result],
) -> None:
    """`train` under a launch whose ranks already refused the job (LEANTRAIN_REFUSAL_FILE holds the reason)
    refuses at once, naming the rank, before reading the spec; a refusal of its own is recorded there."""
    marker = tmp_path / "refused.json"
    monkeypatch.setenv("LEANTRAIN_REFUSAL_FILE", str(marker))
    result = cli("train", str(TINY), "--set", f"data.dir={tmp_path / 'no-data'}", "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2 and "has no manifest.json" in result.output
    assert "manifest.json" in json.loads(marker.read_text())["message"]
    result = cli("train", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "already refused this launch's job" in text and "has no manifest.json" in text and "missing" not in text
    message = json.loads(marker.read_text())["message"]  # not rewritten as "already refused ...: ..."
    assert "already refused" not in message and "manifest.json" in message


@pytest.mark.parametrize("how", ["path", "usage"])
def test_every_exit_2_of_train_is_recorded_as_the_launchs_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Result], how: str,
) -> None:
    """The CLI's own exit 2 for a path that is not what train needs (an OSError the user's input caused) and for
    a usage error are refusals too: recorded like a LeantrainError's, so the launcher learns of them from the
    file alone (before, only a LeantrainError was, and the launcher scraped the rank's log for the others). Other
    commands' exit 2 is not recorded."""
    def missing(*_: object, **__: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", str(tmp_path / "data" / "tokenizer.json"))

    marker = tmp_path / "refused.json"
    monkeypatch.setenv("LEANTRAIN_REFUSAL_FILE", str(marker))
    monkeypatch.setattr("leantrain.cli._stage", missing)
    assert cli("check", str(TINY), "--no-such-flag").exit_code == 2 and not marker.exists()
    if how == "path":
        result = cli("train", str(TINY), "--run-dir", str(tmp_path / "r"))
        expected = f"{tmp_path / 'data' / 'tokenizer.json'}: No such file or directory (check that path"
    else:
        result = cli("train", str(TINY), "--no-such-flag")
        expected = "usage: No such option: --no-such-flag"
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert json.loads(marker.read_text())["message"].startswith(expected), marker.read_text()


def test_the_app_takes_no_option_value_before_its_command() -> None:
    """cli._refused takes the first argument that is not an option as the command (only `train`'s exit 2 is the
    launch's refusal). That holds while every option of the app itself is a flag: a `--profile NAME` before the
    command would make NAME the command, and a refused `train` would go unrecorded."""
    import typer.main

    from leantrain.cli import app

    group = typer.main.get_command(app)  # typer may bundle its own click: its classes, not the click package's
    options = [p for p in group.get_params(group.context_class(group)) if p.param_type_name == "option"]
    assert options and all(option.is_flag or option.count for option in options), [o.opts for o in options]


def test_a_refusal_is_one_file_write_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """16,384 ranks refusing at once write the file on shared storage once a node (its local rank 0), or once
    in all when another rank got there first; the record names the rank and attempt."""
    from leantrain.errors import read_refusal, record_refusal

    marker = tmp_path / "logs" / "refused.json"
    monkeypatch.setenv("LEANTRAIN_REFUSAL_FILE", str(marker))
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record_refusal("first")  # no file yet: the first refusing rank writes, whatever its local rank
    assert read_refusal(marker) == {"message": "first", "rank": "11", "host": socket.gethostname(), "attempt": "0"}
    record_refusal("second")  # local rank 3, a file there: left as it is
    assert read_refusal(marker)["message"] == "first"
    monkeypatch.setenv("LOCAL_RANK", "0")
    record_refusal("third")  # a node's local rank 0 writes
    assert read_refusal(marker)["message"] == "third" and not list(marker.parent.glob("*.tmp"))
    # two nodes writing the file at once with the same pid (pods: pids repeat across containers) write through
    # temporary files of their own, not one file both truncate
    temporary: list[str] = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: temporary.append(str(src)) or replace(src, dst))
    for pod in ("pod-a", "pod-b"):
        monkeypatch.setattr(socket, "gethostname", lambda pod=pod: pod)
        record_refusal(f"from {pod}")
    assert len(set(temporary)) == 2 and read_refusal(marker)["host"] == "pod-b"


def test_an_io_error_that_may_pass_on_retry_is_not_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             cli: Callable[..., Result]) -> None:
    """A checkpoint read that failed on I/O (IntegrityError, permanent=False) exits 2 but may pass on a restart:
    it is not recorded as the launch's refusal, so torchrun's restarts still try."""
    from leantrain.ckpt.integrity import IntegrityError

    def flaky(*_: object, **__: object) -> None:
        raise IntegrityError("step-00000002: read timed out", permanent=False)

    marker = tmp_path / "refused.json"
    monkeypatch.setenv("LEANTRAIN_REFUSAL_FILE", str(marker))
    monkeypatch.setattr("leantrain.cli._stage", flaky)
    result = cli("train", str(TINY), "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2 and "read timed out" in result.output and not marker.exists()


def test_failed_ranks_are_read_from_torchrun_summary() -> None:
    summary = ["Failures:", "[1]:", "  rank      : 3 (local_rank: 1)", "Root Cause (first observed failure):",
               "  rank      : 2 (local_rank: 0)", "  rank: 7"]
    found = [int(m.group(1)) for line in summary if (m := torchrun.FAILED_RANK_LINE.match(line))]
    assert found == [3, 2]


def test_sweep_option_runs_the_sweep_and_prints_where_scaling_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Result]
) -> None:
    calls: list[dict[str, Any]] = []

    def sweep(spec: object, **kwargs: Any) -> list[torchrun.SweepPoint]:
        calls.append(kwargs)
        return [torchrun.SweepPoint(1, 100.0, 1.0, 0.2, 0.0, 0), torchrun.SweepPoint(2, 120.0, 0.6, 0.3, 0.1, 0)]

    monkeypatch.setattr(torchrun, "scaling_sweep", sweep)
    result = cli("launch", str(TINY), "--sweep", "nproc=2,1", "--set", f"data.dir={tmp_path / 'data'}",
                 "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert calls[0]["sizes"] == [1, 2] and calls[0]["steps"] == launch_mod.SWEEP_STEPS
    assert "stop paying at nproc 2" in result.output
    assert cli("launch", str(TINY), "--sweep", "gpus=2").exit_code == 2



@pytest.mark.parametrize(("sweep", "named"), [
    ("nproc=1,,2", "entry 2 is empty"), ("nproc=1,2,", "entry 3 is empty"), ("nproc=", "no sizes"),
    ("=1,2", "key (nproc) is missing"), ("nproc=1,nproc=2", "'nproc=2'"), ("nproc=2,1,2", "2 listed more than once"),
    ("nproc=1,two", "'two'"), ("nproc=1.5", "'1.5'"), ("nproc=0", "'0'"), ("nproc=\u00b2", "'\u00b2'"),
])
def test_a_malformed_sweep_is_exit_2_naming_the_entry(
    tmp_path: Path, cli: Callable[..., Result], no_torchrun: list[object], sweep: str, named: str
) -> None:
    """Every size typed is run or the sweep is refused: an empty, repeated or non-integer entry is not skipped
    (`nproc=1,,2` ran 1 and 2; `nproc=\u00b2` was a ValueError traceback). Nothing is written."""
    result = cli("launch", str(TINY), "--sweep", sweep, "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert f"--sweep {sweep!r}" in result.output and named in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists() and no_torchrun == []


def test_sweep_with_preflight_is_refused_not_ignored(tmp_path: Path, cli: Callable[..., Result]) -> None:
    result = cli("launch", str(TINY), "--sweep", "nproc=1,2", "--preflight", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--preflight and --sweep: choose one" in result.output
    assert not (tmp_path / "run").exists()
    # --preflight with --dry-run ran a real preflight (every rank started); with --emit it was ignored
    for other in (["--dry-run"], ["--emit", "slurm", "--out", str(tmp_path / "job.sbatch"), "--set",
                                  "cluster.slurm_venv=/shared/venv"]):
        result = cli("launch", str(TINY), "--preflight", *other, "--run-dir", str(tmp_path / "run"))
        assert result.exit_code == 2 and f"--preflight and {other[0]}: choose one" in result.output, result.output
        assert not (tmp_path / "run").exists() and not (tmp_path / "job.sbatch").exists()
    # --rehearsal-json without --rehearse wrote nothing and said nothing
    for command in ("check", "plan"):
        result = cli(command, str(TINY), "--rehearsal-json", str(tmp_path / "r.json"))
        assert result.exit_code == 2 and "add --rehearse" in result.output, result.output


def test_moe_balance_sums_over_the_data_parallel_group_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp 2 × tp 2 on a fake 4-rank group: the expert counts are reduced over dp, not over all 4 ranks."""
    spec = make_spec(moe=True, data_parallel=2, tensor_parallel=2)
    seen: list[object] = []
    real = dist.all_reduce
    with fake_process_group(rank=0, world_size=4):
        dims = ParallelDims.from_spec(spec.parallelism, world_size=4)
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(model_args_from_spec(spec.model, max_seq_len=16))
        pm = parallelize(model, dims, spec, mesh=mesh, device=torch.device("cpu"))
        for part in pm.parts:
            part.to_empty(device="cpu")
            for module in part.modules():
                if hasattr(module, "tokens_per_expert"):
                    module.tokens_per_expert.fill_(1.0)
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, group=None, **k: seen.append(group) or real(
            t, *a, group=group, **k))
        counts = pm.update_moe_balance(bias_update_rate=0.01)
        assert counts is not None and counts.shape == (2, 4)
        assert seen and all(g is mesh["dp"].get_group() for g in seen)
        assert mesh["dp"].size() == 2


def test_ranks_run_with_a_quiet_profiler_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.launch.torchrun import torchrun_env

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    assert torchrun_env()["KINETO_LOG_LEVEL"] == "6"  # above kineto's USDT level: no profiler_start/stop lines
    monkeypatch.setenv("KINETO_LOG_LEVEL", "0")
    assert torchrun_env()["KINETO_LOG_LEVEL"] == "0"


def test_more_ranks_than_cores_or_gpus_warns() -> None:
    from leantrain.launch.torchrun import oversubscription_warnings
    from leantrain.spec import load_spec

    repo = Path(__file__).resolve().parents[1]
    tiny = load_spec(repo / "examples" / "tiny-cpu.yaml")
    (warning,) = oversubscription_warnings(tiny, nproc=8, num_cpus=2)
    assert "8 ranks on 2 CPU core(s)" in warning
    assert oversubscription_warnings(tiny, nproc=2, num_cpus=2) == []
    seed = load_spec(repo / "examples" / "seed-10b.yaml")
    warnings = oversubscription_warnings(seed, nproc=16, num_gpus=8)
    assert any("gpus_per_node (8)" in w for w in warnings) and any("8 GPU(s) visible" in w for w in warnings)


def test_a_batch_that_does_not_divide_at_this_world_size_proposes_one(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"
    # 4 × 128 × 3 ranks = 1536 tokens per micro-step: 1024 does not divide; nothing starts.
    assert main(["launch", str(tiny), "--nproc", "3", "--run-dir", str(tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "at 3 ranks: set training.global_batch_tokens to 1536" in err
    assert not (tmp_path / "run" / "logs").exists()
