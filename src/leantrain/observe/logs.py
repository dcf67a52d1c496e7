"""Every process log a run dir holds, where each writer puts it, and which error lines a planned fault explains.

Where logs are found (relative to the run dir):
- torchrun's per-rank files: `logs/<host>/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log`
  (`--log-dir --redirects 3 --tee 3`, launch/torchrun.py),
- Slurm's job output: `slurm-<job id>.out` and `logs/slurm-*.out` (the sbatch file's `--output`),
- a pod's console: `logs/pod-<pod name>.log` (the Kubernetes job tees its output there),
- any other `*.log` in the run dir or in `logs/` (audit.log holds commands, not process output).

Each file is read line by line: up to MAX_HITS_PER_FILE error lines from anywhere in it, and the last
LOG_TAIL_LINES lines of the MAX_TAIL_FILES newest files (a job of 2,048 nodes writes 16,384 ranks' stdout and
stderr: a tail of each would be gigabytes, and what a tail shows, a start stuck in the rendezvous or NCCL's set-up,
shows on every rank), so memory stays bounded on any number of ranks and any log length.

A planned fault (a drill kill, recorded as `restart` events with `planned: true`) ends the attempts before
it: error lines in torchrun's attempt_<k> with k < the number of planned restarts are the kill's echo (the
survivors' broken collectives), not a new problem. Out-of-memory and CUDA errors are never explained by a kill.
In a log with no attempt in its path, only lines that name the kill signal are explained.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

LOG_TAIL_LINES = 400  # enough to hold a traceback and the lines that led to it
MAX_HITS_PER_FILE = 20
MAX_TAIL_FILES = 256  # the newest files (by modification time) whose tails are kept
ERROR_RE = re.compile(r"Traceback \(most recent call last\)|out of memory|OutOfMemoryError|NCCL error|"
                      r"CUDA error|ChildFailedError|RuntimeError|Segmentation fault|illegal memory access",
                      re.IGNORECASE)
NEVER_PLANNED_RE = re.compile(r"out of memory|OutOfMemoryError|CUDA error|illegal memory access|ECC",
                              re.IGNORECASE)
KILL_SIGNAL_RE = re.compile(r"SIGKILL|signal 9\b|exitcode\s*:\s*-9\b|Signals\.SIGKILL", re.IGNORECASE)
TORCHRUN_RE = re.compile(r"^logs/(?P<host>[^/]+)/(?P<run_id>[^/]+)/attempt_(?P<attempt>\d+)/(?P<rank>\d+)/"
                         r"(?P<stream>stdout|stderr)\.log$")
SKIPPED_NAMES = {"audit.log"}


@dataclass
class LogFile:
    """One log file: where it is, who wrote it, its tail and its error lines."""

    path: str  # relative to the run dir
    source: str  # torchrun | slurm | pod | file
    host: str | None = None
    attempt: int | None = None
    local_rank: int | None = None
    tail: list[str] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """Short name for evidence: `node1 attempt 0 local rank 1 (stderr)` or the path."""
        if self.source != "torchrun":
            return self.path
        stream = Path(self.path).stem
        return f"{self.host} attempt {self.attempt} local rank {self.local_rank} ({stream})"


@dataclass(frozen=True)
class LogError:
    """One error line, where it came from, and whether the planned fault explains it."""

    log: str  # the file's label
    line: str
    planned: bool
    path: str = ""  # relative to the run dir

    def __str__(self) -> str:
        return f"{self.log}: {self.line.strip()[:160]}"


def log_paths(run_dir: Path) -> list[Path]:
    """Every process log under the run dir (not the drill's own run dirs: they are runs of their own)."""
    run_dir = Path(run_dir)
    found = {*run_dir.glob("*.log"), *run_dir.glob("slurm-*.out"), *run_dir.glob("logs/*.log"),
             *run_dir.glob("logs/slurm-*.out"), *run_dir.glob("logs/*/*/attempt_*/*/std*.log")}
    return sorted(p for p in found if p.is_file() and p.name not in SKIPPED_NAMES)


def read_log(run_dir: Path, path: Path, *, keep_tail: bool = True) -> LogFile:
    rel = path.relative_to(run_dir).as_posix()
    match = TORCHRUN_RE.match(rel)
    if match:
        log = LogFile(rel, "torchrun", host=match["host"], attempt=int(match["attempt"]),
                      local_rank=int(match["rank"]))
    else:
        source = "slurm" if path.name.startswith("slurm-") else "pod" if path.name.startswith("pod-") else "file"
        log = LogFile(rel, source)
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES if keep_tail else 0)
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for raw in handle:
                line = raw.rstrip("\n")
                tail.append(line)
                if len(log.error_lines) < MAX_HITS_PER_FILE and ERROR_RE.search(line):
                    log.error_lines.append(line)
    except OSError:
        return log
    log.tail = list(tail)
    return log


def newest_first(paths: Iterable[Path]) -> list[Path]:
    """`paths` by modification time, the newest first (among equal times the later of `paths` first; a file removed
    since it was listed last)."""

    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    return sorted(paths, key=mtime)[::-1]


def read_logs(run_dir: Path) -> list[LogFile]:
    """Every log's error lines; the tails of the MAX_TAIL_FILES newest."""
    paths = log_paths(run_dir)
    newest = set(newest_first(paths)[:MAX_TAIL_FILES])
    return [read_log(Path(run_dir), p, keep_tail=p in newest) for p in paths]


def log_errors(logs: list[LogFile], *, planned_restarts: int) -> list[LogError]:
    """Every error line, each marked planned when the planned fault (`planned_restarts` kills) explains it."""
    out = []
    for log in logs:
        for line in log.error_lines:
            planned = False
            if planned_restarts > 0 and not NEVER_PLANNED_RE.search(line):
                if log.attempt is not None:
                    planned = log.attempt < planned_restarts
                else:
                    planned = bool(KILL_SIGNAL_RE.search(line))
            out.append(LogError(log.label, line, planned, log.path))
    return out
