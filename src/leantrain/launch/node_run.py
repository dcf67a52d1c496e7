"""The training step of one node of a Slurm job or one pod of a Kubernetes job: torchrun run by leantrain, so that
a crash of this node is recorded against it in `node_health.json` (launch/health.py), as a local `leantrain
launch` records one.

`python -m leantrain.launch.node_run RUN_DIR [--forward-signals] -- torchrun ARGS...` runs the torchrun command
with this node's log flags added after `torchrun` (`--log-dir=RUN_DIR/logs/<host> --redirects=3 --tee=3
--local-ranks-filter=0`: each rank's output in its own file, local rank 0's also on the console, as `leantrain
launch` runs it). Tracebacks and
torchrun's failure summary stay off the console (they are in the rank logs); one line per failed rank says where
its log is. When torchrun fails and no rank recorded a refusal (`$LEANTRAIN_REFUSAL_FILE`, errors.record_refusal),
the crash is recorded against this node (health.node_name) if one of its ranks failed of its own
(torchrun.host_fault: not when it only saw a rank of another node fail). The step exits with torchrun's code.
torchrun runs in this step's process group, so Slurm's SIGTERM (scancel, preemption) reaches it once, as it did
without this step around it (its agent passes it on to the ranks: a checkpoint, then exit); the step itself
waits for torchrun through SIGTERM and SIGINT (Slurm's KillWait bounds that). With `--forward-signals` (a pod,
where only the container's shell is signalled and passes it on to this step) torchrun runs in a session of its
own and this step passes SIGTERM and SIGINT on to it, then waits likewise (the pod's grace period bounds that).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from leantrain.errors import REFUSAL_ENV, read_refusal
from leantrain.launch import torchrun
from leantrain.launch.health import node_name, record_failure


def node_argv(command: list[str], run_dir: Path) -> list[str]:
    """`command` (torchrun and its arguments) with this node's log flags after `torchrun`."""
    if not command or Path(command[0]).name != "torchrun":
        raise SystemExit(f"node_run: expected `-- torchrun ARGS...`, got {command[:1] or 'nothing'}")
    flags = [f"--log-dir={torchrun.host_log_dir(run_dir)}", "--redirects=3", "--tee=3", "--local-ranks-filter=0"]
    return [command[0], *flags, *command[1:]]


def run_node(run_dir: Path, command: list[str], *, console: Console, forward_signals: bool = False) -> int:
    """Run the node's torchrun (`command`), record a crash of this node; returns torchrun's exit code."""
    traces, failed_ranks, started = torchrun.TraceFilter(), list[int](), list[subprocess.Popen]()

    def wait_for_torchrun(signum: int, _frame: object) -> None:  # a handler, not SIG_IGN, which torchrun would inherit
        if forward_signals:
            for proc in started:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signum)
        console.print(f"leantrain: {signal.Signals(signum).name}: waiting for torchrun to stop", markup=False)

    previous = {sig: signal.signal(sig, wait_for_torchrun) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = torchrun.run_torchrun(node_argv(command, run_dir), console=console, failed_ranks=failed_ranks,
                                     trace_filter=traces, new_session=forward_signals, started=started)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for line in torchrun.rank_failure_lines(traces, run_dir=run_dir):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    refusal = os.environ.get(REFUSAL_ENV)
    if code == 0 or (refusal and read_refusal(Path(refusal)) is not None):
        return code  # a refusal is the job's input, not this node's crash (the job script says which)
    host = node_name()
    blamed, why = torchrun.host_fault(traces.failures, run_dir=run_dir)
    if blamed:
        info = record_failure(run_dir, host=host, kind="crash", reason=f"torchrun exit code {code}: {why}",
                              ranks=failed_ranks)
        recorded = "a failure of the whole job, not recorded" if info is None else \
            f"crash {info.crashes} recorded in node_health.json"
        console.print(f"leantrain: {host} crashed: {why} ({recorded})", markup=False, highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"leantrain: torchrun exit code {code}; not counted against {host}: {why}", markup=False,
                      highlight=False, soft_wrap=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m leantrain.launch.node_run",
                                     usage="%(prog)s RUN_DIR [--forward-signals] -- torchrun ARGS...")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--forward-signals", action="store_true",
                        help="torchrun in a session of its own; SIGTERM and SIGINT passed on to it (a pod)")
    words = sys.argv[1:] if argv is None else argv
    if "--" not in words:
        parser.error("expected `-- torchrun ARGS...` after the options")
    at = words.index("--")
    args = parser.parse_args(words[:at])
    return run_node(args.run_dir, words[at + 1:], console=Console(highlight=False, soft_wrap=True),
                    forward_signals=args.forward_signals)


if __name__ == "__main__":
    sys.exit(main())
