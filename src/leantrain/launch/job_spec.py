"""The spec a cluster job runs, frozen at `--emit` time: the parsed spec (profile and `--set` applied; only
fields that were set, so defaults stay defaults) with the spec file's `${VAR}` values kept as references, so
the nodes resolve them from their own environment. The Kubernetes ConfigMap holds it; the Slurm script carries
it and writes it to RUN_DIR/job-spec.yaml when the job starts (nothing is written on the submit host but the job
file), so the job does not depend on the submit host's checkout or later edits to the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from leantrain.errors import UserInputError
from leantrain.spec import JobSpec

ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
JOB_SPEC_NAME = "job-spec.yaml"
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")  # what staging from s3:// may use


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


def referenced_env_names(spec: JobSpec, env_refs: dict[str, str] | None = None) -> set[str]:
    """Every env var the spec needs on the nodes: `${VAR}` anywhere in a value (also in the spec file's text,
    `env_refs`), secret_env, the webhook URL's. Names only: a job file never holds their values."""
    from leantrain.security import spec_secret_env_names

    names = set(spec_secret_env_names(spec))
    names |= {n for text in (env_refs or {}).values() for n in ENV_REF_RE.findall(text)}
    names |= set(ENV_REF_RE.findall(json.dumps(spec.model_dump(mode="json", exclude={"profiles"}))))
    if spec.monitoring.webhook_url_env:
        names.add(spec.monitoring.webhook_url_env)
    return names


def staging_env_names(spec: JobSpec) -> tuple[str, ...]:
    """The credentials staging `cluster.data_url` may read on the nodes: S3's for an s3:// URL, else none."""
    url = spec.cluster.data_url
    return S3_ENV if url and url.startswith("s3://") else ()


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


def job_spec_text(spec: JobSpec, *, env_refs: dict[str, str] | None = None) -> str:
    """RUN_DIR/job-spec.yaml's text; the Slurm script writes it on the cluster (owner-only) when the job starts."""
    text = "# Written by `leantrain launch --emit slurm`: the spec this job runs (profile and --set applied).\n"
    return text + yaml.safe_dump(frozen_spec_document(spec, env_refs=env_refs), sort_keys=False)


def job_spec_path(run_dir: Path) -> Path:
    return Path(run_dir).resolve() / JOB_SPEC_NAME


# What `--emit ... --dry-run` writes where the spec names no image: a job file to read, not one to submit.
PLACEHOLDER_IMAGE = "REPLACE-ME.example/leantrain-train:0.1.0"


def job_image(spec: JobSpec, *, dry_run: bool, why: str) -> str:
    """`cluster.image`, which a job file that runs in a container needs (`why` says which); with `dry_run` a
    placeholder when it is unset. A placeholder is refused outside a dry run."""
    image = spec.cluster.image
    if image and "REPLACE-ME" not in image:
        return image
    if dry_run:
        return image or PLACEHOLDER_IMAGE
    raise UserInputError(
        f"cluster.image: {why} runs in the training image, and the spec names {'a placeholder' if image else 'none'}"
        f"{f' ({image})' if image else ''}: build and push docker/Dockerfile (docker/README.md), then set "
        "cluster.image to it, pinned by digest (registry/leantrain-train@sha256:...); `--dry-run` writes the job "
        "file with a placeholder to read")


NO_RUNTIME = ("cluster.slurm_runtime is host and neither cluster.env_hook nor cluster.slurm_venv is set: the nodes "
              "need leantrain from somewhere other than the submit host's venv. Set cluster.slurm_runtime: pyxis "
              "or apptainer (with cluster.image), cluster.slurm_venv (a venv on storage every node mounts), or "
              "cluster.env_hook (a shell file that sets one up)")


def check_emit(spec: JobSpec, *, kind: str, dry_run: bool) -> None:
    """What a job file needs from the spec to run on a cluster (an image, or the Slurm nodes' set-up), checked
    before anything heavy is imported; a dry run writes placeholders instead. Unknown kinds are left to --emit."""
    if dry_run:
        return
    if kind == "k8s":
        job_image(spec, dry_run=False, why="a Kubernetes job")
    elif kind == "slurm" and spec.cluster.slurm_runtime != "host":
        job_image(spec, dry_run=False, why=f"cluster.slurm_runtime: {spec.cluster.slurm_runtime}")
    elif kind == "slurm" and not (spec.cluster.env_hook or spec.cluster.slurm_venv):
        raise UserInputError(NO_RUNTIME)
