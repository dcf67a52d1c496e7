"""Each checkpoint's `lineage.json` and its row in the run registry.

The run dir's `lineage.json` (provenance/lineage.py, written by rank 0 when training starts) says what produced the
run. A checkpoint carries a short copy: the step, where it was saved, and the run lineage's identifying hashes
(run_id, attempt, git commit, spec hash, data manifest hash, packages hash, torch, image digest) with a
pointer to the full file (its path and sha256). The copy travels as one of the manager's `extra_files`, so it
is listed and hashed in the checkpoint's manifest and encrypted like every other file of the checkpoint.
Its keys mirror the run lineage's (`code.git.commit`, `spec.sha256`, `data.manifest_sha256`, ...), so the
registry and `leantrain runs RUN_DIR` read both the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from leantrain.provenance.lineage import LINEAGE_FILE_NAME

log = logging.getLogger("leantrain.ckpt")
CHECKPOINT_LINEAGE_VERSION = 1


def checkpoint_lineage(run_lineage: dict[str, Any], *, run_lineage_sha256: str, run_lineage_path: Path, step: int,
                       location: str) -> dict[str, Any]:
    """The lineage of the checkpoint of `step` saved at `location`, from the run's lineage."""
    git = (run_lineage.get("code") or {}).get("git") or {}
    data = run_lineage.get("data") or {}
    software = run_lineage.get("software") or {}
    return {
        "version": CHECKPOINT_LINEAGE_VERSION,
        "run_id": run_lineage.get("run_id"),
        "attempt": run_lineage.get("attempt", 0),
        "run_name": run_lineage.get("run_name"),
        "checkpoint": {"step": int(step), "dir": location, "saved_at": time.time()},
        "run_lineage": {"path": str(run_lineage_path), "sha256": run_lineage_sha256},
        "code": {"git": {"commit": git.get("commit"), "dirty": git.get("dirty")} if git else None},
        "spec": {"sha256": (run_lineage.get("spec") or {}).get("sha256")},
        "data": {"manifest_sha256": data.get("manifest_sha256"), "tokenizer_sha256": data.get("tokenizer_sha256")},
        "software": {"torch": software.get("torch"),
                     "packages": {"sha256": (software.get("packages") or {}).get("sha256")}},
        "container": {"image_digest": (run_lineage.get("container") or {}).get("image_digest")},
    }


class CheckpointProvenance:
    """Rank 0's lineage file for each save (`files`) and registry row after each commit (`register`).

    Without a run lineage (a trainer used outside `leantrain train`, which writes it) checkpoints carry no
    lineage and nothing is registered; this is logged once.
    """

    def __init__(self, *, run_dir: Path, registry: Path | None, local_root: Path | None, describe: Any) -> None:
        self.run_dir = Path(run_dir)
        self.registry = registry
        self.local_root = local_root  # None for object stores: the registry indexes local folders only
        self.describe = describe  # Store.describe: a folder name -> a location for messages
        self.last_lineage: dict[int, dict[str, Any]] = {}
        self._warned = False

    def files(self, step: int) -> dict[str, bytes]:
        """The manager's `extra_files`: {"lineage.json": bytes} for the checkpoint of `step` (rank 0)."""
        from leantrain.ckpt.integrity import step_dir

        path = self.run_dir / LINEAGE_FILE_NAME
        try:
            raw = path.read_bytes()
            run_lineage = json.loads(raw)
        except (OSError, ValueError) as err:
            if not self._warned:
                log.warning("checkpoints get no lineage.json: %s unreadable (%s)", path, err)
                self._warned = True
            return {}
        lineage = checkpoint_lineage(run_lineage, run_lineage_sha256=hashlib.sha256(raw).hexdigest(),
                                     run_lineage_path=path.resolve(), step=step, location=self.describe(step_dir(step)))
        self.last_lineage = {step: lineage}
        return {LINEAGE_FILE_NAME: (json.dumps(lineage, indent=2, sort_keys=True) + "\n").encode()}

    def register(self, step: int, folder: str) -> None:
        """The manager's `after_commit`: index the committed checkpoint in the run registry (local storage)."""
        lineage = self.last_lineage.get(step)
        if self.local_root is None or lineage is None:
            return
        from leantrain.provenance.registry import register_checkpoint

        # The stored file may be encrypted: hand the registry the plaintext this process wrote.
        register_checkpoint(self.local_root / folder, registry=self.registry, lineage=lineage)
