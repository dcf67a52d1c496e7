"""Local and multi-node launches through torchrun (elastic agent), and the `--sweep nproc=1,2,4` scaling sweep.

One node: `torchrun --standalone`. Several: c10d rendezvous with `--nnodes MIN:MAX` at
`$LEANTRAIN_RDZV_ENDPOINT` (default: localhost:cluster.rdzv_port); run the same command on every node.
Restarts come from `fault.max_restarts` (0 when `fault.auto_restart` is off) unless `--max-restarts` says
otherwise. Every rank's stdout/stderr goes to its own file under `RUN_DIR/logs/HOST/` (torchrun's
`--log-dir --redirects 3 --tee 3`: `<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log`); the console shows
local rank 0. Each rank runs `python -m leantrain.cli train SPEC ... --run-dir RUN_DIR`; rank 0 writes the
metrics. The layout is checked for every world size the job may have *before* torchrun starts. When workers
fail, the ranks named in torchrun's failure summary are handed back (`failed_ranks`, `failures`) for the
node-health file, which counts a crash against this host only where one failed of its own (`host_fault`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from leantrain.errors import REFUSAL_ENV, UserInputError, read_refusal
from leantrain.launch.resources import (
    TORCHRUN_ENV,
    TrainCommand,
    elastic_floor,
    layout_at,
    layout_problem,
    parse_nnodes,
)
from leantrain.observe.logs import newest_first
from leantrain.parallel.dims import ParallelDims
from leantrain.spec.schema import JobSpec

RDZV_ENV = "LEANTRAIN_RDZV_ENDPOINT"
LOGS_DIR = "logs"
SWEEP_FILE = "sweep.json"
# Below this share of linear scaling, more ranks are judged not to pay (find the inflection first).
EFFICIENCY_FLOOR = 0.8
# torchrun's failure summary names each failed worker: "rank      : 1 (local_rank: 1)".
FAILED_RANK_LINE = re.compile(r"^\s*(?:\[[^\]]*\]:)?\s*rank\s*:\s*(\d+)\s*\(local_rank")


def check_layout(spec: JobSpec, *, nproc: int, min_nodes: int = 1, max_nodes: int = 1) -> list[ParallelDims]:
    """The layout at the smallest and the largest world size the job may run at; raises UserInputError naming the
    axis that does not fit. An elastic job (min < max) may re-form at any node count in between, so every count
    is checked: a count where the layout does not run would fail each restart there. Nothing is started."""
    dims: dict[int, ParallelDims] = {}
    for nodes in range(min_nodes, max_nodes + 1):
        try:
            dims[nodes] = layout_at(spec, nproc=nproc, nodes=nodes)
        except UserInputError as err:
            if min_nodes == max_nodes:
                raise
            runs = [n for n in range(min_nodes, max_nodes + 1) if layout_problem(spec, nproc=nproc, nodes=n) is None]
            floor = elastic_floor(spec, nproc=nproc, floor=min_nodes, max_nodes=max_nodes)
            where = f"at {_counts(runs)} node(s)" if runs else "at none of them"
            fixes = [] if floor is None else [f"set fault.min_nodes (or --nnodes MIN) to {floor}" + (
                "" if floor == max_nodes else f" (it runs at every count from {floor} to {max_nodes})")]
            if str(err).startswith("training.global_batch_tokens"):
                fixes.append("choose a global batch that every data-parallel size in the range divides")
            raise UserInputError(
                f"{err} An elastic job may re-form at any node count in {min_nodes}..{max_nodes} (fault.min_nodes.."
                f"max_nodes or --nnodes MIN:MAX) of {nproc} ranks each, and this layout runs {where}"
                + (f": {', or '.join(fixes)}" if fixes else "")) from None
    return [dims[nodes] for nodes in sorted({min_nodes, max_nodes})]


def _counts(values: list[int]) -> str:
    return ", ".join(map(str, values[:8])) + (f" … ({len(values)} counts)" if len(values) > 8 else "")


def restarts(spec: JobSpec, max_restarts: int | None) -> int:
    if max_restarts is not None:
        return max_restarts
    return spec.fault.max_restarts if spec.fault.auto_restart else 0


def torchrun_argv(
    spec: JobSpec,
    *,
    train: TrainCommand,
    run_dir: Path,
    nproc: int,
    nnodes: str | None = None,
    max_restarts: int | None = None,
    max_steps: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """The full torchrun command line that trains `spec` on `nproc` processes per node."""
    min_nodes, max_nodes = parse_nnodes(nnodes) if nnodes else (1, 1)
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if max_nodes == 1:
        argv += ["--standalone", "--nnodes=1"]
    else:
        endpoint = rdzv_endpoint or os.environ.get(RDZV_ENV) or f"localhost:{spec.cluster.rdzv_port}"
        argv += [f"--nnodes={min_nodes}:{max_nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                 f"--rdzv-id={rdzv_id or spec.run.name or Path(run_dir).name}"]
    argv += [f"--nproc-per-node={nproc}", f"--max-restarts={restarts(spec, max_restarts)}",
             f"--log-dir={host_log_dir(run_dir)}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
             "-m", "leantrain.cli", "train", *train.spec_args(run_dir=str(run_dir)), *train.train_args]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    return argv


def torchrun_env(refusal_file: Path | None = None) -> dict[str, str]:
    """This environment plus what elastic restarts need (a rendezvous store per restart attempt, docs/parallel.md)
    and a quiet profiler; a KINETO_LOG_LEVEL the user set wins. With `refusal_file`, where a rank that refuses
    the job writes why (errors.record_refusal)."""
    quiet = {"KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", TORCHRUN_ENV["KINETO_LOG_LEVEL"])}
    refusal = {} if refusal_file is None else {REFUSAL_ENV: str(refusal_file)}
    return {**os.environ, **TORCHRUN_ENV, **quiet, **refusal}


def host_log_dir(run_dir: Path) -> Path:
    """This host's torchrun log dir (`--log-dir`), RUN_DIR/logs/HOST: every node of a job writes its own."""
    return Path(run_dir) / LOGS_DIR / socket.gethostname()


