"""`leantrain launch`: train under torchrun, or --dry-run / --sweep / --emit slurm|k8s / --preflight.

Kept thin on purpose: torchrun, the sweep and the layout checks are in `torchrun`, the dry run in
`parallel.dryrun`, job files in `resources`/`slurm`/`k8s`, preflight in `preflight`, data staging in `staging`,
node exclusion in `health`.

A plain launch (`leantrain launch SPEC --nproc N [--nnodes MIN:MAX] [--max-restarts K]`): check the layout
for every world size the job may have (a bad axis is refused here, exit 2, before anything starts), refuse
a host that `node_health.json` excludes, stage the data (`cluster.data_url`), run torchrun; when it fails,
record the crash (and the ranks torchrun names) against this host, unless its ranks failed only because another
host's did (torchrun.host_fault), and exit 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.ckpt.lease import inherit_env, run_lease
from leantrain.data.layout import check_not_data_dir
from leantrain.errors import CheckFailed, Interrupted, UserInputError
from leantrain.launch import torchrun
from leantrain.launch.health import excluded_hosts, health_path, node_name, record_failure
from leantrain.launch.job_spec import job_spec_path, job_spec_text, raw_env_references
from leantrain.launch.resources import TrainCommand, describe, job_resources, parse_nnodes, write_job_file
from leantrain.launch.slurm import slurm_script
from leantrain.launch.staging import ensure_local_data
from leantrain.security import AuditLog, make_private_dir
from leantrain.spec import JobSpec

EMIT_KINDS = ("slurm", "k8s")
DEMO_NPROC = 2  # the demo trains on two processes, as a (tiny) multi-rank job
SWEEP_STEPS = 10  # steps per size of --sweep (fewer when training.max_steps is smaller): enough for a steady rate
DEFAULT_OUT = {"slurm": "job.sbatch", "k8s": "job.k8s.yaml"}


def _audit(spec: JobSpec, run_dir: Path, event: str, **fields: object) -> None:
    if spec.security.audit_log:
        AuditLog(run_dir / "audit.log", spec=spec).append(event, argv=sys.argv, **fields)


def setup_path(out: Path) -> Path:
    """Where `--emit k8s` writes the PVC and Secret manifests: beside the job, `<job>.setup.yaml`."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(".yaml").removesuffix(".yml") + ".setup.yaml")


def emit_job_file(
    spec: JobSpec, *, kind: str, out: Path, spec_path: Path, overrides: list[str], profile: str | None,
    run_dir: Path, nproc: int | None, nnodes: str | None, max_restarts: int | None, dry_run: bool = False,
) -> Path:
    """Write the Slurm batch script or the Kubernetes manifests (nothing else: the run dir is the cluster's);
    returns the path written. `dry_run`: placeholders for a missing image or node set-up, for reading. A layout
    that cannot run at the job's world size (at both ends of an elastic range) is refused before it is written,
    not after the job has waited in the queue."""
    if kind in EMIT_KINDS:
        res = job_resources(spec, nnodes=nnodes, nproc=nproc)
        torchrun.check_layout(spec, nproc=res.gpus_per_node, min_nodes=res.min_nodes, max_nodes=res.max_nodes)
    refs = raw_env_references(spec_path, profile=profile, overrides=list(overrides))
    if kind == "slurm":
        # The job runs the spec frozen in the script, which writes it to the run dir when it starts; not the
        # submit host's file (which may change or be absent).
        command = TrainCommand(spec_path=job_spec_path(run_dir))
        text = slurm_script(spec, command=command, run_dir=run_dir, nnodes=nnodes, nproc=nproc,
                            max_restarts=max_restarts, job_spec=job_spec_text(spec, env_refs=refs), dry_run=dry_run,
                            env_refs=refs, source=spec_path)
    elif kind == "k8s":
        from leantrain.launch.k8s import k8s_documents, k8s_yaml, setup_documents

        text = k8s_yaml(k8s_documents(spec, run_dir=run_dir, nnodes=nnodes, nproc=nproc, max_restarts=max_restarts,
                                      env_refs=refs, dry_run=dry_run, source=spec_path))
        write_job_file(k8s_yaml(setup_documents(spec, env_refs=refs, dry_run=dry_run)), setup_path(out))
    else:
        raise UserInputError(f"--emit {kind!r}: allowed: {', '.join(EMIT_KINDS)}")
    return write_job_file(text, out)


