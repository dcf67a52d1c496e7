"""Job files for clusters: what both kinds share (sizing, the torchrun command) and the Slurm batch script
(`--emit slurm`); the Kubernetes manifests (`--emit k8s`) are in `emit_k8s`.

Both start the same thing: torchrun's elastic agent on every node, rendezvous over c10d, running
`leantrain train` (and `preflight` first). The cluster's own scheduler does the placing; we only write files.
Sizes come from the plan (`leantrain.plan.planner.make_plan`) when the spec leaves the node count open,
otherwise from the spec; hosts in the run dir's node_health.json are excluded.

Checkpoint before the time limit (Slurm): `--signal=B:USR1@N` makes Slurm signal the batch shell N seconds
before the limit; its trap creates `RUN_DIR/checkpoint.request`, which the trainer polls each step (ckpt/hook.py:
the ranks agree, save blocking, rank 0 deletes the file, training stops), waits for that, refreshes the exclude
list and requeues the job. The script deletes a request left over from an earlier allocation before it starts.
Preemption requeues too (`--requeue`); the next allocation resumes from the newest valid checkpoint. torchrun
itself would die on SIGUSR1, which is why the signal goes to the batch shell and reaches the trainer as a file.
"""

from __future__ import annotations

import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError
from leantrain.hardware import get_accelerator
from leantrain.ops.health import HEALTH_FILE_NAME, excluded_hosts
from leantrain.ops.staging import is_remote
from leantrain.spec import JobSpec

CHECKPOINT_REQUEST_NAME = "checkpoint.request"
DEFAULT_CPUS_PER_GPU = 8
DEFAULT_MEMORY_GB_PER_GPU = 64
# torchrun's elastic restarts are flaky without a per-attempt store (shared/PYTORCH_CPU_NOTES.md).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def checkpoint_requested(run_dir: Path) -> bool:
    """True when the job asked for a checkpoint (time limit near); the trainer checks this each step."""
    return (Path(run_dir) / CHECKPOINT_REQUEST_NAME).exists()


def clear_checkpoint_request(run_dir: Path) -> None:
    """The trainer (rank 0) calls this after the requested checkpoint is committed, then stops; the batch
    shell's trap then requeues the job."""
    (Path(run_dir) / CHECKPOINT_REQUEST_NAME).unlink(missing_ok=True)


@dataclass(frozen=True)
class JobResources:
    """What one job asks the scheduler for."""

    num_nodes: int
    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory_gb_per_node: int
    gpu_resource: str | None  # Kubernetes extended resource name; None on CPU-only nodes
    source: str  # where num_nodes came from

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes


def _planned_num_gpus(spec: JobSpec) -> int | None:
    """GPU count from the planner (plan.json's resources.num_gpus), when it is built; None otherwise."""
    try:
        from leantrain.plan.planner import make_plan
    except ImportError:
        try:
            from leantrain.plan.command import make_plan  # type: ignore[attr-defined,no-redef]
        except ImportError:
            return None
    plan = make_plan(spec)
    if hasattr(plan, "model_dump"):
        plan = plan.model_dump()
    elif hasattr(plan, "to_dict"):
        plan = plan.to_dict()
    resources = plan.get("resources", {}) if isinstance(plan, dict) else getattr(plan, "resources", {})
    num = resources.get("num_gpus") if isinstance(resources, dict) else getattr(resources, "num_gpus", None)
    return int(num) if num else None


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
        if spec.hardware.num_nodes:
            num_nodes, source = spec.hardware.num_nodes, "hardware.num_nodes"
        elif (planned := _planned_num_gpus(spec)) is not None:
            num_nodes, source = math.ceil(planned / gpus_per_node), "plan resources.num_gpus"
        elif spec.budget.num_gpus:
            num_nodes, source = math.ceil(spec.budget.num_gpus / gpus_per_node), "budget.num_gpus"
        else:
            raise UserInputError(
                "cannot size the job: set hardware.num_nodes or budget.num_gpus (or pass --nnodes)"
            )
        min_nodes = max_nodes = num_nodes
        if spec.fault.elasticity:
            min_nodes = spec.fault.min_nodes or num_nodes
            max_nodes = spec.fault.max_nodes or num_nodes
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
        memory_gb_per_node=int(cluster.memory_gb_per_node or DEFAULT_MEMORY_GB_PER_GPU * gpus_per_node),
        gpu_resource=gpu_resource,
        source=source,
    )


def job_name(spec: JobSpec) -> str:
    """A DNS-1123 name (Kubernetes) that is also a fine Slurm job name."""
    raw = spec.run.name or Path(spec.run.dir).name or "leantrain"
    name = "".join(c if c.isalnum() else "-" for c in raw.lower()).strip("-")
    return (name or "leantrain")[:50]