def refusal_file(run_dir: Path) -> Path:
    """Where this launch's ranks record a refusal: this host's log dir, a name no other launch shares."""
    return host_log_dir(run_dir) / f"refused-{os.getpid()}-{time.time_ns()}.json"


class TraceFilter:
    """Keeps Python tracebacks and torchrun's failure summary off the console (they are in the rank logs):
    `keep(line)` says whether to echo a line; `failures` collects one record per failed rank from the
    summary (rank, local_rank, host, exitcode) and `last_errors` the final line of each suppressed trace."""

    # torchrun's --tee prefix of a rank's lines, then torch's own "[rankN]: " on a distributed rank's exception
    PREFIX = re.compile(r"^(?:\[(?:default|rank)\d+\]: ?)*")
    FIELD = re.compile(r"^\s*(rank|host|exitcode)\s*:\s*(\S+)(?:\s*\((?:local_rank|pid):\s*(\d+)\))?")

    def __init__(self) -> None:
        self.failures: list[dict[str, str]] = []
        self.last_errors: list[str] = []
        self._trace: set[str] = set()
        self._in_summary = self._root = False
        self._rules_seen = 0  # "====" lines seen inside the failure summary (it has two)

    def keep(self, line: str) -> bool:
        matched = self.PREFIX.match(line).group(0)  # type: ignore[union-attr]
        prefix, body = matched.replace(" ", ""), line[len(matched):].rstrip("\n")  # the rank's key, its text
        if self._in_summary:
            return self._summary_line(body)
        if body.startswith("Traceback (most recent call last):"):
            self._trace.add(prefix)
            return False
        if prefix in self._trace:
            if not body.strip() or body[:1].isspace():
                return False
            if body.startswith(("During handling of the above exception", "The above exception was")):
                return False
            self._trace.discard(prefix)
            self.last_errors.append(body.strip()[:300])
            if "ChildFailedError" in body:
                self._in_summary, self._rules_seen = True, 0  # the summary follows, between two rules of "="
            return False
        return True

    def _summary_line(self, body: str) -> bool:
        if body.startswith("====="):
            self._rules_seen += 1
            self._in_summary = self._rules_seen < 2
            return False
        if body.startswith("Root Cause"):
            self._root = True
        if re.match(r"^\[\d+\]:\s*$", body):  # one failure's block starts: time, host, rank, exitcode, ...
            self.failures.append({"root": "yes" if self._root else ""})
        match = self.FIELD.match(body)
        if match and self.failures:
            self.failures[-1][match.group(1)] = match.group(2)
            if match.group(1) == "rank":
                self.failures[-1]["local_rank"] = match.group(3) or "?"
        return False


