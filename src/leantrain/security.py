"""Security helpers every stage uses: secret redaction, owner-only files, and a tamper-evident audit log.

- Secrets live only in the environment (the spec holds `${VAR}` references). `redact(text)` replaces every
  secret value currently in the environment (variables the spec refers to, variables named like secrets,
  and `security.secret_env`) plus well-known credential shapes with `***`. `RedactingFilter` does the same
  for every logging record; `install_log_redaction()` puts it on the root logger's handlers.
- `make_private_dir` / `private_open` / `restrict_tree` create run dirs and checkpoints readable by the
  owner only (0700 dirs, 0600 files), whatever the umask.
- `AuditLog` is append-only JSONL with a SHA-256 hash chain: each line stores the previous line's hash, so
  editing, deleting or reordering any line breaks `verify()` at that line. (Cutting lines off the end is not
  detectable from the file alone; the registry keeps each run's last audit hash for that.)
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leantrain.errors import UserInputError
from leantrain.spec.load import is_secret_key

if TYPE_CHECKING:
    from leantrain.spec import JobSpec

REDACTED = "***"
# Shorter values are left alone: redacting "1" or "on" would mangle every log line.
MIN_SECRET_CHARS = 6
# Variable names that hold credentials even when the spec does not name them.
SECRET_ENV_NAME_RE = re.compile(
    r"(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY|AUTH)", re.IGNORECASE
)
# Credential shapes that are secret wherever they appear (even if not in this process's environment).
SECRET_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),  # AWS access key ids
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\g<1>" + REDACTED),  # HTTP bearer tokens
    (re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\g<1>" + REDACTED + "@"),  # scheme://user:PASSWORD@host
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), REDACTED),  # Hugging Face tokens
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"), REDACTED),  # GitHub tokens
]


def spec_secret_env_names(spec: JobSpec | None) -> set[str]:
    """Environment variables the spec names as secrets: every `${VAR}` reference plus security.secret_env."""
    if spec is None:
        return set()
    names: set[str] = set(spec.security.secret_env)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str) and node.startswith("${") and node.endswith("}"):
            names.add(node[2:-1])

    walk(spec.model_dump(mode="json"))
    return names


def is_secret_env_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    return bool(SECRET_ENV_NAME_RE.search(name)) or is_secret_key(name)


def secret_values(*, spec: JobSpec | None = None, env: dict[str, str] | None = None) -> list[str]:
    """Secret values present in the environment now, longest first (so overlapping values redact fully)."""
    env = dict(os.environ) if env is None else env
    wanted = spec_secret_env_names(spec)
    values = {
        value for name, value in env.items()
        if (name in wanted or is_secret_env_name(name)) and len(value) >= MIN_SECRET_CHARS
    }
    return sorted(values, key=len, reverse=True)


def redact(text: str, *, spec: JobSpec | None = None, secrets: Iterable[str] | None = None) -> str:
    """Replace secret values (from the environment, or `secrets`) and credential shapes with `***`."""
    values = secret_values(spec=spec) if secrets is None else sorted(set(secrets), key=len, reverse=True)
    for value in values:
        if value and value in text:
            text = text.replace(value, REDACTED)
    for pattern, replacement in SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_obj(obj: Any, *, spec: JobSpec | None = None, secrets: list[str] | None = None) -> Any:
    """Redact every string inside a JSON-like object (dict keys are kept: they are names, not values)."""
    values = secret_values(spec=spec) if secrets is None else secrets
    if isinstance(obj, str):
        return redact(obj, secrets=values)
    if isinstance(obj, dict):
        return {k: redact_obj(v, secrets=values) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_obj(v, secrets=values) for v in obj]
    return obj


class RedactingFilter(logging.Filter):
    """A logging filter that rewrites each record's message with secrets replaced by `***`.

    It formats the message once (msg % args) and drops the args, so a secret passed as an argument is
    caught too. Exception text is redacted by formatting it into the message.
    """

    def __init__(self, *, spec: JobSpec | None = None) -> None:
        super().__init__()
        self._spec = spec

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            record.exc_info = None
            record.exc_text = None
        record.msg = redact(message, spec=self._spec)
        record.args = None
        return True


def install_log_redaction(*, spec: JobSpec | None = None, logger: logging.Logger | None = None) -> RedactingFilter:
    """Attach one RedactingFilter to every handler of `logger` (default: root), which also covers records
    propagated from child loggers; a logger filter alone would not."""
    target = logger or logging.getLogger()
    redacting = RedactingFilter(spec=spec)
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(redacting)
    return redacting


# ---- owner-only permissions -------------------------------------------------------------------------

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dir(path: Path, *, owner_only: bool = True) -> Path:
    """Create `path` (and parents) and make it 0700 regardless of the umask (parents keep their mode)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if owner_only:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def private_opener(path: str, flags: int) -> int:
    """`open(..., opener=private_opener)`: a new file is created 0600, never briefly world-readable."""
    return os.open(path, flags, PRIVATE_FILE_MODE)


