"""Everything around the trainer that makes a run dir self-describing and safe (rank 0 only).

Before training: an owner-only run dir; `spec.yaml` (the parsed spec, secrets kept as `${VAR}` references)
and `plan.json` (the planner's prediction, which validate/report/doctor compare the run against);
`lineage.json` and the run registry (what code, spec, data and environment produced the run); an audit
entry; secret redaction on the `leantrain` loggers; the extra metric sinks (alert engine and Prometheus).
After training: the run's status in the registry and a closing audit entry.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from leantrain.errors import LeantrainError
from leantrain.observe.sinks import Sink
from leantrain.spec.schema import JobSpec

log = logging.getLogger(__name__)

SPEC_FILE = "spec.yaml"
PLAN_FILE = "plan.json"


@dataclass
class RunContext:
    """What `prepare_run` set up and `finish_run` closes."""

    run_dir: Path
    spec: JobSpec
    is_main: bool
    sinks: list[Sink] = field(default_factory=list)
    run_id: str | None = None


def _plan_or_none(spec: JobSpec) -> dict[str, Any] | None:
    """The planner's prediction for this spec; a run without a plan still trains (the checks then WARN)."""
    from leantrain.errors import LeantrainError
    from leantrain.plan.planner import make_plan

    try:
        return make_plan(spec)
    except LeantrainError as err:
        log.warning("no plan.json for this run: %s", err)
        return None


def description_snapshot(run_dir: Path) -> dict[str, bytes | None]:
    """The bytes of the run dir's description files (spec.yaml, plan.json, lineage.json) before a start, so a
    start that is refused after the model was built (every checkpoint invalid) can put them back."""
    from leantrain.provenance.lineage import LINEAGE_FILE_NAME

    names = (SPEC_FILE, PLAN_FILE, LINEAGE_FILE_NAME)
    return {name: (Path(run_dir) / name).read_bytes() if (Path(run_dir) / name).is_file() else None for name in names}


def restore_description(run_dir: Path, snapshot: dict[str, bytes | None]) -> None:
    """Put the description files back as `description_snapshot` found them (absent ones are removed)."""
    for name, data in snapshot.items():
        path = Path(run_dir) / name
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)


def prepare_run(
    spec: JobSpec, *, run_dir: Path, rank: int, console: Console | None, spec_path: Path | None = None
) -> RunContext:
    """Write the run dir's description files and build the extra sinks (rank 0); other ranks get nothing."""
    from leantrain.security import AuditLog, install_log_redaction, make_private_dir, write_private_text

    install_log_redaction(spec=spec, logger=logging.getLogger("leantrain"))
    context = RunContext(run_dir=Path(run_dir), spec=spec, is_main=rank == 0)
    if not context.is_main:
        return context
    from leantrain.provenance.registry import check_registry

    check_registry(spec.run.registry, run_dir=context.run_dir)  # a registry it cannot use, before any file is written
    make_private_dir(context.run_dir, owner_only=spec.security.owner_only)
    write_private_text(context.run_dir / SPEC_FILE, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False),
                       spec=spec)
    plan = _plan_or_none(spec)
    if plan is not None:
        write_private_text(context.run_dir / PLAN_FILE, json.dumps(plan, indent=2) + "\n", spec=spec)
    context.run_id = _record_lineage(spec, context.run_dir, spec_path=spec_path)
    if spec.security.audit_log:
        AuditLog(context.run_dir / "audit.log", spec=spec).append("command", command="train", run_id=context.run_id)
    context.sinks = _extra_sinks(spec, run_dir=context.run_dir, console=console, plan=plan, rank=rank)
    return context


def _record_lineage(spec: JobSpec, run_dir: Path, *, spec_path: Path | None) -> str:
    from leantrain.provenance.lineage import write_lineage
    from leantrain.provenance.registry import register_run

    lineage = write_lineage(run_dir, spec, data_dir=Path(spec.data.dir), spec_path=spec_path)
    return register_run(lineage, registry=spec.run.registry)


