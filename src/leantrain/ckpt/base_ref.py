"""The base a run started from (`model.init_from`), referenced by hash: RUN_DIR/base_model.json.

A LoRA checkpoint holds only the adapters and their optimizer state, so the frozen base must be the same
files at export (and resume) as at the start: the record names the directory and the sha256 of each file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leantrain.data.shards import sha256_file
from leantrain.errors import UserInputError
from leantrain.spec.schema import JobSpec

BASE_FILE = "base_model.json"
BASE_PATTERNS = ("config.json", "*.safetensors", "model.safetensors.index.json")


def base_files(hf_dir: Path) -> list[Path]:
    return sorted({p for pattern in BASE_PATTERNS for p in Path(hf_dir).glob(pattern)})


def base_share(spec: JobSpec, *, rank: int, world_size: int) -> dict[str, str]:
    """The sha256 of this rank's share of the base's files (every world_size-th from `rank`): the ranks hash the
    base together at start, each file read by one rank. One rank hashing a 405B base alone (~800 GB, ~10 minutes
    at 1.2 GB/s) held every other rank in the first collective past its timeout, at every start."""
    hf_dir = spec.model.init_from
    if hf_dir is None:
        return {}
    return {p.name: sha256_file(p) for p in base_files(Path(hf_dir))[rank::world_size]}


def record_base(run_dir: Path, spec: JobSpec, *, digests: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Write RUN_DIR/base_model.json (rank 0): where the starting weights are and the sha256 of each file
    (`digests`, the ranks' `base_share`s together; hashed here when not given).

    Kept when it already matches (a resumed run); a base that changed since is refused: a LoRA checkpoint's
    adapters only make sense on the base they were trained on."""
    hf_dir = spec.model.init_from
    if hf_dir is None:
        return None
    files = digests if digests is not None else base_share(spec, rank=0, world_size=1)
    record = {"init_from": str(Path(hf_dir).resolve()), "task": spec.task, "method": spec.finetune.method,
              "files": dict(sorted(files.items()))}
    path = Path(run_dir) / BASE_FILE
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("files") != record["files"]:
            raise UserInputError(f"{path}: the run was started from other weights than {hf_dir} holds now "
                                 "(sha256 differs); point model.init_from at the original checkpoint")
        return old
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def verify_base(run_dir: Path) -> Path:
    """The base checkpoint a run started from, after checking its files still hash as recorded."""
    path = Path(run_dir) / BASE_FILE
    record = json.loads(path.read_text(encoding="utf-8"))
    hf_dir = Path(record["init_from"])
    for name, digest in record["files"].items():
        file = hf_dir / name
        if not file.is_file() or sha256_file(file) != digest:
            raise UserInputError(f"{file}: missing or changed since the run started (sha256 recorded in {path})")
    return hf_dir