def run_torchrun(
    argv: Sequence[str], *, console: Console, timeout_s: float | None = None, failed_ranks: list[int] | None = None,
    trace_filter: TraceFilter | None = None, refusal: Path | None = None, new_session: bool = True,
    started: list[subprocess.Popen] | None = None,
) -> int:
    """Run torchrun in its own session (`new_session`; else in this process group, which a scheduler signals
    whole), echo its output, return its exit code (killing the group on timeout or KeyboardInterrupt). `started`,
    when given, receives torchrun's process as it starts (for a signal handler to pass signals on to it).

    `failed_ranks`, when given, receives the global ranks torchrun's failure summary reports. `trace_filter`,
    when given, keeps tracebacks off the console and collects the failures (`rank_failure_lines`). `refusal`,
    when given, is where a rank that refuses the job writes why (`refusal_file`): once it exists torchrun is
    stopped, not left to restart every rank into the same refusal, and the exit code is 2.
    """
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=torchrun_env(refusal), start_new_session=new_session)
    if started is not None:
        started.append(proc)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    looked = 0.0  # when the refusal file was last looked for: at once after a line that tells of a failure, else
    # at most once a second (it may be on shared storage)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if trace_filter is None or trace_filter.keep(line):
                console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
            match = FAILED_RANK_LINE.match(line)
            if match and failed_ranks is not None and int(match.group(1)) not in failed_ranks:
                failed_ranks.append(int(match.group(1)))
            if refusal is not None and ("error" in line or "exitcode" in line or time.monotonic() - looked >= 1.0):
                looked = time.monotonic()
                if refusal.exists():
                    _stop(proc)
                    return 2
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
        return proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired, KeyboardInterrupt):
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun's session (the agent and its ranks), SIGKILL after 30 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def oversubscription_warnings(spec: JobSpec, *, nproc: int, num_cpus: int | None = None,
                              num_gpus: int | None = None) -> list[str]:
    """More ranks than this node has cores (CPU runs) or GPUs: it runs, slowly, and its numbers mislead."""
    out = []
    if spec.hardware.accelerator == "cpu":
        cores = num_cpus if num_cpus is not None else len(os.sched_getaffinity(0))
        if nproc > cores:
            out.append(f"--nproc {nproc} ranks on {cores} CPU core(s): the ranks share cores, so step times and "
                       f"tokens/s measure contention, not scaling")
        return out
    if nproc > spec.hardware.gpus_per_node:
        out.append(f"--nproc {nproc} exceeds hardware.gpus_per_node ({spec.hardware.gpus_per_node})")
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count()
    if 0 < num_gpus < nproc:
        out.append(f"--nproc {nproc} ranks but {num_gpus} GPU(s) visible on this node")
    return out


def rank_logs(run_dir: Path) -> list[Path]:
    """Every per-rank log file torchrun wrote under the run dir."""
    return sorted((Path(run_dir) / LOGS_DIR).glob("**/std*.log"))