def run(
    *, console: Console, spec: JobSpec, spec_path: Path, overrides: list[str], profile: str | None,
    nproc: int | None, nnodes: str | None, max_restarts: int | None, run_dir: Path | None, dry_run: bool,
    preflight: bool, emit: str | None, out: Path | None, sweep: str | None = None, train_args: tuple[str, ...] = (),
) -> None:
    """The `leantrain launch` command (`train_args`: --resume/--weights-only/--extend-schedule for the ranks)."""
    named, run_dir = run_dir is not None, Path(run_dir or spec.run.dir)
    if emit is None:  # a job file names the run dir the cluster will create; here the ranks would write into it
        check_not_data_dir(run_dir, given=named)
    if sweep is not None:  # refused as typed, whatever else is asked, before anything is written
        sizes = torchrun.parse_sweep(sweep)
        for flag, given in (("--dry-run", dry_run), ("--preflight", preflight), ("--emit", emit is not None)):
            if given:
                raise UserInputError(f"{flag} and --sweep: choose one")
    if preflight and (dry_run or emit is not None):  # the preflight starts every rank: it was run, or ignored
        raise UserInputError(f"--preflight and {'--emit' if emit is not None else '--dry-run'}: choose one (a job "
                             "file runs its own preflight when cluster.preflight is on)")
    if out is not None and emit is None:
        raise UserInputError("--out names the file --emit writes; add --emit slurm or --emit k8s")
    if emit is not None:
        if emit not in EMIT_KINDS:
            raise UserInputError(f"--emit {emit!r}: allowed: {', '.join(EMIT_KINDS)}")
        path = emit_job_file(spec, kind=emit, out=Path(out or DEFAULT_OUT[emit]), spec_path=spec_path,
                             overrides=overrides, profile=profile, run_dir=run_dir, nproc=nproc, nnodes=nnodes,
                             max_restarts=max_restarts, dry_run=dry_run)
        res = job_resources(spec, nnodes=nnodes, nproc=nproc)
        excluded = excluded_hosts(run_dir, crash_threshold=spec.cluster.unhealthy_after_crashes)
        # Only under --out: the audit line goes beside the job file (the run dir is the cluster's to create).
        _audit(spec, path.parent, "launch.emit", kind=emit, out=str(path.resolve()), **describe(res),
               excluded=excluded, dry_run=dry_run)
        console.print(f"wrote {emit} job file {path}: {res.num_nodes} node(s) × {res.gpus_per_node} GPU(s) "
                      f"(from {res.source}); excluded hosts: {', '.join(excluded) or 'none'}")
        if spec.fault.elasticity and spec.fault.min_nodes is None and res.source.startswith("plan") and not res.elastic:
            console.print(f"[yellow]note: fault.elasticity is on, but the job is not elastic: the layout runs at "
                          f"{res.num_nodes} node(s) and at no smaller count down to the budget's (its global batch "
                          "does not divide over fewer data-parallel ranks)")
        if dry_run:
            console.print("[yellow]dry run: placeholders stand in for what the spec does not name (cluster.image, "
                          "the Slurm node set-up); the file is for reading, not for submitting")
        if emit == "k8s":
            for warning in k8s_memory_warnings(spec, local_ranks=res.gpus_per_node):
                console.print(f"warning: {warning}", style="yellow", markup=False, highlight=False)
            _print_k8s_setup(spec, path=path, console=console)
        return
    if preflight:
        from leantrain.ckpt.preflight import preflight_storage
        from leantrain.launch.preflight import preflight_command

        make_private_dir(run_dir, owner_only=spec.security.owner_only)
        preflight_storage(spec, run_dir=run_dir, data=True)  # the stores first: one line, exit 2
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
    procs = nproc or spec.hardware.gpus_per_node
    min_nodes, max_nodes = parse_nnodes(nnodes) if nnodes else (1, 1)
    if dry_run:  # the whole job's layout: --nnodes, else the spec's hardware.num_nodes
        print_dry_run(spec, world_size=procs * (max_nodes if nnodes else spec.hardware.num_nodes), console=console)
        return
    train = TrainCommand(spec_path=Path(spec_path).resolve(), overrides=tuple(overrides), profile=profile)
    if sweep is not None:
        make_private_dir(run_dir, owner_only=spec.security.owner_only)
        _stage_data(spec, console=console)
        steps = min(spec.training.max_steps or SWEEP_STEPS, SWEEP_STEPS)
        points = torchrun.scaling_sweep(spec, train=train, run_dir=run_dir, sizes=sizes, steps=steps, console=console)
        print_sweep(points, console=console, path=run_dir / torchrun.SWEEP_FILE)
        _audit(spec, run_dir, "launch.sweep", sizes=sizes, steps=steps)
        return
    train = dataclasses.replace(train, train_args=train_args)
    launch(spec, train=train, run_dir=run_dir, nproc=procs, nnodes=nnodes, max_restarts=max_restarts,
           console=console, min_nodes=min_nodes, max_nodes=max_nodes)