def _extra_sinks(
    spec: JobSpec, *, run_dir: Path, console: Console | None, plan: dict[str, Any] | None, rank: int
) -> list[Sink]:
    from leantrain.observe.alerts import engine_from_spec
    from leantrain.observe.prometheus import PrometheusSink

    sinks: list[Sink] = [engine_from_spec(spec, run_dir=run_dir, console=console, plan=plan)]
    prometheus = PrometheusSink.from_monitoring(spec.monitoring, rank=rank)
    if prometheus is not None:
        sinks.append(prometheus)
    from leantrain.observe.tracking import tracking_sinks

    sinks += tracking_sinks(spec, run_dir=run_dir, rank=rank)  # monitoring.wandb / monitoring.mlflow
    return sinks


def finish_run(context: RunContext, *, status: str) -> None:
    """Mark the run finished/failed in the registry and the audit log (rank 0)."""
    if not context.is_main or context.run_id is None:
        return
    from leantrain.provenance.registry import set_run_status
    from leantrain.security import AuditLog

    try:
        set_run_status(context.run_id, status, registry=context.spec.run.registry, run_dir=context.run_dir)
    except (LeantrainError, OSError, sqlite3.Error) as err:
        # The registry is an index beside the run: a registry locked past its timeout or made read-only while the
        # run trained must not turn a trained run (or the error that ended it) into this error.
        log.warning("the run registry did not record run %s as %s: %s; the run dir %s is complete, and `leantrain "
                    "runs` lists the run with its earlier status", context.run_id, status, err, context.run_dir)
    if context.spec.security.audit_log:
        AuditLog(context.run_dir / "audit.log", spec=context.spec).append(
            "command.end", command="train", run_id=context.run_id, status=status
        )


def record_ranks_joined(run_dir: Path, *, rank: int, world_size: int, distributed: bool,
                        spec: JobSpec | None = None) -> None:
    """Every rank's host reaches rank 0, which writes `start` and one `rank_joined` event per rank (validate's
    "every rank reported", doctor's "ranks stuck at start"). With a `spec` that starts from `model.init_from`,
    each rank brings the sha256 of its share of the base's files in the same gather, and rank 0 records them
    (`base_model.json`, ckpt/base_ref.py) before the events: a base changed since the run started is refused."""
    import socket

    import torch.distributed as dist

    from leantrain.ckpt.base_ref import base_share, record_base
    from leantrain.observe.report_data import append_event

    joined: list[Any] = [(socket.gethostname(), base_share(spec, rank=rank, world_size=world_size) if spec else {})]
    if distributed:  # to rank 0 alone: an all-gather handed every rank every rank's entry (world² at 16,384 ranks)
        mine, joined = joined[0], [None] * world_size if rank == 0 else []
        dist.gather_object(mine, joined if rank == 0 else None, dst=0)
    if rank == 0:
        if spec is not None:
            record_base(run_dir, spec, digests={name: sha for _, share in joined for name, sha in share.items()})
        append_event(run_dir, "start", world_size=world_size)
        for joined_rank, (host, _) in enumerate(joined):
            append_event(run_dir, "rank_joined", rank=joined_rank, host=host)


def record_oom(run_dir: Path, *, rank: int, mem_bytes: int, error: BaseException, attempt: int | None = None) -> None:
    """An out-of-memory error, recorded before the rank dies: its own RUN_DIR/oom/rank-R-attempt-A.json
    (ckpt/rank_records.py; validate and doctor aggregate them), and on rank 0 also the `oom` event, so many
    ranks failing at once never write one shared file together. `attempt`: the job's agreed attempt (the
    checkpointer's, ckpt/attempt.py); without one, this node's own restart count (lower than the job's on a node
    that did not fail, and unchanged after a membership change)."""
    import socket

    from leantrain.ckpt.fault import restart_attempt
    from leantrain.ckpt.rank_records import OOM, write_rank_record
    from leantrain.observe.report_data import append_event

    record = {"host": socket.gethostname(), "mem_bytes": mem_bytes, "error": str(error).splitlines()[0][:300]}
    attempt = restart_attempt() if attempt is None else attempt
    write_rank_record(run_dir, OOM, rank=rank, attempt=attempt, record=record)
    if rank == 0:
        append_event(run_dir, "oom", rank=rank, attempt=attempt, **record)
