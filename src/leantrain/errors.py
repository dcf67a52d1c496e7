"""Project error types: what the CLI turns into a message and a non-zero exit, without a traceback."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


class LeantrainError(Exception):
    """Base class for errors the user can act on."""

    exit_code = 2


class UserInputError(LeantrainError):
    """The user's input (spec, flag, file) is wrong; the message names it and says what is valid."""


REFUSAL_ENV = "LEANTRAIN_REFUSAL_FILE"  # set by the launchers for the ranks of one launch (launch/torchrun.py)


class AlreadyRefused(UserInputError):
    """A rank of this launch refused the job before (`earlier_refusal`): exit 2, and not recorded again."""


def record_refusal(message: str) -> None:
    """A rank refused the job (any exit 2 of `train` but one that may pass on retry: a spec, a data dir, a resume
    that does not match, a path the user named; the CLI's `main` calls this): under a launcher that set
    LEANTRAIN_REFUSAL_FILE, write the message there (atomically; the last refusing rank wins), so that torchrun's
    restarts of the same launch refuse at once (`earlier_refusal`) and the launcher stops them rather than restart
    every rank `fault.max_restarts` times. The file is the one way a launcher learns that its ranks refused the
    job. Never raises: the refusal itself is what the user sees."""
    import json
    import os
    import socket

    path = os.environ.get(REFUSAL_ENV)
    if not path or (os.environ.get("LOCAL_RANK", "0") != "0" and os.path.exists(path)):
        return  # one file write a node (its local rank 0, or the first), not one a rank on shared storage
    record = {"message": message, "rank": os.environ.get("RANK"), "host": socket.gethostname(),
              "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT")}
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # nodes (pods) writing one file may share a pid
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(tmp).write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def read_refusal(path: object) -> dict[str, Any] | None:
    """The record `record_refusal` wrote at `path`, or None (none written, or unreadable)."""
    import json

    try:
        record = json.loads(Path(str(path)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("message"), str) else None


def earlier_refusal() -> None:
    """Refuse at once (exit 2) when a rank of this launch already refused the job (`record_refusal`): a rank
    torchrun restarts after a refusal would only refuse again, after a full start."""
    import os

    path = os.environ.get(REFUSAL_ENV)
    record = read_refusal(path) if path else None
    if record is not None:
        raise AlreadyRefused(f"rank {record.get('rank')} on {record.get('host')} already refused this launch's job: "
                             f"{record['message']}")


def _first_existing(paths: Iterable[Path]) -> Path | None:
    return next((path for path in paths if path.exists()), None)


def check_output_file(path: object, option: str) -> None:
    """Refuse, before any work, an output path that cannot be written as a file: a directory, or a path under a
    file. (The parent directories are created when the file is written.)"""
    if path is None:
        return
    target = Path(str(path))
    if target.is_dir():
        raise UserInputError(f"{option} {target}: is a directory; give a file path, e.g. {target / 'out.json'}")
    found = _first_existing(target.parents)
    if found is not None and not found.is_dir():
        raise UserInputError(f"{option} {target}: {found} is a file, not a directory")


def check_output_dir(path: object, option: str) -> None:
    """Refuse, before any work, a folder to write that is a file or lies under a file (`option` names it: a flag,
    or "run dir")."""
    target = Path(str(path))
    found = _first_existing((target, *target.parents))
    if found is not None and not found.is_dir():
        where = "is a file" if found == target else f"{found} is a file"
        raise UserInputError(f"{option} {target}: {where}, not a directory")


NUMBER = (int, float)  # for json_field: an int or a float, never a bool
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}
_REQUIRED = object()


def _json_kind(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return "a number" if set(kinds) == set(NUMBER) else " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def _json_value(value: Any) -> str:
    """`a string ("fast")`: the JSON type of a value and the start of it, for an error message."""
    import json

    kind = "a boolean" if isinstance(value, bool) else _TYPE_NAMES.get(type(value), "a value")
    text = json.dumps(value, default=str)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def read_json_object(path: object, *, option: str = "") -> dict[str, Any]:
    """A JSON artifact a command reads back (plan.json, rehearsal.json, eval.json, ...) as its top-level object.
    A file that cannot be read, is not JSON (hand-edited, truncated) or is not an object is a UserInputError that
    names the file (after `option`, the flag that brought it, when given)."""
    import json

    target = Path(str(path))
    where = f"{option} {target}" if option else str(target)
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except OSError as err:
        raise UserInputError(f"{where}: cannot be read ({err.strerror or err})") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise UserInputError(f"{where}: not valid JSON ({err}); was it edited by hand or cut short?") from None
    if not isinstance(data, dict):
        raise UserInputError(f"{where}: expected a JSON object, got {_json_value(data)}")
    return data


def json_field(data: Any, key: str | tuple[str, ...], expected: type | tuple[type, ...], *, source: object,
               default: Any = _REQUIRED) -> Any:
    """`data[key]` of a JSON artifact, checked to be of the `expected` type(s) (NUMBER: int or float, not bool).
    A dotted key walks nested objects ("throughput.mfu"; a tuple of parts where a name may hold a dot); a part
    that is a number indexes a list ("ranks.0"). A missing or null value returns `default` when one is given;
    otherwise it, a wrong type or a path through a non-object is a UserInputError naming `source` (the file),
    the key and what was expected."""
    parts = key.split(".") if isinstance(key, str) else list(key)
    key = ".".join(parts)
    node: Any = data
    for depth, part in enumerate(parts):
        if node is None:
            break
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit():
            node = node[int(part)] if int(part) < len(node) else None
        else:
            where = f"key {'.'.join(parts[:depth])!r}" if depth else "the file"
            raise UserInputError(f"{source}: {where}: expected an object with {part!r}, got {_json_value(node)}")
    if node is None:
        if default is not _REQUIRED:
            return default
        raise UserInputError(f"{source}: no key {key!r} (expected {_json_kind(expected)})")
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if not isinstance(node, kinds) or (isinstance(node, bool) and bool not in kinds):
        raise UserInputError(f"{source}: key {key!r}: expected {_json_kind(expected)}, got {_json_value(node)}")
    return node


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