def launch(
    spec: JobSpec, *, train: TrainCommand, run_dir: Path, nproc: int, nnodes: str | None, max_restarts: int | None,
    console: Console, min_nodes: int = 1, max_nodes: int = 1,
) -> None:
    """Check, stage and run torchrun on this host; a failed run is recorded against the host and exits 1."""
    torchrun.check_layout(spec, nproc=nproc, min_nodes=min_nodes, max_nodes=max_nodes)  # before any side effect
    if max_nodes == 1:  # rank 0 runs here: a registry it cannot use would fail every restart of every rank
        from leantrain.provenance.registry import check_registry

        check_registry(spec.run.registry, run_dir=run_dir)
    host = node_name()
    excluded = excluded_hosts(run_dir, crash_threshold=spec.cluster.unhealthy_after_crashes)
    if host in excluded:
        raise UserInputError(
            f"host {host} is excluded by {health_path(run_dir)} (failed preflight or crashed "
            f"{spec.cluster.unhealthy_after_crashes}+ times); repair it, then remove it with "
            f"`python -c 'from leantrain.launch.health import clear_host; clear_host(\"{run_dir}\", \"{host}\")'`"
        )
    # One node: this launcher is the run dir's one writer for the whole job (its restarts included) and its
    # workers run under its lease; across nodes rank 0 of the job takes it (ckpt/lease.py).
    with run_lease(run_dir, command="launch", owner_only=spec.security.owner_only) if max_nodes == 1 \
            else contextlib.nullcontext() as lease:
        inherited = inherit_env(lease) if lease is not None else {}
        saved_env = {name: os.environ.get(name) for name in inherited}
        os.environ.update(inherited)
        try:
            _launch_leased(spec, train=train, run_dir=run_dir, nproc=nproc, nnodes=nnodes,
                           max_restarts=max_restarts, console=console, host=host)
        finally:
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _launch_leased(
    spec: JobSpec, *, train: TrainCommand, run_dir: Path, nproc: int, nnodes: str | None, max_restarts: int | None,
    console: Console, host: str,
) -> None:
    make_private_dir(run_dir, owner_only=spec.security.owner_only)
    from leantrain.ckpt.preflight import preflight_storage

    preflight_storage(spec, run_dir=run_dir, data=True)  # before any rank starts: a broken store is exit 2 here
    _stage_data(spec, console=console)
    failed_ranks: list[int] = []
    failures: list[dict[str, str]] = []
    received: list[str] = []
    refusals: list[str] = []

    def terminate(signum: int, _frame: object) -> None:  # SIGTERM to launch: stop torchrun the same way
        received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        code = torchrun.launch_local(spec, train=train, run_dir=run_dir, nproc=nproc, nnodes=nnodes,
                                     max_restarts=max_restarts, console=console, failed_ranks=failed_ranks,
                                     refusals=refusals, failures=failures)
    except KeyboardInterrupt:  # torchrun got SIGTERM and passed it on: each rank saved its current step
        name = received[0] if received else "SIGINT"
        _audit(spec, run_dir, "launch.local", nproc=nproc, nnodes=nnodes or "1", exit_code=130, failed_ranks=[])
        raise Interrupted(f"stopped by {name}: the ranks were asked to save a checkpoint at their current step "
                          f"and stop; rerun the same command to resume (per-rank logs under "
                          f"{Path(run_dir) / torchrun.LOGS_DIR})", signal_name=name) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    _audit(spec, run_dir, "launch.local", nproc=nproc, nnodes=nnodes or "1", exit_code=code,
           failed_ranks=failed_ranks)
    if code != 0 and refusals:  # a rank recorded that it refused the job (exit 2): not the host's crash
        raise UserInputError(f"the ranks refused the job: {refusals[0]} (not counted against {host}; per-rank logs "
                             f"under {Path(run_dir) / torchrun.LOGS_DIR})")
    if code != 0:
        blamed, why = torchrun.host_fault(failures, run_dir=run_dir)
        if not blamed:  # another host's rank failed first: this one is not counted as crashed
            raise CheckFailed(f"training failed: torchrun exit code {code}; not counted against {host}: {why}; "
                              f"per-rank logs under {Path(run_dir) / torchrun.LOGS_DIR}")
        info = record_failure(run_dir, host=host, kind="crash", reason=f"torchrun exit code {code}: {why}",
                              ranks=failed_ranks)
        counted = "a failure of the whole job: 3+ hosts crashed at once, not counted against one" if info is None \
            else f"crash {info.crashes} of {spec.cluster.unhealthy_after_crashes} before the host is excluded"
        raise CheckFailed(
            f"training failed on {host}: {why}; torchrun exit code {code}, failed rank(s) "
            f"{', '.join(map(str, failed_ranks)) or 'unknown'} ({counted}); per-rank logs under "
            f"{Path(run_dir) / torchrun.LOGS_DIR}"
        )