def launch_local(
    spec: JobSpec, *, train: TrainCommand, run_dir: Path, nproc: int, nnodes: str | None, max_restarts: int | None,
    console: Console, max_steps: int | None = None, timeout_s: float | None = None,
    failed_ranks: list[int] | None = None, refusals: list[str] | None = None,
    failures: list[dict[str, str]] | None = None,
) -> int:
    """Check the layout, then run torchrun; returns its exit code (`failed_ranks` receives the crashed ranks,
    `failures` torchrun's failure summary (`TraceFilter.failures`, for `host_fault`), and `refusals` the message a
    rank recorded when it refused the job: `refusal_file`, errors.record_refusal)."""
    min_nodes, max_nodes = parse_nnodes(nnodes) if nnodes else (1, 1)
    for warning in oversubscription_warnings(spec, nproc=nproc):
        console.print(f"[yellow]warning: {warning}")
    for dims in check_layout(spec, nproc=nproc, min_nodes=min_nodes, max_nodes=max_nodes):
        console.print(f"layout at {dims.world_size} rank(s): {dims.describe()}")
        for note in dims.notes:
            console.print(f"[yellow]note: {note}")
    argv = torchrun_argv(spec, train=train, run_dir=run_dir, nproc=nproc, nnodes=nnodes,
                         max_restarts=max_restarts, max_steps=max_steps)
    console.print("torchrun: " + " ".join(argv[1:]), markup=False, soft_wrap=True)
    traces = TraceFilter()
    marker = refusal_file(run_dir)
    code = run_torchrun(argv, console=console, timeout_s=timeout_s, failed_ranks=failed_ranks, trace_filter=traces,
                        refusal=marker)
    for line in rank_failure_lines(traces, run_dir=run_dir):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if failures is not None:
        failures.extend(traces.failures)
    if code != 0 and refusals is not None and (recorded := read_refusal(marker)) is not None:
        refusals.append(recorded["message"])
    console.print(f"per-rank logs: {Path(run_dir) / LOGS_DIR}; exit code {code}")
    return code


def newest_rank_log(run_dir: Path, local_rank: str) -> Path | None:
    """The stderr log of this host's `local_rank` from torchrun's newest attempt (by modification time), or None.
    Only this host's log dir is read (`<run id>/attempt_<k>/<local rank>/stderr.log` under it): a run dir shared
    by every node of a job holds each node's logs, and another node's local rank of the same number is not this
    one (nor worth a scan of every node's logs on shared storage)."""
    logs = _rank_logs(run_dir, local_rank)
    return logs[0] if logs else None


