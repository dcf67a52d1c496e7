"""What every cluster job file shares: the job's size (nodes, GPUs, CPUs, memory per node), its name, and the
command each node runs (torchrun's elastic agent starting `leantrain train`).

Sizes come from the plan (`leantrain.plan.planner.make_plan`) when the spec leaves the node count open,
otherwise from the spec. The Slurm script is written by `launch/slurm.py`, the Kubernetes manifests by
`launch/k8s.py`, and local runs by `launch/torchrun.py`; all three take these pieces from here.
"""

from __future__ import annotations

import math
import re
import shlex
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError
from leantrain.hardware import get_accelerator
from leantrain.parallel.dims import ParallelDims, resolve_parallelism
from leantrain.plan.budget import HOST_MEMORY_GB_PER_GPU
from leantrain.spec import JobSpec
from leantrain.spec.rules import batch_fix_hint
from leantrain.spec.schema import RunSpec
from leantrain.spec.shapes import resolve_shape

DEFAULT_CPUS_PER_GPU = 8
DEFAULT_MEMORY_GB_PER_GPU = HOST_MEMORY_GB_PER_GPU  # the plan sizes the fast tier against the same default
# torchrun's elastic restarts are flaky when new workers reuse the shared rendezvous store (dead workers'
# addresses linger there): a store per restart attempt fixed it on gloo.
# KINETO_LOG_LEVEL 6 (above kineto's USDT level 5): the profiler behind comm_s (parallel/comm.py) prints two
# `USDT ... profiler_start/stop` lines per measured step and device-probe errors otherwise; set it to 0 to see them.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "KINETO_LOG_LEVEL": "6"}


@dataclass(frozen=True)
class JobResources:
    """What one job asks the scheduler for."""

    num_nodes: int
    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory_gib_per_node: int  # GiB: Slurm --mem=…G, Kubernetes …Gi
    gpu_resource: str | None  # Kubernetes extended resource name; None on CPU-only nodes
    source: str  # where num_nodes came from

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes


def _planned_num_gpus(spec: JobSpec) -> tuple[int, int] | None:
    """(GPUs the budget needs, GPUs with the plan's spare) from the planner; None when the plan gives none."""
    from leantrain.plan.planner import make_plan

    resources = make_plan(spec).get("resources", {})
    num = resources.get("num_gpus")
    if not num:
        return None
    return int(num), int(resources.get("num_gpus_with_spare") or num)


def layout_at(spec: JobSpec, *, nproc: int, nodes: int) -> ParallelDims:
    """The spec's layout on `nodes` × `nproc` ranks (dp fills what tp × pp leave); raises UserInputError naming
    the axis, or the global batch, that does not fit that world size."""
    world = nodes * nproc
    par = resolve_parallelism(spec, world_size=world)
    dims = ParallelDims.from_spec(par, world_size=world, shape=resolve_shape(spec.model), gpus_per_node=nproc)
    tokens_per_micro_step = spec.training.micro_batch * spec.data.seq_len * dims.dp
    if spec.training.global_batch_tokens % tokens_per_micro_step:
        raise UserInputError(
            f"training.global_batch_tokens ({spec.training.global_batch_tokens}) is not a multiple of "
            f"micro_batch × seq_len × data-parallel ranks ({spec.training.micro_batch} × {spec.data.seq_len} × "
            f"{dims.dp} = {tokens_per_micro_step}) at {world} ranks: " + batch_fix_hint(
                global_batch_tokens=spec.training.global_batch_tokens, micro_batch=spec.training.micro_batch,
                seq_len=spec.data.seq_len, data_parallel=dims.dp) + ".")
    return dims


def layout_problem(spec: JobSpec, *, nproc: int, nodes: int) -> str | None:
    """Why the layout does not run on `nodes` × `nproc` ranks; None when it does."""
    try:
        layout_at(spec, nproc=nproc, nodes=nodes)
    except UserInputError as err:
        return str(err)
    return None