def k8s_memory_warnings(spec: JobSpec, *, local_ranks: int) -> list[str]:
    """With the fast tier on tmpfs: the plan's state per rank against the pod's /dev/shm volume
    (`cluster.k8s_shm_gb`) for the job's ranks per node (plan/budget.k8s_shm_problem, the plan's own check),
    and the plan's host-memory problems (the pod's memory limit holds the ranks and that volume)."""
    if spec.checkpoint.memory_interval_steps is None:
        return []
    from leantrain.plan.budget import k8s_shm_problem
    from leantrain.plan.planner import make_plan

    try:
        plan = make_plan(spec)
    except UserInputError as err:
        return [f"cannot size the fast tier against cluster.k8s_shm_gb ({err})"]
    tier = plan["fast_tier"]
    if tier.get("kind") != "tmpfs":
        return []
    shm = k8s_shm_problem(spec, shard_bytes=float(tier["shard_bytes_per_rank"]), local_ranks=local_ranks)
    return [*([shm] if shm else []), *plan["host_memory"]["problems"]]


def _print_k8s_setup(spec: JobSpec, *, path: Path, console: Console) -> None:
    """What to apply before the job: the PVCs, the Secret and, for data on a PVC, the copy into it."""
    from leantrain.launch.k8s import data_load_commands
    from leantrain.launch.staging import is_remote

    setup = setup_path(path)
    console.print(f"wrote {setup}: the PVCs and the Secret (placeholders) the job needs; apply once first:\n"
                  f"  envsubst < {setup} | kubectl apply -f -", markup=False, highlight=False)
    if not is_remote(spec.cluster.data_url):
        console.print("then copy the prepared data dir into the data PVC (preflight checks it on every rank):\n  "
                      + "\n  ".join(data_load_commands(spec, data_dir=str(spec.data.dir))), markup=False,
                      highlight=False)
    console.print(f"then: kubectl apply -f {path}", markup=False, highlight=False)


