"""Node health: a file in the run dir that records hosts which failed preflight or crashed repeatedly.

`node_health.json` (owner-only, rewritten atomically under a lock, so ranks and the launcher can all write):

    {"version": 1, "hosts": {"node17": {"status": "excluded", "crashes": 2, "preflight_failures": 1,
                                         "ranks": [8, 9], "events": [{"ts": ..., "kind": ..., "reason": ...}]}}}

A host is excluded when it failed preflight or crashed `cluster.unhealthy_after_crashes` times. Crashes that
JOB_WIDE_HOSTS or more hosts recorded within JOB_WIDE_WINDOW_S of each other are the job's failure (an
out-of-memory layout, a bug every rank raises), as a preflight check every rank fails is the job's problem: they
count against no host (`job_wide_crashes`), so such a failure repeated does not exclude every host. The Slurm job
passes the excluded hosts to `--exclude` (and refreshes it before a requeue with
`python -m leantrain.launch.health RUN_DIR`); the Kubernetes job keeps its pods off them by node affinity; a local
launch refuses to start on an excluded host. `clear_host` takes a repaired host back. A host is recorded by the
name the scheduler knows it by (`node_name`): in a Kubernetes pod the node's name (the job file sets
$LEANTRAIN_NODE_NAME from the pod's spec.nodeName), not the pod's hostname, which no node affinity matches.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from leantrain.security import private_opener, redact

HEALTH_FILE_NAME = "node_health.json"
NODE_NAME_ENV = "LEANTRAIN_NODE_NAME"  # set in Kubernetes pods from spec.nodeName (the downward API)
MAX_EVENTS_PER_HOST = 50  # the file stays small however long a host keeps failing
JOB_WIDE_HOSTS = 3  # crashes of this many hosts at once are the job's, not a host's (two: either may be at fault)
JOB_WIDE_WINDOW_S = 600.0  # "at once": within this long of each other (torchrun's restarts, one job's failure)
EventKind = Literal["preflight", "crash"]


def node_name() -> str:
    """This machine as the scheduler names it: $LEANTRAIN_NODE_NAME (a pod's node), else the hostname."""
    import socket

    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def health_path(run_dir: Path) -> Path:
    return Path(run_dir) / HEALTH_FILE_NAME


@dataclass
class HostHealth:
    """What is known about one host."""

    crashes: int = 0
    preflight_failures: int = 0
    ranks: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def excluded(self, *, crash_threshold: int, job_wide: int = 0) -> bool:
        """`job_wide`: of its crashes, those that were the job's failure (`job_wide_crashes`)."""
        return self.preflight_failures > 0 or self.crashes - job_wide >= crash_threshold


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[Path]:
    """The health file's path, held under an exclusive lock (a sibling .lock file)."""
    path = health_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a", opener=private_opener) as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield path


@contextlib.contextmanager
def _locked_state(run_dir: Path) -> Iterator[dict[str, HostHealth]]:
    """Read-modify-write the health file under its lock."""
    with _locked(run_dir) as path:
        hosts = read_health(run_dir)
        yield hosts
        _write(path, hosts)


def read_health(run_dir: Path) -> dict[str, HostHealth]:
    """Hosts recorded in the run dir's health file (empty when there is none)."""
    path = health_path(run_dir)
    if not path.exists():
        return {}
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {host: HostHealth(**info) for host, info in raw.get("hosts", {}).items()}


def _write(path: Path, hosts: dict[str, HostHealth]) -> None:
    body = {"version": 1, "hosts": {h: vars(info) for h, info in sorted(hosts.items())}}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", opener=private_opener) as fh:
        json.dump(body, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def record_failure(
    run_dir: Path, *, host: str, kind: EventKind, reason: str, rank: int | None = None, ranks: Iterable[int] = ()
) -> HostHealth | None:
    """Record that `host` (running `rank`, or `ranks`) failed preflight or crashed; returns its updated record, or
    None for a crash not recorded: JOB_WIDE_HOSTS other hosts crashed within JOB_WIDE_WINDOW_S already, so it is
    the job's failure, which counts against no host (`job_wide_crashes`). Every node of a job that fails as a
    whole then reads the file and writes it only until then: 2,048 nodes each rewriting a file of 2,048 hosts
    under the lock took 40 s on a local disk (2026-12-07), and longer on shared storage."""
    now = time.time()
    with _locked(run_dir) as path:
        hosts = read_health(run_dir)
        if kind == "crash" and len(_crashed_within(hosts, now, but=host)) >= JOB_WIDE_HOSTS:
            return None
        info = hosts.setdefault(host, HostHealth())
        if kind == "preflight":
            info.preflight_failures += 1
        else:
            info.crashes += 1
        failed_ranks = sorted({*ranks, *([] if rank is None else [rank])})
        info.ranks = sorted({*info.ranks, *failed_ranks})
        info.events.append({"ts": now, "kind": kind, "ranks": failed_ranks, "reason": redact(reason)})
        del info.events[:-MAX_EVENTS_PER_HOST]
        _write(path, hosts)
        return info


def clear_host(run_dir: Path, host: str) -> bool:
    """Forget a host (after it was repaired); returns whether it was recorded."""
    with _locked_state(run_dir) as hosts:
        return hosts.pop(host, None) is not None


def _crashed_within(hosts: dict[str, HostHealth], ts: float, *, but: str) -> set[str]:
    """The hosts but `but` with a crash recorded within JOB_WIDE_WINDOW_S of `ts`."""
    return {h for h, info in hosts.items() if h != but and any(
        e.get("kind") == "crash" and isinstance(e.get("ts"), (int, float)) and abs(e["ts"] - ts) <= JOB_WIDE_WINDOW_S
        for e in info.events)}


def job_wide_crashes(hosts: dict[str, HostHealth]) -> dict[str, int]:
    """Per host, its recorded crashes that came with crashes of at least JOB_WIDE_HOSTS − 1 other hosts within
    JOB_WIDE_WINDOW_S (a sliding window over the events sorted by time: linear in the events after the sort)."""
    events = sorted((float(e["ts"]), host) for host, info in hosts.items() for e in info.events
                    if e.get("kind") == "crash" and isinstance(e.get("ts"), (int, float)))
    in_window: Counter[str] = Counter()
    out: Counter[str] = Counter()
    first = last = 0
    for ts, host in events:
        while last < len(events) and events[last][0] <= ts + JOB_WIDE_WINDOW_S:
            in_window[events[last][1]] += 1
            last += 1
        while events[first][0] < ts - JOB_WIDE_WINDOW_S:
            in_window[events[first][1]] -= 1
            if not in_window[events[first][1]]:
                del in_window[events[first][1]]
            first += 1
        if len(in_window) >= JOB_WIDE_HOSTS:
            out[host] += 1
    return dict(out)


def excluded_hosts(run_dir: Path | None, *, crash_threshold: int = 2) -> list[str]:
    """Hosts to keep jobs off, sorted: a preflight failure of their own, or `crash_threshold` crashes that were
    not the job's failure (`job_wide_crashes`)."""
    if run_dir is None:
        return []
    hosts = read_health(run_dir)
    job_wide = job_wide_crashes(hosts)
    return sorted(h for h, info in hosts.items()
                  if info.excluded(crash_threshold=crash_threshold, job_wide=job_wide.get(h, 0)))


def main(argv: list[str] | None = None) -> int:
    """Print the comma-separated exclude list (what the Slurm job uses before it requeues itself)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--crash-threshold", type=int, default=2)
    args = parser.parse_args(argv)
    print(",".join(excluded_hosts(args.run_dir, crash_threshold=args.crash_threshold)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
