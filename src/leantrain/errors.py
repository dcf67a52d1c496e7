"""Project error types: what the CLI turns into a message and a non-zero exit, without a traceback."""

from __future__ import annotations


class LeantrainError(Exception):
    """Base class for errors the user can act on."""

    exit_code = 2


class UserInputError(LeantrainError):
    """The user's input (spec, flag, file) is wrong; the message names it and says what is valid."""


def check_output_file(path: object, option: str) -> None:
    """Refuse, before any work, an output path that cannot be written as a file: a directory, or a path under a
    file. (The parent directories are created when the file is written.)"""
    from pathlib import Path

    if path is None:
        return
    target = Path(str(path))
    if target.is_dir():
        raise UserInputError(f"{option} {target}: is a directory; give a file path, e.g. {target / 'out.json'}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserInputError(f"{option} {target}: {parent} is a file, not a directory")
            break


class SpecError(UserInputError):
    """A job spec failed to load or validate. `problems` holds one line per bad field."""

    def __init__(self, problems: list[str], *, source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid job spec{where}:\n{lines}")


class CheckFailed(LeantrainError):
    """A check (validate, drill) ran and failed; exit 1 by the CLI contract."""

    exit_code = 1


class Interrupted(LeantrainError):
    """SIGINT/SIGTERM stopped a run after it saved its current step: exit 130/143 (128 + the signal number)."""

    def __init__(self, message: str, *, signal_name: str = "SIGINT") -> None:
        import signal

        super().__init__(message)
        self.exit_code = 128 + int(getattr(signal, signal_name, signal.SIGTERM))