def _stage_data(spec: JobSpec, *, console: Console) -> None:
    staged = ensure_local_data(spec)
    if staged is not None:
        console.print(f"staged {spec.cluster.data_url} → {spec.data.dir} "
                      f"({'up to date' if staged.up_to_date else f'{staged.downloaded_bytes} bytes'})")


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def print_dry_run(spec: JobSpec, *, world_size: int, console: Console) -> None:
    """`--dry-run`: every rank's layout built on a fake process group; bytes per rank against the plan."""
    from leantrain.parallel.dryrun import dry_run

    report = dry_run(spec, world_size=world_size)
    console.print(f"dry run at {world_size} rank(s) (fake process group, no communication): "
                  f"{report.dims.describe()}")
    table = Table("rank", "parameters", "params", "grads", "optimizer", "total")
    for r in report.ranks:
        table.add_row(str(r.rank), f"{r.num_params:,}", format_bytes(r.params_bytes), format_bytes(r.grads_bytes),
                      format_bytes(r.optimizer_bytes), format_bytes(r.total_bytes))
    plan = report.plan
    if plan:
        table.add_row("plan (per GPU)", "", format_bytes(plan["params"]), format_bytes(plan["grads"]),
                      format_bytes(plan["optimizer"]), format_bytes(plan["total"]))
    console.print(table)
    heavy = report.heaviest
    if plan and plan["total"]:
        console.print(f"heaviest rank {heavy.rank}: {format_bytes(heavy.total_bytes)} of model state = "
                      f"{heavy.total_bytes / plan['total']:.2f}× the plan's {format_bytes(plan['total'])}")
    for note in report.notes:
        console.print(f"[yellow]note: {note}")


def print_sweep(points: list[torchrun.SweepPoint], *, console: Console, path: Path) -> None:
    table = Table("nproc", "tokens/s", "efficiency", "step time", "comm", "note")
    for p in points:
        table.add_row(
            str(p.nproc), "" if p.tokens_per_s is None else f"{p.tokens_per_s:,.0f}",
            "" if p.efficiency is None else f"{p.efficiency:.2f}",
            "" if p.step_time_s is None else f"{p.step_time_s:.3f} s",
            "" if p.comm_s is None else f"{p.comm_s:.3f} s", p.skipped or "",
        )
    console.print(table)
    stop = torchrun.stops_paying_at(points)
    console.print(f"more ranks stop paying at nproc {stop}" if stop else "every size measured paid (efficiency ≥ "
                  f"{torchrun.EFFICIENCY_FLOOR})")
    console.print(f"sweep summary: {path}")


def demo_stage(ctx: Any) -> str:
    """`leantrain demo`: write the Slurm and Kubernetes job files for the 10B example (rehearsal
    profile) under the demo dir, so the cluster side of the chain is shown without a cluster. A dry run:
    examples/seed-10b.yaml names no image or node set-up, so placeholders stand in."""
    from leantrain.demo_context import REPO_ROOT
    from leantrain.spec import load_spec

    out_dir = Path(ctx.out_dir) / "jobs"
    spec_path = REPO_ROOT / "examples" / "seed-10b.yaml"
    spec = load_spec(spec_path, profile="rehearsal")
    run_dir = out_dir / "seed-10b-run"
    written = [
        emit_job_file(spec, kind=kind, out=out_dir / DEFAULT_OUT[kind].replace("job", "seed-10b"), spec_path=spec_path,
                      overrides=[], profile="rehearsal", run_dir=run_dir, nproc=None, nnodes=None, max_restarts=None,
                      dry_run=True)
        for kind in EMIT_KINDS
    ]
    res = job_resources(spec)
    return (f"job files for the seed example ({res.num_nodes} nodes × {res.gpus_per_node} GPUs; a dry run: "
            "placeholders for its image and node set-up): " + ", ".join(str(p) for p in written))


def demo_train_stage(ctx: Any) -> str:
    """`leantrain demo`: train the demo spec on two processes under torchrun (with its restart policy), the
    way a cluster job runs, into the demo's run dir."""
    from leantrain.observe.report_data import load_run
    from leantrain.train.command import summary

    spec = ctx.spec()
    run_dir = Path(spec.run.dir)
    train = TrainCommand(spec_path=Path(ctx.spec_path).resolve(), overrides=tuple(ctx.overrides), profile=None)
    launch(spec, train=train, run_dir=run_dir, nproc=DEMO_NPROC, nnodes=None, max_restarts=None, console=ctx.console)
    records = [r for r in load_run(run_dir).metrics if "loss" in r]
    return f"{DEMO_NPROC} ranks: {summary(records)}"
