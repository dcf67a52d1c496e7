"""Free disk space for the `low_disk` alert: every folder a run writes to, one message for all of them."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def existing_parent(path: Path) -> Path:
    """A folder not created yet (a checkpoint location before the first save) is on its parent's disk."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def watched_dirs(spec: Any, *, run_dir: Path) -> list[Path]:
    """The run dir, a local checkpoint location elsewhere (checkpoint.url) and the staged data dir."""
    dirs = [Path(run_dir)]
    ck = spec.checkpoint
    if ck.storage == "local" and ck.url:
        dirs.append(Path(ck.url))
    if getattr(spec.cluster, "data_url", None):
        dirs.append(Path(spec.data.dir))
    return list(dict.fromkeys(dirs))


def disk_report(paths: Sequence[Path], rule: Any) -> tuple[bool, str]:
    """(any folder low or unreadable, a message naming those, else every folder's free space).
    `rule` has min_free_bytes and min_free_fraction (observe/alerts.py's LowDiskRule)."""
    problems, states = [], []
    for path in paths:
        try:
            usage = shutil.disk_usage(existing_parent(path))
        except OSError as err:
            problems.append(f"cannot stat {path}: {err}")
            continue
        low = usage.free < rule.min_free_bytes or usage.free < rule.min_free_fraction * usage.total
        state = f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB at {path}"
        (problems if low else states).append(state)
    limit = f"(limit {rule.min_free_bytes / 2**30:.1f} GiB or {rule.min_free_fraction:.0%})"
    return bool(problems), "; ".join(problems or states) + f" {limit}"
