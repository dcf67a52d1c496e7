"""Per-rank failure records: one small file per rank and attempt, so no two ranks ever write one shared file.

On a hang every healthy rank's watchdog fires at about the same moment, and an OOM can hit many ranks at once;
thousands of ranks appending to the shared `events.jsonl` (or one `hang.json`) at once interleave lines and
hammer the file server. Each rank instead writes `RUN_DIR/<kind>/rank-R-attempt-A.json` (written to a
temporary name, then renamed), and the readers aggregate: the next attempt's `restart` event (ckpt/hook.py),
`leantrain validate` and `leantrain doctor` (golive/). Only rank 0 also appends the matching event to
`events.jsonl`, as the one writer of that file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

HANG = "hang"
OOM = "oom"
RECORD_RE = re.compile(r"^rank-(\d+)-attempt-(\d+)\.json$")


def write_rank_record(run_dir: Path, kind: str, *, rank: int, attempt: int, record: dict[str, Any]) -> Path | None:
    """RUN_DIR/<kind>/rank-R-attempt-A.json; None when it could not be written (the failure it reports matters
    more than its record)."""
    folder = Path(run_dir) / kind
    path = folder / f"rank-{rank}-attempt-{attempt}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"kind": kind, "rank": rank, "attempt": attempt, "time": time.time(), **record})
                       + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def read_rank_records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """Every rank's record of `kind`, ordered by attempt then rank (unreadable files are skipped)."""
    folder = Path(run_dir) / kind
    out = []
    if not folder.is_dir():
        return out
    for path in folder.iterdir():
        if not (match := RECORD_RE.match(path.name)):
            continue
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(record, dict):  # the file's name says whose and when, whatever its fields were made
                out.append({**record, "rank": int(match.group(1)), "attempt": int(match.group(2))})
    return sorted(out, key=lambda r: (r["attempt"], r["rank"]))


def merged_events(events: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` of one kind plus the per-rank records that no event already reports (same rank and attempt)."""
    seen = {(e.get("rank"), e.get("attempt")) for e in events}
    return [*events, *(r for r in records if (r.get("rank"), r.get("attempt")) not in seen)]
