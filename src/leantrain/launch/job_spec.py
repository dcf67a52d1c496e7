"""The spec a cluster job runs, frozen at `--emit` time: the parsed spec (profile and `--set` applied; only
fields that were set, so defaults stay defaults) with the spec file's `${VAR}` values kept as references, so
the nodes resolve them from their own environment. The Kubernetes ConfigMap holds it; the Slurm job writes it
to RUN_DIR/job-spec.yaml, so the job does not depend on the submit host's checkout or later edits to the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from leantrain.spec import JobSpec

ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
JOB_SPEC_NAME = "job-spec.yaml"


def raw_env_references(spec_path: Path, *, profile: str | None, overrides: list[str]) -> dict[str, str]:
    """Dotted path → the spec file's text for every value that references `${VAR}` (profile and overrides
    applied), so the pods resolve them from their own environment instead of the submit host's."""
    from leantrain.spec.load import _leaf_paths, _set_path, apply_profile, parse_override

    raw = yaml.safe_load(Path(spec_path).read_text(encoding="utf-8")) or {}
    merged = apply_profile(raw, profile)
    for text in overrides:
        key, value = parse_override(text)
        _set_path(merged, key, value)
    found = {}
    for dotted in _leaf_paths(merged):
        node: Any = merged
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str) and ENV_REF_RE.search(node):
            found[dotted] = node
    return found


def _restore_references(doc: dict[str, Any], refs: dict[str, str]) -> None:
    for dotted, text in refs.items():
        *parents, leaf = dotted.split(".")
        node: Any = doc
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = text


def frozen_spec_document(spec: JobSpec, *, env_refs: dict[str, str] | None = None) -> dict[str, Any]:
    """The explicitly set fields of `spec` (no profiles) with the `${VAR}` references of `env_refs` restored."""
    doc = spec.model_dump(mode="json", exclude_unset=True, exclude={"profiles"})
    _restore_references(doc, env_refs or {})
    return doc


def write_job_spec(spec: JobSpec, *, run_dir: Path, env_refs: dict[str, str] | None = None) -> Path:
    """RUN_DIR/job-spec.yaml (owner-only) for the Slurm job; returns its path."""
    from leantrain.security import write_private_text

    path = Path(run_dir).resolve() / JOB_SPEC_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Written by `leantrain launch --emit slurm`: the spec this job runs (profile and --set applied).\n"
    write_private_text(path, text + yaml.safe_dump(frozen_spec_document(spec, env_refs=env_refs), sort_keys=False))
    return path
