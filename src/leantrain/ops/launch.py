"""`leantrain launch`: write a Slurm/Kubernetes job file (--emit), check the ranks (--preflight), or launch.

Kept thin on purpose: job files are built in `emit`/`emit_k8s`, preflight in `preflight`, data staging in
`staging`, node exclusion in `health`. The local torchrun launcher and --dry-run are issue #6 and will be
added here; until then they say so instead of pretending.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from leantrain.errors import CheckFailed, NotBuiltError, UserInputError
from leantrain.ops.emit import TrainCommand, describe, job_resources, slurm_script, write_job_file
from leantrain.ops.health import excluded_hosts
from leantrain.ops.staging import ensure_local_data
from leantrain.security import AuditLog, make_private_dir
from leantrain.spec import JobSpec

EMIT_KINDS = ("slurm", "k8s")
DEFAULT_OUT = {"slurm": "job.sbatch", "k8s": "job.k8s.yaml"}


def _audit(spec: JobSpec, run_dir: Path, event: str, **fields: object) -> None:
    if spec.security.audit_log:
        AuditLog(run_dir / "audit.log", spec=spec).append(event, argv=sys.argv, **fields)


def emit_job_file(
    spec: JobSpec, *, kind: str, out: Path, spec_path: Path, overrides: list[str], profile: str | None,
    run_dir: Path, nproc: int | None, nnodes: str | None, max_restarts: int | None,
) -> Path:
    """Write the Slurm batch script or the Kubernetes manifests; returns the path written."""
    if kind == "slurm":
        command = TrainCommand(spec_path=Path(spec_path).resolve(), overrides=tuple(overrides), profile=profile)
        text = slurm_script(spec, command=command, run_dir=run_dir, nnodes=nnodes, nproc=nproc,
                            max_restarts=max_restarts)
    elif kind == "k8s":
        from leantrain.ops.emit_k8s import k8s_documents, k8s_yaml

        text = k8s_yaml(k8s_documents(spec, run_dir=run_dir, nnodes=nnodes, nproc=nproc, max_restarts=max_restarts))
    else:
        raise UserInputError(f"--emit {kind!r}: allowed: {', '.join(EMIT_KINDS)}")
    return write_job_file(text, out)


def run(
    *, console: Console, spec: JobSpec, spec_path: Path, overrides: list[str], profile: str | None,
    nproc: int | None, nnodes: str | None, max_restarts: int | None, run_dir: Path | None, dry_run: bool,
    preflight: bool, emit: str | None, out: Path | None, sweep: str | None = None,
) -> None:
    """The `leantrain launch` command."""
    run_dir = Path(run_dir or spec.run.dir)
    if out is not None and emit is None:
        raise UserInputError("--out names the file --emit writes; add --emit slurm or --emit k8s")
    if emit is not None:
        if emit not in EMIT_KINDS:
            raise UserInputError(f"--emit {emit!r}: allowed: {', '.join(EMIT_KINDS)}")
        make_private_dir(run_dir, owner_only=spec.security.owner_only)
        path = emit_job_file(spec, kind=emit, out=Path(out or DEFAULT_OUT[emit]), spec_path=spec_path,
                             overrides=overrides, profile=profile, run_dir=run_dir, nproc=nproc, nnodes=nnodes,
                             max_restarts=max_restarts)
        res = job_resources(spec, nnodes=nnodes, nproc=nproc)
        excluded = excluded_hosts(run_dir, crash_threshold=spec.cluster.unhealthy_after_crashes)
        _audit(spec, run_dir, "launch.emit", kind=emit, out=str(path.resolve()), **describe(res), excluded=excluded)
        console.print(f"wrote {emit} job file {path}: {res.num_nodes} node(s) × {res.gpus_per_node} GPU(s) "
                      f"(from {res.source}); excluded hosts: {', '.join(excluded) or 'none'}")
        return
    if preflight:
        from leantrain.ops.preflight import preflight_command

        make_private_dir(run_dir, owner_only=spec.security.owner_only)
        staged = ensure_local_data(spec)
        if staged is not None:
            console.print(f"staged {spec.cluster.data_url} → {spec.data.dir} "
                          f"({'up to date' if staged.up_to_date else f'{staged.downloaded_bytes} bytes'})")
        outcome = "error"
        try:
            report = preflight_command(spec, console=console, spec_path=spec_path, overrides=overrides,
                                       profile=profile, run_dir=run_dir, nproc=nproc, nnodes=nnodes)
            outcome = "passed" if report["ok"] else "failed"
        except CheckFailed:
            outcome = "failed"
            raise
        finally:
            _audit(spec, run_dir, "launch.preflight", outcome=outcome)
        return
    what = "--dry-run" if dry_run else "a local torchrun launch"
    raise NotBuiltError(
        f"`leantrain launch` {what} is not built yet in this version (issue #6); --emit slurm|k8s and "
        "--preflight work now"
    )


def demo_stage(ctx: Any) -> str:
    """`leantrain demo`: write the Slurm and Kubernetes job files for the seed's 10B example (rehearsal
    profile) under the demo dir, so the cluster side of the chain is shown without a cluster."""
    from leantrain.demo import REPO_ROOT
    from leantrain.spec import load_spec

    out_dir = Path(ctx.out_dir) / "jobs"
    spec_path = REPO_ROOT / "examples" / "seed-10b.yaml"
    spec = load_spec(spec_path, profile="rehearsal")
    run_dir = make_private_dir(out_dir / "seed-10b-run", owner_only=spec.security.owner_only)
    written = [
        emit_job_file(spec, kind=kind, out=out_dir / DEFAULT_OUT[kind].replace("job", "seed-10b"), spec_path=spec_path,
                      overrides=[], profile="rehearsal", run_dir=run_dir, nproc=None, nnodes=None, max_restarts=None)
        for kind in EMIT_KINDS
    ]
    res = job_resources(spec)
    return (f"job files for the seed example ({res.num_nodes} nodes × {res.gpus_per_node} GPUs): "
            + ", ".join(str(p) for p in written))