def elastic_floor(spec: JobSpec, *, nproc: int, floor: int, max_nodes: int) -> int | None:
    """The smallest node count ≥ `floor` from which the layout runs at every count up to `max_nodes` (an elastic
    job may re-form at any of them); None when it does not run at `max_nodes` either."""
    best = None
    for nodes in range(max_nodes, floor - 1, -1):
        if layout_problem(spec, nproc=nproc, nodes=nodes) is not None:
            break
        best = nodes
    return best


def parse_nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` (torchrun's syntax) → (min, max)."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if low < 1 or high < low:
        raise UserInputError(f"--nnodes {text!r}: expected N or MIN:MAX with 1 ≤ MIN ≤ MAX")
    return low, high


def job_resources(spec: JobSpec, *, nnodes: str | None = None, nproc: int | None = None) -> JobResources:
    """Nodes, GPUs, CPUs and memory per node: flags first, then the spec's node count, then the plan."""
    accelerator = get_accelerator(spec.hardware.accelerator)
    gpus_per_node = nproc or spec.hardware.gpus_per_node
    if nnodes:
        min_nodes, max_nodes = parse_nnodes(nnodes)
        num_nodes, source = max_nodes, "--nnodes"
    else:
        planned = None
        if spec.hardware.num_nodes:
            num_nodes, source = spec.hardware.num_nodes, "hardware.num_nodes"
        elif (planned := _planned_num_gpus(spec)) is not None:
            # The plan's count with spare: the spare nodes are what an elastic job loses a node into.
            num_nodes, source = math.ceil(planned[1] / gpus_per_node), "plan resources.num_gpus_with_spare"
        elif spec.budget.num_gpus:
            num_nodes, source = math.ceil(spec.budget.num_gpus / gpus_per_node), "budget.num_gpus"
        else:
            raise UserInputError(
                "cannot size the job: set hardware.num_nodes or budget.num_gpus (or pass --nnodes)"
            )
        min_nodes = max_nodes = num_nodes
        if spec.fault.elasticity:
            floor = math.ceil(planned[0] / gpus_per_node) if planned is not None else num_nodes
            max_nodes = spec.fault.max_nodes or num_nodes
            # Not given: the lowest count from which the job re-forms at every count up to the top (the spare
            # nodes a plan adds need not divide the global batch: seed-10b's 16 nodes do, 15 do not).
            derived = elastic_floor(spec, nproc=gpus_per_node, floor=min(floor, num_nodes), max_nodes=max_nodes)
            # (none, or above the job's own count: check_layout then says which counts run)
            usable = derived is not None and derived <= num_nodes
            min_nodes = spec.fault.min_nodes or (derived if usable else min(floor, num_nodes))
    if not min_nodes <= num_nodes <= max_nodes:
        raise UserInputError(f"nodes {num_nodes} is outside fault.min_nodes..max_nodes = {min_nodes}..{max_nodes}")
    cluster = spec.cluster
    is_cpu = accelerator.name == "cpu"
    gpu_resource = None if is_cpu else ("amd.com/gpu" if accelerator.name.startswith("MI") else "nvidia.com/gpu")
    return JobResources(
        num_nodes=num_nodes,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        gpus_per_node=gpus_per_node,
        cpus_per_node=cluster.cpus_per_node or DEFAULT_CPUS_PER_GPU * gpus_per_node,
        memory_gib_per_node=int(cluster.host_memory_gib or DEFAULT_MEMORY_GB_PER_GPU * gpus_per_node),
        gpu_resource=gpu_resource,
        source=source,
    )


DEFAULT_RUN_DIR_NAME = Path(RunSpec.model_fields["dir"].default).name  # `run`, of runs/run
JOB_NAME_MAX = 50  # a Kubernetes name is ≤ 63 characters: room for the job's suffix and `-spec`


def dns_label(raw: str, *, max_len: int = JOB_NAME_MAX) -> str:
    """`raw` as a DNS-1035 label, which Kubernetes requires of a job's name: ASCII lower case, digits and `-`,
    starting with a letter (`run-` is put before a leading digit), ending with a letter or digit. Accents are
    dropped (`Ü` → `u`), every other run of characters becomes one `-`; nothing left gives `leantrain`."""
    text = unicodedata.normalize("NFKD", raw).encode("ascii", "ignore").decode("ascii").lower()
    name = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if not name:
        return "leantrain"
    if not name[0].isalpha():
        name = f"run-{name}"
    return name[:max_len].rstrip("-")


def job_name(spec: JobSpec, *, source: Path | None = None) -> str:
    """The run's name as a DNS-1035 label (dns_label): the Kubernetes job's name before its suffix, the run dir's
    name on the PVC, and the Slurm job name. `run.name`, else the run dir's name unless it is the default's
    (`runs/run`), then the stem of the spec file the job comes from (`source`), so that jobs from different
    specs left at the default do not share one cluster run dir or job name."""
    dir_name = Path(spec.run.dir).name
    if spec.run.name:
        raw = spec.run.name
    elif dir_name != DEFAULT_RUN_DIR_NAME or source is None:
        raw = dir_name
    else:
        raw = Path(source).stem
    return dns_label(raw or "leantrain")


@dataclass(frozen=True)
class TrainCommand:
    """How every node starts training: the spec file and the overrides a rank re-applies when it loads it."""

    spec_path: Path
    overrides: tuple[str, ...] = ()
    profile: str | None = None
    train_args: tuple[str, ...] = ()  # more `train` flags for the first start (--resume, --weights-only, ...)

    def spec_args(self, *, run_dir: str, extra_sets: tuple[str, ...] = ()) -> list[str]:
        """SPEC [--profile P] [--set k=v ...] --run-dir DIR, as `train` and the preflight worker take them."""
        args = [str(self.spec_path)]
        if self.profile:
            args += ["--profile", self.profile]
        for item in (*self.overrides, *extra_sets):
            args += ["--set", item]
        return [*args, "--run-dir", run_dir]


class ShellRef(str):
    """A word of a job script whose `$VAR`s are variables the script itself sets ($RUN_DIR, $HEAD_NODE,
    $SLURM_JOB_ID, ...): `quote_arg` leaves them for bash to expand. Every other word is written literally."""


def _flag(flag: str, value: str) -> str:
    """`flag=value`, still a ShellRef when the value is one."""
    text = f"{flag}={value}"
    return ShellRef(text) if isinstance(value, ShellRef) else text


def torchrun_args(res: JobResources, *, max_restarts: int, rdzv_endpoint: str | None, rdzv_id: str | None) -> list[str]:
    """torchrun flags for an elastic c10d job; None endpoint/id leave them to the environment (PET_*)."""
    nnodes = f"{res.min_nodes}:{res.max_nodes}" if res.elastic else str(res.num_nodes)
    args = [f"--nnodes={nnodes}", f"--nproc-per-node={res.gpus_per_node}", f"--max-restarts={max_restarts}"]
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", _flag("--rdzv-endpoint", rdzv_endpoint)]
    if rdzv_id:
        args.append(_flag("--rdzv-id", rdzv_id))
    return args


def quote_arg(value: str | Path) -> str:
    """Quote for bash: literally (single quotes; a path or value with `$`, a quote or a space stays as it is),
    except a ShellRef, whose $VARS stay expandable inside double quotes."""
    text = str(value)
    if isinstance(value, ShellRef):
        return '"' + "".join("\\" + c if c in '"\\`' else c for c in text) + '"'
    return shlex.quote(text)


def join_args(args: list[str]) -> str:
    return " ".join(quote_arg(a) for a in args)


def write_job_file(text: str, out: Path) -> Path:
    """Write a job file (0600: it names paths and accounts; it never holds secrets)."""
    from leantrain.security import write_private_text

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_private_text(out, text)
    return out


def describe(res: JobResources) -> dict[str, Any]:
    return {"nodes": res.num_nodes, "min_nodes": res.min_nodes, "max_nodes": res.max_nodes,
            "gpus_per_node": res.gpus_per_node, "source": res.source}
