"""Checkpoint error types and the one-line form of a storage failure.

Storage errors come from many layers (OSError from a disk, botocore's EndpointConnectionError through s3fs,
DCP's CheckpointException wrapping one failure per rank with the remote traceback): `one_line` reduces any of
them to `Type: message [errno N, file F]` for the final message, events and alerts; the full trace goes to the
rank's log only.
"""

from __future__ import annotations

import errno as errno_names
from typing import Any

from leantrain.errors import LeantrainError

MAX_MESSAGE_CHARS = 300


class CheckpointSaveError(LeantrainError):
    """A save failed; earlier checkpoints are intact. The trainer alerts and keeps training, and stops (exit 1)
    after `checkpoint.max_consecutive_failures` failures in a row: the CLI shows the message, no traceback.
    `operation` names what failed (prepare, write, commit, discard, list, retention)."""

    exit_code = 1

    def __init__(self, step: int, message: str, *, where: str | None = None, operation: str | None = None) -> None:
        what = f" ({operation})" if operation else ""
        super().__init__(f"checkpoint save of step {step}{f' to {where}' if where else ''} failed{what}: {message}")
        self.step = step
        self.operation = operation


class CheckpointLoadError(LeantrainError):
    """No checkpoint could be resumed from and training must not start fresh: exit 1 when the stored
    checkpoints failed after the live state was partly overwritten, exit 2 when the user must choose (every
    checkpoint is invalid, the key does not match, the schedule changed)."""

    exit_code = 1

    def __init__(self, message: str, *, user_input: bool = False) -> None:
        super().__init__(message)
        if user_input:
            self.exit_code = 2


def root_cause(err: BaseException) -> BaseException:
    """The first rank's underlying exception of DCP's CheckpointException, else the error itself."""
    failures: dict[int, Any] | None = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]  # (exception, traceback summary) per rank
        inner = first[0] if isinstance(first, tuple) else getattr(first, "exc", first)
        if isinstance(inner, BaseException):
            return root_cause(inner)
    return err


def one_line(err: BaseException) -> str:
    """`Type: first line of the message`, with errno name and file when the cause is an OSError."""
    cause = root_cause(err)
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    if isinstance(cause, OSError) and cause.errno is not None:
        name = errno_names.errorcode.get(cause.errno, str(cause.errno))
        text = f"{cause.strerror or text} [{name}" + (f", file {cause.filename}]" if cause.filename else "]")
    return f"{type(cause).__name__}: {text}"[:MAX_MESSAGE_CHARS]
