"""`launch` shows one line per failed rank and the log holding its trace, never the traces themselves."""

from __future__ import annotations

import io
import socket
import sys
from pathlib import Path

import pytest
from rich.console import Console

from leantrain.launch.torchrun import TraceFilter, rank_failure_lines, run_torchrun

FAILING = """
import os, time
if os.environ["RANK"] == "1":
    def inner():
        raise ValueError("boom from rank 1")
    inner()
time.sleep(30)
"""


@pytest.mark.slow
def test_a_failed_rank_is_one_line_naming_its_log(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
            "--max-restarts=0", f"--log-dir={run_dir / 'logs' / socket.gethostname()}", "--redirects=3", "--tee=3",
            "--local-ranks-filter=0,1", str(script)]  # both ranks tee'd: rank 1's traceback reaches the console
    out = io.StringIO()
    console = Console(file=out, width=200)
    traces, failed = TraceFilter(), []
    assert run_torchrun(argv, console=console, failed_ranks=failed, trace_filter=traces) != 0
    lines = rank_failure_lines(traces, run_dir=run_dir)
    shown = out.getvalue()
    assert "Traceback" not in shown and "boom from rank 1" not in shown and "ChildFailedError" not in shown
    assert failed and 1 in failed
    assert lines[0].startswith("rank 1 (local rank 1, host ") and "failed first: exit code 1; its log: " in lines[0]
    log = Path(lines[0].rsplit("its log: ", 1)[1])
    assert log.name == "stderr.log" and log.parent.name == "1"
    assert "Traceback" in log.read_text() and "boom from rank 1" in log.read_text()
    assert len(lines) == 2 and lines[1].startswith("rank 0 (local rank 0") and "stopped" in lines[1]


def test_a_distributed_ranks_traceback_behind_torchs_own_prefix_is_kept_off_the_console() -> None:
    """After init_process_group torch prefixes a rank's exception lines with `[rankN]: `, behind torchrun's
    `[defaultN]:`: those tracebacks reached the console (seen with a gloo rank whose peer was SIGKILLed)."""
    traces = TraceFilter()
    lines = ["[default0]:step 3 loss 2.1", "[default0]:[rank0]: Traceback (most recent call last):",
             '[default0]:[rank0]:   File "worker.py", line 5, in <module>',
             "[default0]:[rank0]:     dist.all_reduce(t)",
             "[default0]:[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:15763.",
             "[default0]:step 4 never"]
    shown = [line for line in lines if traces.keep(line + "\n")]
    assert shown == ["[default0]:step 3 loss 2.1", "[default0]:step 4 never"]
    assert traces.last_errors == ["RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:15763."]