def _rank_logs(run_dir: Path, local_rank: str) -> list[Path]:
    """This host's stderr logs of `local_rank`, every attempt of every torchrun run, the newest first."""
    return newest_first(host_log_dir(run_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"))


# What a rank's log ends with when it failed because a rank of another host did (gloo's, NCCL's or the store's
# word for a peer that went away, a collective that timed out waiting for one, the rendezvous the failed agent
# closed), not of its own.
PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                      "ncclRemoteError", "remote process exit", "DistNetworkError", "DistStoreError",
                      "Watchdog caught collective operation timeout", "RendezvousClosedError")
LOG_TAIL_BYTES = 65536  # of a failed rank's log, read for those signs
STOPPED_EXIT_CODES = {str(-signal.SIGTERM), str(128 + signal.SIGTERM)}  # asked to stop (the agent, the scheduler)


def rank_failures(failures: list[dict[str, str]]) -> list[dict[str, str]]:
    """The failures of torchrun's summary (`TraceFilter.failures`) that name a rank, the first failure first."""
    return sorted((f for f in failures if "rank" in f), key=lambda f: not f.get("root"))


def host_fault(failures: list[dict[str, str]], *, run_dir: Path) -> tuple[bool, str]:
    """Whether this host is to blame for a failed torchrun (the node-health file counts its crashes), and why.

    Every host's agent exits non-zero when any rank of the job dies: the other hosts' ranks fail in their next
    collective. Blaming each would exclude every healthy host of a multi-node job after one bad host's
    `cluster.unhealthy_after_crashes` failures. A failed rank of this host (torchrun's failure summary) failed of
    its own unless it was aborted by the hang watchdog (the group stopped stepping: the frozen ranks are named in
    the restart event), stopped by SIGTERM, or its log ends in a sign of a peer's failure (`PEER_FAILURE_SIGNS`);
    the host is blamed when one did: a signal (an OOM kill, a segfault), a CUDA or driver error, an exception of
    its own. No rank of this host in the summary (the agent itself stopped, e.g. on the rendezvous the failed
    host's agent closed) blames nothing."""
    from leantrain.ckpt.watchdog import HANG_EXIT_CODE

    failed = rank_failures(failures)
    if not failed:
        return False, "no rank of this host failed (torchrun's agent stopped: the failure was on another host)"
    why = []
    for failure in failed:
        rank, code = f"rank {failure['rank']} (local rank {failure.get('local_rank', '?')})", failure.get("exitcode")
        if code == str(HANG_EXIT_CODE):
            why.append(f"{rank} was aborted by the hang watchdog (the group stopped stepping; see the restart event)")
            continue
        if code in STOPPED_EXIT_CODES:
            why.append(f"{rank} was stopped (SIGTERM)")
            continue
        if (sign := _peer_failure_sign(run_dir, failure.get("local_rank", "?"), failure["rank"])) is not None:
            why.append(f"{rank} failed because a peer did: {sign}")
            continue
        return True, f"{rank} failed of its own: exit code {code or '?'}"
    return False, "; ".join(why)


RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")  # torch's prefix of a distributed rank's exception lines
LOGS_LOOKED_AT = 8  # of one local rank's newest logs on this host, for its own prefixed lines


def _peer_failure_sign(run_dir: Path, local_rank: str, rank: str) -> str | None:
    """The last line of global `rank`'s log on this host (the last LOG_TAIL_BYTES) that tells of a peer's failure,
    or None. The newest log of `local_rank` is this launch's on a host that runs one agent; any of the few newest
    may be where a line carries the rank's own `[rank N]:` prefix (agents sharing a host name), and a line with
    another rank's prefix is not this rank's."""
    for index, log in enumerate(_rank_logs(run_dir, local_rank)[:LOGS_LOOKED_AT]):
        try:
            with log.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        signs = [line.strip() for line in lines if any(sign in line for sign in PEER_FAILURE_SIGNS)
                 and ((m := RANK_PREFIX.match(line)) is None and index == 0 or m is not None and m.group(1) == rank)]
        if signs:
            return signs[-1][:200]
    return None


def rank_failure_lines(traces: TraceFilter, *, run_dir: Path) -> list[str]:
    """One line per failed rank (torchrun's summary): where, how it ended, and the log that holds its trace."""
    lines = []
    failed = rank_failures(traces.failures)
    for failure in failed:
        local = failure.get("local_rank", "?")
        host = failure.get("host", socket.gethostname())
        where = str(newest_rank_log(run_dir, local) or Path(run_dir) / LOGS_DIR)
        how = "failed first" if failure.get("root") else "stopped"
        lines.append(f"rank {failure['rank']} (local rank {local}, host {host}) {how}: exit code "
                     f"{failure.get('exitcode', '?')}; its log: {where}")
    if not failed and traces.last_errors:
        lines.append(f"error: {traces.last_errors[-1]} (trace in the rank logs under {Path(run_dir) / LOGS_DIR})")
    return lines


@dataclass(frozen=True)
class SweepPoint:
    """One size of the scaling sweep."""

    nproc: int
    tokens_per_s: float | None
    efficiency: float | None  # tokens/s ÷ (smallest size's tokens/s × nproc / smallest nproc)
    step_time_s: float | None
    comm_s: float | None
    exit_code: int | None
    skipped: str | None = None


def parse_sweep(text: str) -> list[int]:
    """`nproc=4,1,2` → [1, 2, 4], or a UserInputError naming the part that is wrong: the sizes run are exactly
    the ones typed (an empty entry, `nproc=1,,2`, a repeated one, `nproc=1,1`, or a non-ASCII digit is refused)."""
    expected = f"--sweep {text!r}: expected nproc=N1,N2,... with positive integers (e.g. nproc=1,2,4)"
    key, _, values = text.partition("=")
    if key.strip() != "nproc":
        raise UserInputError(f"{expected}; " + (f"{key.strip()!r} cannot be swept: only nproc can" if key.strip()
                                                else "the key (nproc) is missing"))
    if not values.strip():
        raise UserInputError(f"{expected}; no sizes after nproc=")
    entries = [entry.strip() for entry in values.split(",")]
    for number, entry in enumerate(entries, start=1):
        if not entry:
            raise UserInputError(f"{expected}; entry {number} is empty")
        if "=" in entry:
            raise UserInputError(f"{expected}; entry {number} ({entry!r}) repeats the key: name nproc once")
        if not (entry.isascii() and entry.isdigit() and int(entry) > 0):
            raise UserInputError(f"{expected}; entry {number} ({entry!r}) is not a positive integer")
    sizes = [int(entry) for entry in entries]
    if repeated := sorted({size for size in sizes if sizes.count(size) > 1}):
        raise UserInputError(f"{expected}; {', '.join(map(str, repeated))} listed more than once")
    return sorted(sizes)


def _steady_metrics(metrics_path: Path) -> dict[str, float] | None:
    """Mean tokens/s, step time and comm time over the logged records after the first (warm-up) one."""
    if not metrics_path.exists():
        return None
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    records = [r for r in records if "tokens_per_s" in r]
    steady = records[1:] or records
    if not steady:
        return None
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in steady) / len(steady)  # noqa: E731
    return {"tokens_per_s": mean("tokens_per_s"), "step_time_s": mean("step_time_s"), "comm_s": mean("comm_s")}