@dataclass(frozen=True)
class TrainCommand:
    """How every node starts training: the spec file and the overrides a rank re-applies when it loads it."""

    spec_path: Path
    overrides: tuple[str, ...] = ()
    profile: str | None = None

    def spec_args(self, *, run_dir: str, extra_sets: tuple[str, ...] = ()) -> list[str]:
        """SPEC [--profile P] [--set k=v ...] --run-dir DIR, as `train` and the preflight worker take them."""
        args = [str(self.spec_path)]
        if self.profile:
            args += ["--profile", self.profile]
        for item in (*self.overrides, *extra_sets):
            args += ["--set", item]
        return [*args, "--run-dir", run_dir]


def torchrun_args(res: JobResources, *, max_restarts: int, rdzv_endpoint: str | None, rdzv_id: str | None) -> list[str]:
    """torchrun flags for an elastic c10d job; None endpoint/id leave them to the environment (PET_*)."""
    nnodes = f"{res.min_nodes}:{res.max_nodes}" if res.elastic else str(res.num_nodes)
    args = [f"--nnodes={nnodes}", f"--nproc-per-node={res.gpus_per_node}", f"--max-restarts={max_restarts}"]
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    if rdzv_id:
        args.append(f"--rdzv-id={rdzv_id}")
    return args


def _q(value: str | Path) -> str:
    """Quote for bash, leaving $VARS inside double quotes expandable."""
    text = str(value)
    if "$" in text:
        return '"' + text.replace('"', '\\"') + '"'
    return shlex.quote(text)


def _join(args: list[str]) -> str:
    return " ".join(_q(a) for a in args)


def _sbatch_options(
    spec: JobSpec, *, res: JobResources, run_dir: Path, name: str, exclude: list[str]
) -> dict[str, str | None]:
    """#SBATCH flags (None: a flag without a value)."""
    cluster = spec.cluster
    sbatch: dict[str, str | None] = {
        "job-name": name,
        "nodes": f"{res.min_nodes}-{res.max_nodes}" if res.elastic else str(res.num_nodes),
        "ntasks-per-node": "1",
        "cpus-per-task": str(res.cpus_per_node),
        "mem": f"{res.memory_gb_per_node}G",
        "exclusive": None,
        "time": cluster.time_limit,
        "requeue": None,
        "signal": f"B:USR1@{cluster.checkpoint_signal_s}",
        "open-mode": "append",
        "output": str(run_dir / "slurm-%j.out"),
    }
    if res.gpu_resource:
        sbatch["gpus-per-node"] = str(res.gpus_per_node)
    for key, value in (("partition", cluster.slurm_partition), ("account", cluster.slurm_account),
                       ("qos", cluster.slurm_qos)):
        if value:
            sbatch[key] = value
    if exclude:
        sbatch["exclude"] = ",".join(exclude)
    return sbatch


def _requeue_trap(*, signal_s: int, health_cmd: str) -> list[str]:
    """The USR1 handler: ask the trainer for a checkpoint, wait for it, refresh exclusions, requeue."""
    return [
        "checkpoint_then_requeue() {",
        f'  echo "leantrain: {signal_s} s to the time limit: checkpoint, then requeue"',
        f'  touch "$RUN_DIR/{CHECKPOINT_REQUEST_NAME}"',
        f"  local deadline=$((SECONDS + {max(5, signal_s - 30)}))",
        f'  while [ -e "$RUN_DIR/{CHECKPOINT_REQUEST_NAME}" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done',
        "  # A failure here must not stop the requeue (set -e would end the script).",
        f"  EXCLUDE=$({health_cmd} || true)",
        '  if [ -n "$EXCLUDE" ]; then scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$EXCLUDE" || true; fi',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "}",
        "trap checkpoint_then_requeue USR1",
    ]


# Bash keeps a background job's exit status until `wait` reports it; a trapped signal makes `wait` return
# early with a status > 128, and 127 means the status was already reported.
WAIT_FOR_TRAINING = [
    "TRAIN_PID=$!",
    "STATUS=0",
    "while :; do  # a trapped signal interrupts `wait`: wait again for the real exit status",
    '  if wait "$TRAIN_PID"; then CODE=0; else CODE=$?; fi',
    '  if [ "$CODE" -eq 127 ]; then break; fi  # already reported: STATUS holds it',
    '  STATUS=$CODE',
    '  if [ "$CODE" -le 128 ]; then break; fi',
    "done",
    'exit "$STATUS"',
    "",
]


def _stage_step(spec: JobSpec, *, srun: list[str], name: str) -> tuple[tuple[str, ...], list[str]]:
    """When the data dir is remote: the override pointing data.dir at the node-local copy, and the step."""
    cluster = spec.cluster
    if not is_remote(cluster.data_url):
        return (), []
    local = f"{cluster.node_local_dir.rstrip('/')}/{name}/data"
    stage = ["python", "-m", "leantrain.ops.staging", str(cluster.data_url), local]
    if cluster.data_endpoint_url:
        stage += ["--endpoint-url", cluster.data_endpoint_url]
    lines = ["# Stage the data dir to node-local disk (verified against the manifest, resumable).",
             _join([*srun, *stage]), ""]
    return (f"data.dir={local}",), lines


