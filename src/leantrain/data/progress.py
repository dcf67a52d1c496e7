"""Rich progress bars for the prepare stages: documents done, docs/s and MB/s, elapsed time, and for
stages over input files a bar and ETA by bytes (advanced as each task finishes, on any executor).

Without a console (tests, library use) every call is a no-op, so the pipeline code has no branches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

UPDATE_EVERY_S = 0.1


class RateColumn(ProgressColumn):
    """docs, docs/s and MB/s from the task's own counters (rich's speed column knows one unit only)."""

    def render(self, task: Task) -> Text:
        elapsed = max(task.elapsed or 0.0, 1e-9)
        docs = task.fields.get("docs", 0)
        mb = task.fields.get("num_bytes", 0) / 1e6
        return Text(f"{docs:>9,} docs  {docs / elapsed:>9,.0f} docs/s  {mb / elapsed:>7.1f} MB/s", style="cyan")


class StageProgress:
    """One progress line per stage task; counters are pushed to rich at most every UPDATE_EVERY_S."""

    def __init__(self, console: Console | None) -> None:
        self._progress = (
            Progress(SpinnerColumn(), TextColumn("[bold]{task.description:<24}"), BarColumn(bar_width=20),
                     RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
            if console is not None else None
        )
        self._counts: dict[int, list[float]] = {}
        self._next_id = 0

    def __enter__(self) -> StageProgress:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.__exit__(kind, err, tb)

    def start(self, description: str, *, total_bytes: int | None = None) -> int:
        """A progress line; with `total_bytes` it shows a bar and an ETA by bytes done."""
        if self._progress is None:
            self._next_id += 1
            return self._next_id
        task = self._progress.add_task(description, total=total_bytes, docs=0, num_bytes=0)
        self._counts[task] = [0, 0, 0.0]
        return task

    def advance(self, task: int, *, docs: int, num_bytes: int) -> None:
        if self._progress is None:
            return
        counts = self._counts[task]
        counts[0] += docs
        counts[1] += num_bytes
        now = time.monotonic()
        if now - counts[2] >= UPDATE_EVERY_S:
            counts[2] = now
            self._progress.update(task, docs=int(counts[0]), num_bytes=int(counts[1]), completed=int(counts[1]))

    def counted(self, task: int, texts: Iterator[str]) -> Iterator[str]:
        """Pass texts through, counting them on `task` (for consumers such as the BPE trainer)."""
        for text in texts:
            self.advance(task, docs=1, num_bytes=len(text.encode("utf-8")))
            yield text

    def finish(self, task: int) -> None:
        if self._progress is None:
            return
        counts = self._counts[task]
        self._progress.update(task, docs=int(counts[0]), num_bytes=int(counts[1]), completed=int(counts[1]))
        self._progress.stop_task(task)