def scaling_sweep(
    spec: JobSpec, *, train: TrainCommand, run_dir: Path, sizes: list[int], steps: int, console: Console,
    timeout_s: float | None = None,
) -> list[SweepPoint]:
    """Train `steps` steps at each size (strong scaling: same global batch), write RUN_DIR/sweep.json."""
    points: list[SweepPoint] = []
    base: tuple[int, float] | None = None
    for nproc in sizes:
        try:
            check_layout(spec, nproc=nproc)
        except UserInputError as err:
            points.append(SweepPoint(nproc, None, None, None, None, None, skipped=str(err)))
            continue
        sub_dir = Path(run_dir) / "sweep" / f"nproc-{nproc}"
        argv = torchrun_argv(spec, train=train, run_dir=sub_dir, nproc=nproc, max_restarts=0, max_steps=steps)
        code = run_torchrun(argv, console=console, timeout_s=timeout_s)
        steady = _steady_metrics(sub_dir / "metrics.jsonl") if code == 0 else None
        if steady is None:
            points.append(SweepPoint(nproc, None, None, None, None, code, skipped="no metrics"))
            continue
        if base is None:
            base = (nproc, steady["tokens_per_s"])
        efficiency = steady["tokens_per_s"] / (base[1] * nproc / base[0])
        points.append(SweepPoint(nproc, steady["tokens_per_s"], efficiency, steady["step_time_s"], steady["comm_s"],
                                 code))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    summary = {"points": [asdict(p) for p in points], "stops_paying_at": stops_paying_at(points)}
    (Path(run_dir) / SWEEP_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return points


def stops_paying_at(points: list[SweepPoint], *, floor: float = EFFICIENCY_FLOOR) -> int | None:
    """The first size whose efficiency falls below `floor` or whose tokens/s does not grow; None if all pay."""
    measured = [p for p in points if p.tokens_per_s is not None and p.efficiency is not None]
    for previous, point in zip(measured, measured[1:], strict=False):
        assert point.tokens_per_s is not None and previous.tokens_per_s is not None and point.efficiency is not None
        if point.efficiency < floor or point.tokens_per_s <= previous.tokens_per_s:
            return point.nproc
    return None
