"""Checkpoint events as JSON lines in run_dir/events.jsonl, read by observe/validate/drill.

One object per line: {"time": unix seconds, "event": name, "kind": name, ...fields}. The name is written under
both keys because observe's reader (observe/report_data.py) keys on "kind"; names are in docs/checkpoints.md.
Only rank 0 writes, so lines never interleave across processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("leantrain.ckpt")

# Events that mean something went wrong: also passed to the alert callback.
ALERT_EVENTS = frozenset(
    {"checkpoint_failed", "checkpoint_invalid", "checkpoint_fallback", "checkpoint_load_failed",
     "checkpoint_none_valid", "checkpoint_delete_failed", "checkpoint_abandoned", "checkpoint_misnamed",
     "checkpoint_other_model", "memory_checkpoint_failed", "memory_tier_disabled"}
)

# Events that change or use what is stored: also appended to the run's hash-chained audit.log.
AUDIT_EVENTS = frozenset(
    {"checkpoint_saved", "checkpoint_failed", "checkpoint_deleted", "checkpoint_loaded", "checkpoint_invalid",
     "checkpoint_fallback", "checkpoint_abandoned", "checkpoint_requested", "preemption_requested",
     "checkpoint_moved_aside"}
)

AlertCallback = Callable[[str, dict[str, Any]], None]
AuditCallback = Callable[..., Any]


class EventLog:
    """Appends events (thread-safe: async saves report from a worker thread)."""

    def __init__(
        self, path: Path | None, *, on_alert: AlertCallback | None = None, audit: AuditCallback | None = None
    ) -> None:
        self.path = path
        self.on_alert = on_alert
        self.audit = audit  # e.g. security.AuditLog(...).append
        self._lock = threading.Lock()
        self._held: tuple[int, list[str]] | None = None  # (thread, warnings) while console_held() holds them
        self._write_error = ""  # the last append error said (each said once)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"time": time.time(), "event": event, "kind": event, **fields}
        line = json.dumps(record, default=str)
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as out:
                out.write(line + "\n")
                out.flush()
        except OSError as err:  # a full or read-only run dir: the record is lost, never the save it reports
            # (rank 0 raising here inside a save left the other ranks in its collectives); said once per error
            if str(err) != self._write_error:
                self._write_error = str(err)
                log.warning("events.jsonl: cannot append (%s); %s and later events are not recorded", err, event)
        if self.audit is not None and event in AUDIT_EVENTS:
            try:
                self.audit(event.replace("_", ".", 1), **fields)
            except Exception as err:  # noqa: BLE001 - the audit trail must never stop a save or a resume
                # e.g. OSError, or UserInputError for an audit.log whose last line was edited; the event line
                # above is kept, and `leantrain runs RUN_DIR` reports the broken chain.
                log.warning("audit.log append failed for %s: %s: %s", event, type(err).__name__, err)
        if event in ALERT_EVENTS:
            message = f"{event}: {fields}"
            held = self._held
            if held is not None and held[0] == threading.get_ident():
                held[1].append(message)
            else:
                log.warning("%s", message)
            if self.on_alert is not None:
                self.on_alert(event, record)

    @contextlib.contextmanager
    def console_held(self, *, drop_on: type[BaseException]) -> Iterator[None]:
        """Hold the console warnings of alert events this thread emits inside and print them on the way out,
        unless a `drop_on` exception leaves the block (a refusal whose one-line error names every reason). The
        events file and the alert callback get each event at once either way."""
        held: list[str] = []
        self._held = (threading.get_ident(), held)
        dropped = False
        try:
            yield
        except drop_on:
            dropped = True
            raise
        finally:
            self._held = None
            if not dropped:
                for message in held:
                    log.warning("%s", message)