def _preflight_step(spec: JobSpec, *, res: JobResources, srun: list[str], spec_args: list[str]) -> list[str]:
    """Preflight under torchrun on every node, with its own rendezvous id."""
    rdzv = torchrun_args(res, max_restarts=0, rdzv_endpoint="$HEAD_NODE:$RDZV_PORT", rdzv_id="preflight-$SLURM_JOB_ID")
    worker = ["-m", "leantrain.ops.preflight_worker", *spec_args,
              "--expected-world-size", str(res.min_nodes * res.gpus_per_node),
              "--timeout-s", str(int(spec.cluster.preflight_timeout_s))]
    return [
        "# Preflight on every rank: all join, same versions, ports, DNS, disk, data. Failing hosts go to",
        f"# {HEALTH_FILE_NAME} and are excluded next time.",
        _join([*srun, "torchrun", *rdzv, *worker]), "",
    ]


def slurm_script(
    spec: JobSpec,
    *,
    command: TrainCommand,
    run_dir: Path,
    nnodes: str | None = None,
    nproc: int | None = None,
    max_restarts: int | None = None,
) -> str:
    """The sbatch file's text. Pure: reads the health file, writes nothing."""
    res = job_resources(spec, nnodes=nnodes, nproc=nproc)
    cluster = spec.cluster
    run_dir = Path(run_dir).resolve()
    restarts = spec.fault.max_restarts if max_restarts is None else max_restarts
    exclude = excluded_hosts(run_dir, crash_threshold=cluster.unhealthy_after_crashes)
    name = job_name(spec)
    sbatch = _sbatch_options(spec, res=res, run_dir=run_dir, name=name, exclude=exclude)

    # Inside the image the job needs the run dir, the spec's folder and the data (or the node-local stage).
    data_root = cluster.node_local_dir if is_remote(cluster.data_url) else str(spec.data.dir)
    mounts = ",".join(f"{d}:{d}" for d in dict.fromkeys([str(run_dir), str(Path(command.spec_path).parent), data_root]))
    container = [f"--container-image={cluster.image}", f"--container-mounts={mounts}",
                 "--no-container-mount-home"] if cluster.slurm_container else []
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", f"--cpus-per-task={res.cpus_per_node}", *container]
    extra_sets, stage_lines = _stage_step(spec, srun=srun, name=name)
    rdzv = torchrun_args(res, max_restarts=restarts, rdzv_endpoint="$HEAD_NODE:$RDZV_PORT", rdzv_id="$SLURM_JOB_ID")
    train = ["train", *command.spec_args(run_dir=str(run_dir), extra_sets=extra_sets)]
    preflight_lines = _preflight_step(spec, res=res, srun=srun, spec_args=command.spec_args(
        run_dir=str(run_dir), extra_sets=extra_sets)) if cluster.preflight else []
    health = ["python", "-m", "leantrain.ops.health", "$RUN_DIR", "--crash-threshold",
              str(cluster.unhealthy_after_crashes)]
    if cluster.slurm_container:  # the batch shell runs outside the image: read the file inside it
        health = ["srun", "--overlap", "--nodes=1", "--ntasks=1", *container, *health]
    health_cmd = _join(health)
    env_lines = [f"export {k}={_q(v)}" for k, v in TORCHRUN_ENV.items()]
    if cluster.slurm_container:
        env_lines.append(f"export LEANTRAIN_IMAGE={_q(cluster.image)}")
    else:
        env_lines.append(f'export PATH={_q(str(Path(sys.executable).parent))}:"$PATH"')
    header = [
        "#!/bin/bash",
        f"# Written by `leantrain launch --emit slurm` at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; "
        "regenerate it from the spec instead of editing.",
        f"# Sizes from {res.source}: {res.num_nodes} node(s) × {res.gpus_per_node} GPU(s).",
        *[f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={v}" for k, v in sbatch.items()],
    ]
    body = [
        "",
        "set -euo pipefail",
        "umask 077  # run dirs and checkpoints readable by the owner only",
        f"RUN_DIR={_q(run_dir)}",
        f"RDZV_PORT={cluster.rdzv_port}",
        'mkdir -p "$RUN_DIR"',
        "# A request left by an allocation that ended before the trainer served it would stop this one at once.",
        f'rm -f "$RUN_DIR/{CHECKPOINT_REQUEST_NAME}"',
        *env_lines,
        # Secrets are not written here: sbatch exports the submitting shell's environment to the job.
        "# All of the list is read (no `| head`): with pipefail, a SIGPIPE'd scontrol would end the job.",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'HEAD_NODE="${NODES[0]}"',
        "",
        *_requeue_trap(signal_s=cluster.checkpoint_signal_s, health_cmd=health_cmd),
        "",
        *stage_lines,
        *preflight_lines,
        "# Train: torchrun's elastic agent on every node, c10d rendezvous on the first node.",
        _join([*srun, "torchrun", *rdzv, "-m", "leantrain.cli", *train]) + " &",
        *WAIT_FOR_TRAINING,
    ]
    return "\n".join(header + body)


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
