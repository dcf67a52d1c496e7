"""`leantrain rehearse SPEC`: one rank of the real job at its real world size, on one CPU.

For each chosen rank the trainer itself runs (`train.trainer.Trainer`: meta build, parallelize, init or load,
optimizer, data sampler, checkpoint manager, then `Trainer.train()` for a few steps) with two things swapped:
the process group is torch's `fake` backend at the spec's world size (collectives return at once) and every
tensor on the device is a fake tensor (`FakeTensorMode`: shapes and dtypes, no storage). The spec's precision
is kept, so the bytes are the accelerator's; only `training.device` becomes `cpu`. What the ranks do is
watched by `rehearse_probes` (host syncs, collectives with their groups, files read) and torch's `MemTracker`
(memory by category). Two things are not run: a checkpoint save is planned (DCP's save planner lists this
rank's write items and bytes) instead of written, and values that fake tensors do not have (a host sync's
answer) are the healthy run's (finite, non-empty). The contract of rehearsal.json is in docs/rehearse.md.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

from leantrain.errors import LeantrainError, UserInputError
from leantrain.golive.rehearse_memory import (
    fsdp_gathers_as_temp,
    pipeline_receive_buffers,
    step_mem_tracker,
    unseen_sharding_propagation,
)
from leantrain.golive.rehearse_peers import DONE, Broadcasts, die_with_parent, object_collectives
from leantrain.golive.rehearse_probes import (
    CollectiveRecorder,
    FileReads,
    HostSyncCounter,
    Probes,
    StepLog,
    control_window,
    group_labels,
    reference_parts,
    resident_bytes,
)
from leantrain.golive.rehearse_report import (
    LOGGING,
    STEPS,
    largest_category,
    memory_categories,
    parse_ranks,
    per_step,
    planned_memory,
    ratios_by_category,
    render,
    slope_record,
    startup_record,
    write_json,
)
from leantrain.golive.rehearse_slope import MicroBatchSlope
from leantrain.golive.rehearse_swaps import (
    accelerator_kernels,
    balanced_expert_splits,
    eager_optimizer_updates,
    forget_torch_caches,
    host_reads,
    planned_clock,
    planned_save,
    planned_weight_reads,
    rank_keyed_meshes,
    synthetic_data_dir,
    unwatched_fake_params,
)
from leantrain.hardware import accelerator_memory_bytes, target_capability
from leantrain.spec.schema import JobSpec
from leantrain.spec.shapes import resolve_shape


@dataclass(frozen=True)
class RehearsalTarget:
    """The job to rehearse: the spec (its world size applied) with the parallelism the trainer resolves for it
    (`spec_run`, what the plan is asked about), and which ranks."""

    spec: JobSpec
    spec_run: JobSpec
    world_size: int
    ranks: list[int]
    layout: str  # ParallelDims.describe() of the resolved layout
    slope: bool = False  # measure what one more micro-batch adds to the steady step (golive/rehearse_slope.py)


def resolve_target(spec: JobSpec, *, world_size: int | None, ranks: list[int] | None) -> RehearsalTarget:
    """The world size (the spec's `parallelism` product unless `--world`) and ranks; exit 2 on what cannot run."""
    from leantrain.parallel.dims import layout_for_run
    from leantrain.train.command import check_trainable

    check_trainable(spec)  # what train refuses is refused here by name, not as a code path under fake tensors
    par = spec.parallelism
    world = world_size or par.data_parallel * par.tensor_parallel * par.pipeline_parallel
    if world < 1:
        raise UserInputError(f"--world must be at least 1, not {world}")
    if world_size is not None and world_size != par.data_parallel * par.tensor_parallel * par.pipeline_parallel:
        fixed = par.tensor_parallel * par.pipeline_parallel
        if world % fixed:
            raise UserInputError(
                f"--world {world} is not divisible by parallelism.tensor_parallel × pipeline_parallel "
                f"({par.tensor_parallel} × {par.pipeline_parallel} = {fixed})")
        nodes = -(-world // spec.hardware.gpus_per_node)
        spec = spec.model_copy(update={
            "parallelism": par.model_copy(update={"data_parallel": world // fixed}),
            "hardware": spec.hardware.model_copy(update={"num_nodes": nodes}),
            "budget": spec.budget.model_copy(update={"num_gpus": world})})
    resolved, dims = layout_for_run(spec, world_size=world)
    per_stage = world // dims.pp
    # One rank per pipeline stage: rank 0 for the first, the last rank for the last, the first rank of the others.
    chosen = ranks if ranks else sorted({0, world - 1, *(s * per_stage for s in range(1, dims.pp - 1))})
    for rank in chosen:
        if not 0 <= rank < world:
            raise UserInputError(f"--ranks: rank {rank} is outside the world of {world} ranks (0..{world - 1})")
    return RehearsalTarget(spec=spec, spec_run=spec.model_copy(update={"parallelism": resolved}),
                           world_size=world, ranks=list(chosen), layout=dims.describe())


def rehearsal_spec(spec: JobSpec, *, data_dir: Path, run_dir: Path) -> JobSpec:
    """The spec the rehearsed trainer runs: the CPU as device, a scratch run dir, `STEPS` steps, no evaluation."""
    training = spec.training.model_copy(update={
        "device": "cpu", "max_steps": STEPS, "log_every": STEPS, "eval_every": 0, "compile": False,
        "deterministic": False})
    monitoring = spec.monitoring.model_copy(update={"log_every": None, "tensorboard": False})
    data = spec.data.model_copy(update={"dir": str(data_dir)})
    run = spec.run.model_copy(update={"dir": str(run_dir)})
    checkpoint = spec.checkpoint.model_copy(update={"storage": "local", "url": None, "memory_interval_steps": None})
    return spec.model_copy(update={"training": training, "monitoring": monitoring, "data": data, "run": run,
                                   "checkpoint": checkpoint})


def _rank_environment(rank: int, world_size: int, gpus_per_node: int) -> contextlib.AbstractContextManager[None]:
    """What torchrun would set for this rank (the trainer's runtime reads it)."""
    from leantrain.golive.drill import environment

    return environment({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % gpus_per_node),
                        "LOCAL_WORLD_SIZE": str(min(gpus_per_node, world_size)),
                        "GROUP_RANK": str(rank // gpus_per_node)})


def rehearse_rank(target: RehearsalTarget, *, rank: int, data_dir: Path, scratch: Path,
                  broadcasts: Broadcasts) -> dict[str, Any]:
    """Run the trainer as rank `rank` under a fake world; what it held, issued and read."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leantrain.ckpt.hook import TrainerCheckpointer
    from leantrain.ckpt.manager import CheckpointManager
    from leantrain.golive.rehearse_cachekey import fast_cache_keys
    from leantrain.golive.rehearse_dispatch import cache_hits, fast_cache_outputs, unwrapped_dispatch
    from leantrain.parallel.dryrun import fake_process_group
    from leantrain.train.trainer import Trainer

    spec = target.spec
    probes = Probes()
    files = FileReads()
    saves: list[dict[str, Any]] = []
    mem = step_mem_tracker(quiet=probes.paused)
    slope = MicroBatchSlope(probes, mem, torch.device("cpu")) if target.slope else None
    if slope is not None:
        mem.on_peak = slope.saw_peak
    steps_done: list[int] = []
    resident: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = scratch
        run_spec = rehearsal_spec(spec, data_dir=data_dir, run_dir=root / "run")
        comm_mode = CollectiveRecorder(probes, group_names={})
        sync_mode = HostSyncCounter(probes, collectives=comm_mode)  # one dispatch mode watches both
        with contextlib.ExitStack() as stack:
            stack.enter_context(_rank_environment(rank, target.world_size, spec.hardware.gpus_per_node))
            stack.enter_context(fake_process_group(rank=rank, world_size=target.world_size))
            stack.enter_context(mock.patch.object(CheckpointManager, "save", planned_save(saves, probes)))
            broadcasts.new_rank()
            stack.enter_context(object_collectives(probes, broadcasts))
            stack.enter_context(balanced_expert_splits(probes))
            stack.enter_context(rank_keyed_meshes())
            stack.enter_context(unseen_sharding_propagation())  # DTensor's global-shape meta is no memory
            stack.enter_context(fast_cache_keys())  # the same fake-tensor cache keys, built faster
            stack.enter_context(fast_cache_outputs())  # and the same cache-hit outputs
            stack.enter_context(unwrapped_dispatch(FakeTensorMode, HostSyncCounter, *type(mem).__mro__))
            stack.enter_context(unwatched_fake_params())  # `to_empty` of an unsharded model, as on a device
            stack.enter_context(accelerator_kernels(target_capability(spec.hardware.accelerator)))
            stack.enter_context(eager_optimizer_updates())
            stack.enter_context(planned_weight_reads())
            startup_s = time.perf_counter()
            with files.watch():
                fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                sync_mode.from_cache = cache_hits(fake_mode)
                stack.enter_context(sync_mode)
                stack.enter_context(host_reads(sync_mode))
                trainer = Trainer(run_spec, run_dir=root / "run", max_steps=STEPS,
                                  checkpointer_factory=TrainerCheckpointer)
            startup_s = time.perf_counter() - startup_s
            comm_mode.group_names.update(group_labels(trainer.parallel.mesh))
            mem.track_external(*trainer.parallel.parts, *reference_parts(trainer))
            step_fn = trainer.train_step

            def watched_step() -> Any:
                number = trainer.step + 1
                steps_done.append(number)
                probes.new_phase(f"step{number}")
                if number != 2:
                    return step_fn()
                # made in step 1, as the optimizer states (else met at the update, after the forward/backward peak)
                mem.track_external(*pipeline_receive_buffers(trainer.parallel.stages), trainer.optimizer)
                with mem, fsdp_gathers_as_temp(mem), (  # the steady step: optimizer states exist; its peak is the run's
                        slope.watch(trainer) if slope is not None else contextlib.nullcontext()):
                    result = step_fn()
                resident.update(resident_bytes(trainer))
                return result

            trainer.train_step = watched_step  # type: ignore[method-assign]
            # The collective timer profiles a logged step with torch.profiler: under fake tensors there is no
            # time to measure, and parsing the profile is most of a rehearsed step's cost.
            trainer._comm_measured = lambda: False  # type: ignore[method-assign]
            checkpoint_log = StepLog()  # the manager's calls are counted over the control window instead
            hook = trainer.checkpointer
            planned_clock(trainer, spec)  # `interval_steps: auto` decides on the planned step time, not this CPU's
            save_fn = hook.maybe_save

            def watched_save(trainer_: Any, *, force: bool = False) -> None:
                with probes.into(checkpoint_log):
                    save_fn(trainer_, force=force)

            hook.maybe_save = watched_save  # type: ignore[method-assign]
            logging_log = probes.new_log(LOGGING)
            log_fn = trainer._log

            def watched_log(window: Any, result: Any) -> Any:
                with probes.into(logging_log):
                    return log_fn(window, result)

            trainer._log = watched_log  # type: ignore[method-assign]
            step_s = time.perf_counter()
            trainer.train()
            step_s = (time.perf_counter() - step_s) / max(1, len(steps_done))
            probes.new_phase("control")
            hook.maybe_save = save_fn  # type: ignore[method-assign]
            window = control_window(trainer)
            peak = mem.get_tracker_snapshot("peak")
            stage = trainer.parallel.mesh["pp"].get_local_rank() if trainer.parallel.mesh is not None else 0
            num_microbatches = trainer.accum_steps
            trainer.close()  # checkpointer, metrics, then the process group (fake_process_group tolerates that)
    labels = comm_mode.group_names
    device = torch.device("cpu")
    return {
        "rank": rank,
        "pipeline_stage": stage,
        "num_microbatches": num_microbatches,
        "memory_bytes": memory_categories(peak.get(device, {}), resident),
        **per_step(probes, labels=labels, control_window=window),
        "startup": startup_record(files, probes.phase("startup"), labels=labels, startup_s=startup_s),
        "checkpoint_save": saves[-1] if saves else None,
        "rehearsal_s": {"startup": round(startup_s, 3), "step": round(step_s, 3)},
        **({"microbatch_slope": slope_record(slope, labels=labels)} if slope is not None else {}),
    }


class RehearsalDoesNotFit(LeantrainError):
    """A rehearsed rank needs more memory than its accelerator has (exit 1: the check failed)."""

    exit_code = 1


class RehearsalError(UserInputError):
    """A code path of the trainer that cannot run under fake tensors (exit 2, naming it)."""


def _rehearse_or_explain(target: RehearsalTarget, **kwargs: Any) -> dict[str, Any]:
    """`rehearse_rank`, with a failure that is not the user's input turned into one line naming the code path."""
    import traceback

    try:
        return rehearse_rank(target, **kwargs)
    except LeantrainError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure inside the trainer under fake tensors is reported
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "/leantrain/" in f.filename
                  and "/golive/rehearse" not in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else "torch"
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise RehearsalError(
            f"rank {kwargs['rank']}: the trainer's code at {where} cannot run under fake tensors: "
            f"{type(err).__name__}: {first}") from None


def _rank_worker(target: RehearsalTarget, rank: int, data_dir: Path, scratch: Path,
                 broadcasts: Broadcasts) -> tuple[str, Any]:
    """One rank in a worker process: ("ok", report) or ("error", message); what rank 0 broadcasts reaches the
    others through `broadcasts.channel` while it runs, not through this return value. A worker
    runs several ranks one after another: torch's per-mesh caches are dropped first (meshes of different ranks
    never compare equal while rehearsing: `rehearse_swaps.rank_keyed_meshes`)."""
    forget_torch_caches()
    try:
        report = _rehearse_or_explain(target, rank=rank, data_dir=data_dir, scratch=scratch, broadcasts=broadcasts)
    except UserInputError as err:
        return "error", str(err)
    return "ok", report


def _rehearse_ranks(targets: list[RehearsalTarget], *, ranks: list[int], data_dir: Path,
                    scratch: Path, isolated: bool = True) -> list[list[dict[str, Any]]]:
    """Each target's reports of `ranks`, rank 0 first (the source of the checkpoint manager's agreements: the
    others receive what it broadcast). Isolated: spawned worker processes, one per CPU core, for all the targets
    together (the short depths and micro-batch counts `--depth auto` rehearses): every target's rank 0 is given
    to the pool first and publishes what it broadcasts into a channel as it runs (golive/rehearse_peers.py), and
    the other ranks start as workers free up, waiting in the channel for a value rank 0 has not sent yet, so no
    core waits for a whole rank 0. A worker rehearses its ranks one after another (`_rank_worker` drops torch's
    per-mesh caches first, and `rehearse_swaps.rank_keyed_meshes` keeps one rank's meshes from matching
    another's)."""
    import concurrent.futures
    import multiprocessing
    from multiprocessing.managers import SyncManager

    reports: list[list[dict[str, Any]]] = [[] for _ in targets]
    rest = [r for r in ranks if r != 0]
    if not isolated:  # in this process, one rank after another (what a test that patches the trainer needs)
        for index, target in enumerate(targets):
            broadcasts = Broadcasts()
            for rank in [0, *rest]:
                forget_torch_caches()
                reports[index].append(_rehearse_or_explain(target, rank=rank, data_dir=data_dir, scratch=scratch,
                                                           broadcasts=broadcasts))
        forget_torch_caches()
        return reports

    def take(index: int, outcome: tuple[str, Any]) -> None:
        status, value = outcome
        if status != "ok":
            raise RehearsalError(value)
        reports[index].append(value)

    context = multiprocessing.get_context("spawn")
    jobs = [(index, rank) for index in range(len(targets)) for rank in rest]
    workers = max(1, min(len(targets) + len(jobs), os.cpu_count() or 1))
    manager = SyncManager(ctx=context)
    manager.start(initializer=die_with_parent)  # its server process, too, ends with this one
    with manager, concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=die_with_parent) as pool:
        channels = [manager.dict() for _ in targets]
        # Every target's rank 0 first (the pool starts work in the order it was given, so no rank waits on a
        # rank 0 that has not started), publishing what it broadcasts; the others start as workers free up.
        firsts = [pool.submit(_rank_worker, target, 0, data_dir, scratch,
                              Broadcasts(channel=channel, publishes=True))
                  for target, channel in zip(targets, channels, strict=True)]
        for future, channel in zip(firsts, channels, strict=True):
            future.add_done_callback(lambda _future, channel=channel: channel.__setitem__(DONE, [True]))
        others = [pool.submit(_rank_worker, targets[index], rank, data_dir, scratch,
                              Broadcasts(channel=channels[index])) for index, rank in jobs]
        for index, future in enumerate(firsts):
            take(index, future.result())
        for (index, _rank), future in zip(jobs, others, strict=True):
            take(index, future.result())
    return reports


def rehearse(spec: JobSpec, *, world_size: int | None = None, ranks: list[int] | None = None,
             data_dir: Path | None = None, isolated: bool = True, depth: str = "auto") -> dict[str, Any]:
    """rehearsal.json for `spec` (see docs/rehearse.md). `isolated`: the ranks in spawned worker processes (the
    default); False runs them in this process one after another (tests that patch the trainer). `depth`: `auto`
    rehearses a deep model at one and two layers per pipeline chunk and extends it (golive.rehearse_depth),
    `full` runs every layer."""
    from leantrain.golive import rehearse_depth

    if depth not in ("auto", "full"):
        raise UserInputError(f"--depth must be auto or full, not {depth!r}")
    target = resolve_target(spec, world_size=world_size, ranks=ranks)
    n_layers = resolve_shape(target.spec_run.model).n_layers
    full_reason = rehearse_depth.why_not_extended(target.spec_run, n_layers=n_layers) if depth == "auto" else (
        "--depth full")
    capacity = accelerator_memory_bytes(spec.hardware)
    if capacity <= 0:
        raise UserInputError(f"hardware.accelerator {spec.hardware.accelerator} has no known memory: set "
                             "hardware.memory_gb")
    if data_dir is None and (Path(spec.data.dir) / "manifest.json").is_file():
        data_dir = Path(spec.data.dir)
    # the plan compared prices the code rehearsed (eager kernels, unfused loss), not the spec's plan.kernels
    run_spec = target.spec_run.model_copy(update={"plan": spec.plan.model_copy(update={"kernels": "eager",
                                                                                       "fused_loss": False})})
    with tempfile.TemporaryDirectory(prefix="leantrain-rehearse-") as scratch:
        synthetic = data_dir is None
        data = synthetic_data_dir(target.spec, root=Path(scratch)) if data_dir is None else data_dir
        chosen = sorted({0, *target.ranks})

        def depths(target: RehearsalTarget) -> list[RehearsalTarget]:
            if full_reason is not None:
                return [target]
            chunks = rehearse_depth.chunks_of(target.spec_run)
            return [resolve_target(rehearse_depth.with_layers(target.spec, chunks * d), world_size=target.world_size,
                                   ranks=chosen) for d in rehearse_depth.SHORT_DEPTHS]

        def at_depth(target: RehearsalTarget, reports: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
            if full_reason is not None:
                return reports[0]
            one, two = reports
            return rehearse_depth.extend_reports(target.spec_run, n_layers=n_layers, one=one, two=two)

        count = rehearse_depth.microbatches(target.spec_run, world_size=target.world_size)
        short_counts = rehearse_depth.short_microbatches(target.spec_run, count=count) if depth == "auto" else None
        counted = [target] if short_counts is None else [replace(resolve_target(rehearse_depth.with_microbatches(
            target.spec, m, world_size=target.world_size), world_size=target.world_size, ranks=chosen),
            slope=len(short_counts) == 1) for m in short_counts]
        runs = [depths(t) for t in counted]  # every rehearsal this answer needs, run together
        flat = _rehearse_ranks([t for group in runs for t in group], ranks=chosen, data_dir=data,
                               scratch=Path(scratch), isolated=isolated)
        per_count = []
        for t, group in zip(counted, runs, strict=True):
            per_count.append(at_depth(t, flat[:len(group)]))
            flat = flat[len(group):]
        rank_reports = rehearse_depth.extend_to_count(per_count, counts=short_counts, count=count)
    num_microbatches = rank_reports[0]["num_microbatches"]  # the trainer's own accumulation count
    plan = planned_memory(run_spec, world_size=target.world_size, num_microbatches=num_microbatches)
    for report in rank_reports:  # each rank against the plan of its own pipeline stage
        report["plan_memory_bytes"] = planned_memory(run_spec, world_size=target.world_size,
                                                     num_microbatches=num_microbatches,
                                                     stage=report["pipeline_stage"])
        report["plan_vs_rehearsal"] = ratios_by_category(report["plan_memory_bytes"], report["memory_bytes"])
    heaviest = max(rank_reports, key=lambda r: r["memory_bytes"]["peak"])
    ratios = heaviest["plan_vs_rehearsal"]
    over = [(r["rank"], r["memory_bytes"]["peak"]) for r in rank_reports if r["memory_bytes"]["peak"] > capacity]
    return {
        "world_size": target.world_size,
        "layout": target.layout,
        "accelerator": spec.hardware.accelerator,
        "accelerator_memory_bytes": capacity,
        "data": "synthetic (the spec's data dir is not here)" if synthetic else str(data_dir),
        "num_microbatches": num_microbatches,
        "depth": rehearse_depth.depth_record(n_layers, full_reason=full_reason),
        "microbatches": rehearse_depth.microbatches_record(short_counts, count=count),
        "ranks": rank_reports,
        "plan": plan,
        "plan_kernels": "eager",  # what the rehearsal runs (no compile), whatever the spec's plan.kernels says
        "plan_vs_rehearsal": ratios,
        "fits": not over,
        "over_capacity": [{"rank": r, "peak_bytes": b, "category": largest_category(rank_reports, r)} for r, b in over],
    }


def run(*, console: Any, spec: JobSpec, world: int | None, ranks: str | None, json_out: Path | None,
        depth: str = "auto") -> None:
    """The CLI entry point: exit 0 when every rehearsed rank fits the accelerator, 1 when one does not."""
    world_size = resolve_target(spec, world_size=world, ranks=[0]).world_size
    report = rehearse(spec, world_size=world, ranks=parse_ranks(ranks, world_size=world_size), depth=depth)
    render(report, console=console)
    target = json_out or Path("rehearsal.json")
    write_json(report, target)
    console.print(f"wrote {target}")
    if not report["fits"]:
        gib = 2**30
        raise RehearsalDoesNotFit("; ".join(
            f"rank {o['rank']} needs {o['peak_bytes'] / gib:.2f} GiB, more than {spec.hardware.accelerator}'s "
            f"{report['accelerator_memory_bytes'] / gib:.2f} GiB (largest: {o['category']})"
            for o in report["over_capacity"]))


def plan_layout_spec(spec: JobSpec) -> JobSpec:
    """The spec with the layout `leantrain plan` chooses for it (degrees, ZeRO stage, schedule, micro-batch,
    recompute), the world being that layout's GPUs: what `plan --rehearse` rehearses."""
    from leantrain.parallel.dims import resolve_parallelism
    from leantrain.plan.planner import make_plan

    auto = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"layout": "auto"})})
    layout = make_plan(auto)["layout"]
    world = layout["dp"] * layout["tp"] * layout["pp"]
    par = resolve_parallelism(auto, world_size=world).model_copy(update={"layout": "spec"})
    training = spec.training.model_copy(update={
        "micro_batch": layout.get("micro_batch", spec.training.micro_batch),
        "activation_checkpointing": layout.get("recompute", spec.training.activation_checkpointing)})
    nodes = -(-world // spec.hardware.gpus_per_node)
    return spec.model_copy(update={
        "parallelism": par, "training": training,
        "hardware": spec.hardware.model_copy(update={"num_nodes": nodes}),
        "budget": spec.budget.model_copy(update={"num_gpus": world})})


def run_after(*, console: Any, spec: JobSpec, json_out: Path | None, planned: bool) -> None:
    """`plan --rehearse` (the plan's chosen layout) and `check --rehearse` (the spec's own layout)."""
    console.print("[bold]rehearsal[/bold] of " + ("the plan's layout" if planned else "the spec's layout"))
    run(console=console, spec=plan_layout_spec(spec) if planned else spec, world=None, ranks=None,
        json_out=json_out)
