"""Preflight (`leantrain launch SPEC --preflight`): check every rank before spending GPU-hours on training.

On all ranks, with a deadline: every rank joins (the missing ones are named), software versions agree
(torch, CUDA, cuDNN, NCCL, driver, Python, leantrain, installed packages; the odd rank is named, the
reference being the majority value, ties going to rank 0's), each rank's hostname resolves, each rank can
open a TCP connection to the next rank's port, one all-reduce succeeds on the job's backend, the disk has room
for the checkpoints the plan expects, and the data dir's manifest and shards are readable.

The per-rank work is in `preflight_worker` (run under torchrun); this module analyses what the ranks
reported, writes `RUN_DIR/preflight.json`, records hosts that failed a check the other hosts passed in
`node_health.json` (a check that fails everywhere is the job's problem, not a node's), and runs the
worker locally with `torchrun --standalone` for the CLI. Job files run the same worker on every node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.errors import CheckFailed, UserInputError
from leantrain.ops.health import record_failure
from leantrain.ops.preflight_worker import COMPARED_FIELDS
from leantrain.security import redact, write_private_text
from leantrain.spec import JobSpec

REPORT_NAME = "preflight.json"
RANK_CHECKS = (  # (name, how to read pass/fail from a rank's facts or results)
    ("hostname resolves", lambda f, p, c: (f.get("resolves", False), f.get("resolve_error", ""))),
    ("disk free", lambda f, p, c: (f["disk"]["ok"], f"{f['disk']['free_bytes']} bytes free at {f['disk']['path']}, "
                                                     f"need {f['disk']['need_bytes']}"
                                                     + (f" ({f['disk']['note']})" if f["disk"].get("note") else ""))),
    ("data readable", lambda f, p, c: (f["data"]["ok"], f["data"].get("error", ""))),
    ("port to next rank", lambda f, p, c: (p.get("ok", False), p.get("error", ""))),
    ("all-reduce", lambda f, p, c: (True, "") if c is None else (c.get("ok", False), c.get("error", ""))),
)


def _mismatches(joined: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    first = min(joined)
    for field in COMPARED_FIELDS:
        values = {r: facts.get(field) for r, facts in joined.items()}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        leaders = [v for v, c in counts.items() if c == top]
        reference = values[first] if values[first] in leaders else leaders[0]
        odd = sorted(r for r, v in values.items() if v != reference)
        found.append({"field": field, "reference": reference, "odd_ranks": odd,
                      "odd_values": {str(r): values[r] for r in odd},
                      "odd_hosts": sorted({joined[r]["host"] for r in odd})})
    return found


def analyze(
    *, joined: dict[int, dict[str, Any]], expected_world_size: int, world_size: int,
    probes: dict[int, dict[str, Any]], collectives: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """Turn what the ranks reported into a verdict with one problem line per finding, naming ranks and hosts."""
    problems: list[str] = []
    bad_hosts: dict[str, dict[str, list[Any]]] = {}

    def blame(rank: int, reason: str) -> None:
        entry = bad_hosts.setdefault(joined[rank]["host"], {"ranks": [], "reasons": []})
        entry["ranks"] = sorted({*entry["ranks"], rank})
        entry["reasons"].append(f"rank {rank}: {reason}")

    missing = [r for r in range(expected_world_size) if r not in joined]
    if missing:
        started = "" if world_size >= expected_world_size else f"; only {world_size} ranks were started"
        problems.append(f"rank(s) {', '.join(map(str, missing))} of {expected_world_size} did not join before the "
                        f"join deadline{started}")
    # A probe towards a rank that never joined says nothing new about the prober.
    probes = {r: {"ok": True, "skipped": f"rank {p['target']} missing"} if p.get("target") in missing else p
              for r, p in probes.items()}
    mismatches = _mismatches(joined) if joined else []
    for m in mismatches:
        odd = ", ".join(f"rank {r} on {joined[r]['host']} has {joined[r].get(m['field'])}" for r in m["odd_ranks"])
        problems.append(f"{m['field']} differs: {odd}; the other ranks have {m['reference']}")
        for r in m["odd_ranks"]:
            blame(r, f"{m['field']} {joined[r].get(m['field'])} (others {m['reference']})")
    for name, read in RANK_CHECKS:
        failed = {}
        for r, facts in joined.items():
            ok, detail = read(facts, probes.get(r, {}), collectives.get(r) if collectives else None)
            if not ok:
                failed[r] = detail
        for r, detail in sorted(failed.items()):
            problems.append(f"{name} failed on rank {r} ({joined[r]['host']}): {detail}")
        if failed and len(failed) < len(joined):  # only some hosts fail: those hosts are the problem
            for r, detail in failed.items():
                blame(r, f"{name}: {detail}")
    return {
        "ok": not problems,
        "checked_at": time.time(),
        "expected_world_size": expected_world_size,
        "world_size": world_size,
        "joined": sorted(joined),
        "missing": missing,
        "mismatches": mismatches,
        "problems": problems,
        "bad_hosts": bad_hosts,
        "ranks": {str(r): facts for r, facts in sorted(joined.items())},
        "probes": {str(r): p for r, p in probes.items()},
        "collectives": {str(r): c for r, c in collectives.items()},
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_private_text(Path(path), json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")


def record_unhealthy(report: dict[str, Any], *, run_dir: Path) -> list[str]:
    """Add the hosts that failed to node_health.json; returns them."""
    for host, entry in report.get("bad_hosts", {}).items():
        record_failure(run_dir, host=host, kind="preflight", reason="; ".join(entry["reasons"]), ranks=entry["ranks"])
    return sorted(report.get("bad_hosts", {}))


def _worker_command(spec_path: Path, *, overrides: list[str], profile: str | None, run_dir: Path, nproc: int,
                    timeout_s: float, join_timeout_s: float | None, report: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "leantrain.ops.preflight_worker", str(spec_path)]
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
