"""Preflight (`leantrain launch SPEC --preflight`): check every rank before spending GPU-hours on training.

On all ranks, with a deadline: every rank joins (the missing ones are named), software versions agree
(torch, CUDA, cuDNN, NCCL, driver, Python, leantrain, installed packages; the odd rank is named, the
reference being the majority value, ties going to rank 0's), each rank's hostname resolves, each rank can
open a TCP connection to the next rank's port, one all-reduce succeeds on the job's backend, the disk has room
for the checkpoints the plan expects, and the data dir's manifest and shards are readable.

The per-rank work is in `preflight_worker` (run under torchrun); `preflight_report` (imported by both) turns
what the ranks reported into a verdict, writes `RUN_DIR/preflight.json` and records hosts that failed a check
the other hosts passed in `node_health.json` (a check that fails everywhere is the job's problem, not a node's).
This module runs the worker locally with `torchrun --standalone` for the CLI and renders the report. Job files
run the same worker on every node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.errors import CheckFailed, UserInputError
from leantrain.launch.preflight_report import REPORT_NAME
from leantrain.security import redact
from leantrain.spec import JobSpec


def _worker_command(spec_path: Path, *, overrides: list[str], profile: str | None, run_dir: Path, nproc: int,
                    timeout_s: float, join_timeout_s: float | None, report: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "leantrain.launch.preflight_worker", str(spec_path)]
    if profile:
        cmd += ["--profile", profile]
    for item in overrides:
        cmd += ["--set", item]
    cmd += ["--run-dir", str(run_dir), "--expected-world-size", str(nproc), "--timeout-s", str(timeout_s),
            "--report", str(report)]
    if join_timeout_s is not None:
        cmd += ["--join-timeout-s", str(join_timeout_s)]
    return cmd


def run_local_preflight(
    spec: JobSpec, *, spec_path: Path, overrides: list[str], profile: str | None, run_dir: Path, nproc: int,
    timeout_s: float | None = None, join_timeout_s: float | None = None, env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run preflight on `nproc` local ranks under torchrun; returns the report (raises CheckFailed when the
    ranks wrote none, e.g. torchrun itself failed or the deadline passed)."""
    timeout_s = timeout_s or spec.cluster.preflight_timeout_s
    report_path = Path(run_dir) / REPORT_NAME
    report_path.unlink(missing_ok=True)
    cmd = _worker_command(spec_path, overrides=overrides, profile=profile, run_dir=run_dir, nproc=nproc,
                          timeout_s=timeout_s, join_timeout_s=join_timeout_s, report=report_path)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers share the new session
        proc.communicate()
        raise CheckFailed(f"preflight did not finish within {timeout_s + 30:.0f} s; no rank reported") from None
    if not report_path.exists():
        tail = redact("\n".join(output.strip().splitlines()[-15:]))
        raise CheckFailed(f"preflight wrote no report (torchrun exit code {proc.returncode}); last output:\n{tail}")
    return json.loads(report_path.read_text(encoding="utf-8"))


def render_report(report: dict[str, Any], *, console: Console) -> None:
    table = Table(title=f"preflight: {len(report['joined'])}/{report['expected_world_size']} ranks joined")
    for column in ("rank", "host", "torch", "cuda", "nccl", "driver", "disk free GB", "data", "port", "all-reduce"):
        table.add_column(column)
    for rank, facts in report["ranks"].items():
        probe = report["probes"].get(rank, {})
        coll = report["collectives"].get(rank)
        table.add_row(rank, facts["host"], str(facts.get("torch")), str(facts.get("cuda")), str(facts.get("nccl")),
                      str(facts.get("driver")), f"{facts['disk']['free_bytes'] / 1e9:.1f}",
                      "ok" if facts["data"]["ok"] else "FAIL", "ok" if probe.get("ok") else "FAIL",
                      "-" if coll is None else ("ok" if coll.get("ok") else "FAIL"))
    for rank in report["missing"]:
        table.add_row(str(rank), "[red]missing[/]", *["-"] * 8)
    console.print(table)
    for problem in report["problems"]:
        console.print(f"[red]✗[/] {problem}", highlight=False)
    if report["ok"]:
        console.print("[green]preflight passed[/]")


def preflight_command(
    spec: JobSpec, *, console: Console, spec_path: Path, overrides: list[str], profile: str | None, run_dir: Path,
    nproc: int | None, nnodes: str | None,
) -> dict[str, Any]:
    """What `leantrain launch --preflight` does on this machine; raises CheckFailed when a check fails."""
    if nnodes and nnodes not in ("1", "1:1"):
        raise UserInputError(f"--nnodes {nnodes}: a local preflight checks this node's ranks; multi-node preflight "
                             "runs as the first step of the job files (--emit slurm|k8s)")
    nproc = nproc or spec.hardware.gpus_per_node
    report = run_local_preflight(spec, spec_path=spec_path, overrides=overrides, profile=profile, run_dir=run_dir,
                                 nproc=nproc)
    render_report(report, console=console)
    if not report["ok"]:
        raise CheckFailed(f"preflight failed ({len(report['problems'])} problem(s)); see {run_dir / REPORT_NAME}")
    return report