def write_private_text(path: Path, text: str, *, spec: JobSpec | None = None) -> None:
    """Write redacted text atomically to a 0600 file (temp file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", opener=private_opener) as fh:
            fh.write(redact(text, spec=spec))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, PRIVATE_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:  # e.g. `path` is a folder: no hidden temp file is left beside it
        tmp.unlink(missing_ok=True)
        raise


def restrict_tree(root: Path) -> int:
    """Make every dir under `root` 0700 and every file 0600 (e.g. a checkpoint after it is written).
    Returns how many entries were changed."""
    changed = 0
    for entry in [Path(root), *Path(root).rglob("*")]:
        if entry.is_symlink():
            continue
        want = PRIVATE_DIR_MODE if entry.is_dir() else PRIVATE_FILE_MODE
        if stat.S_IMODE(entry.stat().st_mode) != want:
            os.chmod(entry, want)
            changed += 1
    return changed


def permission_problems(root: Path) -> list[str]:
    """Entries under `root` that group or others can read, write or enter (empty when all are private)."""
    problems = []
    for entry in [Path(root), *Path(root).rglob("*")]:
        if entry.is_symlink():
            continue
        mode = stat.S_IMODE(entry.stat().st_mode)
        if mode & 0o077:
            problems.append(f"{entry}: mode {mode:o} lets group/others in (want owner-only)")
    return problems


# ---- audit log --------------------------------------------------------------------------------------

GENESIS_HASH = "0" * 64


def _user() -> str:
    """The login name, or the uid where there is none (a container user without a passwd entry)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _entry_hash(entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class AuditVerification:
    """Result of checking an audit log's hash chain."""

    ok: bool
    num_entries: int
    last_hash: str
    bad_line: int | None = None  # 1-based line number of the first broken entry
    reason: str = ""


class AuditLog:
    """Append-only JSONL log of commands and checkpoint events, each line chained to the previous by hash.

    Safe for several processes (ranks) appending to one file: an exclusive flock covers read-last-hash and
    append. Every string field is redacted before it is written.
    """

    def __init__(self, path: Path, *, spec: JobSpec | None = None) -> None:
        self.path = Path(path)
        self._spec = spec

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b", opener=private_opener) as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield fh
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    @staticmethod
    def _cut_torn_tail(fh: Any) -> bytes:
        """A writer killed mid-line leaves a fragment without a newline: cut it off (it never was an entry)
        and return it, so the chain continues from the last whole entry and the cut is itself recorded."""
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size == 0:
            return b""
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return b""
        block = min(size, 65536)
        while True:
            fh.seek(size - block)
            tail = fh.read(block)
            if b"\n" in tail or block == size:
                keep = size - block + (tail.rfind(b"\n") + 1 if b"\n" in tail else 0)
                fh.seek(keep)
                fragment = fh.read()
                fh.truncate(keep)
                return fragment
            block = min(size, block * 2)

    def _last_entry(self, fh: Any) -> dict[str, Any] | None:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size == 0:
            return None
        block = min(size, 65536)
        while True:
            fh.seek(size - block)
            tail = fh.read(block).rstrip(b"\n")
            if b"\n" in tail or block == size:
                try:
                    return json.loads(tail.rsplit(b"\n", 1)[-1])
                except json.JSONDecodeError:
                    raise UserInputError(
                        f"audit log {self.path}: its last entry is not JSON (edited?); `leantrain runs RUN_DIR` "
                        "shows where the chain breaks; move the file aside to start a new chain"
                    ) from None
            block = min(size, block * 2)

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event (e.g. "command", "checkpoint.save") with its fields; returns the written entry."""
        secrets = secret_values(spec=self._spec)
        with self._locked() as fh:
            fragment = self._cut_torn_tail(fh)
            if fragment:
                self._write_entry(fh, self._last_entry(fh), "audit.torn_tail",
                                  {"removed_bytes": len(fragment), "sha256": hashlib.sha256(fragment).hexdigest()})
            return self._write_entry(fh, self._last_entry(fh), event, redact_obj(fields, secrets=secrets))

    @staticmethod
    def _write_entry(fh: Any, last: dict[str, Any] | None, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "seq": 0 if last is None else int(last["seq"]) + 1,
            "ts": time.time(),
            "event": event,
            "user": _user(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "fields": fields,
            "prev": GENESIS_HASH if last is None else last["hash"],
        }
        entry["hash"] = _entry_hash(entry)
        line = json.dumps(entry, sort_keys=True, ensure_ascii=False, default=str) + "\n"
        fh.seek(0, os.SEEK_END)
        fh.write(line.encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
        return entry

    def entries(self) -> list[dict[str, Any]]:
        """All entries, in order (no verification)."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def verify(self) -> AuditVerification:
        """Recompute the chain; the first line whose hash, predecessor or sequence is wrong is reported."""
        if not self.path.exists():
            return AuditVerification(ok=True, num_entries=0, last_hash=GENESIS_HASH)
        prev, count = GENESIS_HASH, 0
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), start=1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                return AuditVerification(False, count, prev, number, f"not JSON ({err.msg})")
            if not isinstance(entry, dict) or "hash" not in entry:
                return AuditVerification(False, count, prev, number, "not an audit entry (no hash)")
            if entry.get("prev") != prev:
                return AuditVerification(False, count, prev, number, "chain broken: a line before it was "
                                         "removed, inserted or reordered")
            if entry.get("seq") != count:
                return AuditVerification(False, count, prev, number, f"sequence {entry.get('seq')}, expected {count}")
            if _entry_hash(entry) != entry["hash"]:
                return AuditVerification(False, count, prev, number, "content does not match its hash (edited)")
            prev, count = entry["hash"], count + 1
        return AuditVerification(ok=True, num_entries=count, last_hash=prev)
