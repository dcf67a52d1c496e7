"""The Slurm batch script (`leantrain launch --emit slurm`).

It starts torchrun's elastic agent on every node (c10d rendezvous on the first node) running
`leantrain train`, with `preflight` first; hosts in the run dir's node_health.json are excluded.

Checkpoint before the time limit: `--signal=B:USR1@N` makes Slurm signal the batch shell N seconds
before the limit; its trap creates `RUN_DIR/checkpoint.request` (ckpt/control.py), which the trainer polls each
step (ckpt/hook.py: the ranks agree, save blocking, rank 0 deletes the file, training stops), waits for that,
refreshes the exclude list and requeues the job. The script deletes a request left over from an earlier
allocation before it starts. Preemption requeues too (`--requeue`); the next allocation resumes from the newest
valid checkpoint. torchrun itself would die on SIGUSR1, which is why the signal goes to the batch shell and
reaches the trainer as a file.
"""

from __future__ import annotations

import time
from pathlib import Path

from leantrain.ckpt.control import CHECKPOINT_REQUEST_NAME
from leantrain.errors import REFUSAL_ENV, UserInputError
from leantrain.launch.fabric import nccl_env
from leantrain.launch.health import HEALTH_FILE_NAME, excluded_hosts
from leantrain.launch.job_spec import (
    ENV_NAME_RE,
    NO_RUNTIME,
    job_image,
    referenced_env_names,
    staging_env_names,
)
from leantrain.launch.resources import (
    TORCHRUN_ENV,
    JobResources,
    ShellRef,
    TrainCommand,
    job_name,
    job_resources,
    join_args,
    quote_arg,
    torchrun_args,
)
from leantrain.launch.staging import is_remote
from leantrain.launch.torchrun import restarts as torchrun_restarts
from leantrain.spec import JobSpec


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
        "mem": f"{res.memory_gib_per_node}G",
        "exclusive": None,
        "time": cluster.time_limit,
        "requeue": None,
        "signal": f"B:USR1@{cluster.checkpoint_signal_s}",
        "open-mode": "append",
        # In the submit folder: the run dir may not exist before the job creates it; the script tees its output
        # into RUN_DIR/slurm-<job id>.out as soon as it has.
        "output": f"{name}-%j.out",
    }
    if res.elastic:  # a lost node must not end the allocation: torchrun's agents go on with the rest
        sbatch["no-kill"] = None
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


FAILURE_REQUEUES_SUFFIX = "failure-requeues"  # RUN_DIR/slurm-<job id>.failure-requeues: this job's failure requeues

# Bash keeps a background job's exit status until `wait` reports it; a trapped signal makes `wait` return
# early with a status > 128, and 127 means the status was already reported.
def _wait_for_training(*, max_requeues: int, health_cmd: str) -> list[str]:
    """Wait for torchrun's exit status; after a failure, requeue (bad hosts excluded) up to max_requeues times,
    counted in RUN_DIR/slurm-<job id>.failure-requeues (the time-limit trap does not count)."""
    return [
        "TRAIN_PID=$!",
        "STATUS=0",
        "while :; do  # a trapped signal interrupts `wait`: wait again for the real exit status",
        '  if wait "$TRAIN_PID"; then CODE=0; else CODE=$?; fi',
        '  if [ "$CODE" -eq 127 ]; then break; fi  # already reported: STATUS holds it',
        '  STATUS=$CODE',
        '  if [ "$CODE" -le 128 ]; then break; fi',
        "done",
        "# Refused, not crashed: a rank refused the job's input (the spec, the data dir, a resume that does not",
        "# match) and wrote why. Another allocation would refuse it again: the job ends, exit 2, no requeue.",
        f'if [ "$STATUS" -ne 0 ] && [ -f "${REFUSAL_ENV}" ]; then',
        f'  echo "leantrain: the ranks refused the job (not requeued; fix the input and submit again): '
        f'$(cat "${REFUSAL_ENV}")"',
        "  exit 2",
        "fi",
        "# A failed run (beyond torchrun's own restarts) is requeued; the next allocation resumes from the newest",
        "# valid checkpoint. The failure requeues are counted in the run dir, not by SLURM_RESTART_COUNT: that also",
        "# counts the time-limit and preemption requeues, which must not use up this budget.",
        f'FAILED_FILE="$RUN_DIR/slurm-$SLURM_JOB_ID.{FAILURE_REQUEUES_SUFFIX}"',
        'FAILED=$(cat "$FAILED_FILE" 2>/dev/null || true)',
        'case "$FAILED" in ""|*[!0-9]*) FAILED=0;; esac',
        f'if [ "$STATUS" -ne 0 ] && [ "$FAILED" -lt {max_requeues} ]; then',
        '  FAILED=$((FAILED + 1))',
        '  echo "$FAILED" > "$FAILED_FILE"',
        f'  echo "leantrain: training exited $STATUS; failure requeue $FAILED of {max_requeues}"',
        f"  EXCLUDE=$({health_cmd} || true)",
        '  if [ -n "$EXCLUDE" ]; then scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$EXCLUDE" || true; fi',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$STATUS"',
        "",
    ]


def _runtime_prefix(spec: JobSpec, *, mounts: list[str], image: str | None) -> tuple[list[str], list[str]]:
    """(srun flags, command prefix) that run a step in the image: pyxis flags, or `apptainer exec`."""
    cluster = spec.cluster
    if cluster.slurm_runtime == "pyxis":
        return [f"--container-image={image}", f"--container-mounts={','.join(f'{d}:{d}' for d in mounts)}",
                "--no-container-mount-home"], []
    if cluster.slurm_runtime == "apptainer" and image is not None:
        sif = image if image.endswith(".sif") or "://" in image else f"docker://{image}"
        return [], ["apptainer", "exec", "--nv", "--cleanenv", "--bind", ",".join(mounts), sif]
    return [], []


def _secret_pass_through(spec: JobSpec, env_refs: dict[str, str] | None) -> list[str]:
    """Apptainer's --cleanenv drops the job's environment: pass each variable the spec references (its secrets,
    and S3 credentials for staging from s3://) by name, when the job has it. Names only, never values."""
    names = {n for n in referenced_env_names(spec, env_refs) | set(staging_env_names(spec))
             if ENV_NAME_RE.fullmatch(n)}
    if not names:
        return []
    return ["# The spec's variables (secrets), from the job's environment (sbatch exports the submitting shell's);",
            "# by name only: their values are never written here.",
            f"for name in {' '.join(sorted(names))}; do",
            '  if [ -n "${!name+x}" ]; then export "APPTAINERENV_$name=${!name}"; fi',
            "done"]


def _environment_lines(
    spec: JobSpec, *, image: str | None, dry_run: bool, env_refs: dict[str, str] | None = None
) -> list[str]:
    """How the nodes find leantrain (the image, the env hook or the shared venv), the fabric variables and,
    under apptainer, the spec's variables."""
    cluster = spec.cluster
    lines = [f"export {k}={quote_arg(v)}" for k, v in TORCHRUN_ENV.items()]
    if cluster.nccl_preset != "none" or cluster.nccl_env:
        lines.append(f"# NCCL fabric settings: cluster.nccl_preset {cluster.nccl_preset} (launch/fabric.py), "
                     "then cluster.nccl_env.")
    lines += [f"export {k}={quote_arg(v)}" for k, v in nccl_env(spec).items()]
    if cluster.slurm_runtime != "host":
        lines.append(f"export LEANTRAIN_IMAGE={quote_arg(image)}")
        if cluster.slurm_runtime == "apptainer":  # --cleanenv drops the host env: pass what the job sets
            names = [*TORCHRUN_ENV, *nccl_env(spec), "LEANTRAIN_IMAGE"]
            lines += [f"export APPTAINERENV_{n}=\"${n}\"" for n in names]
            lines += _secret_pass_through(spec, env_refs)
    elif cluster.env_hook:
        lines += ["# The env hook sets up leantrain on the node (modules, a venv on shared storage); srun steps "
                  "inherit it.", f"source {quote_arg(cluster.env_hook)}"]
    elif cluster.slurm_venv:
        lines += ["# The shared venv (cluster.slurm_venv), at the same path on every node; srun steps inherit it.",
                  f"source {quote_arg(cluster.slurm_venv.rstrip('/') + '/bin/activate')}"]
    elif dry_run:
        lines += ["# DRY RUN: " + NO_RUNTIME.split(":")[0] + "; this job stops here until the spec names one.",
                  ': "${LEANTRAIN_VENV:?set cluster.slurm_venv, cluster.env_hook or cluster.slurm_runtime in the '
                  'spec and emit again}"', 'source "$LEANTRAIN_VENV/bin/activate"']
    else:
        raise UserInputError(NO_RUNTIME)
    return lines


def _stage_step(spec: JobSpec, *, srun: list[str], name: str) -> tuple[tuple[str, ...], list[str]]:
    """When the data dir is remote: the override pointing data.dir at the node-local copy, and the step."""
    cluster = spec.cluster
    if not is_remote(cluster.data_url):
        return (), []
    local = f"{cluster.node_local_dir.rstrip('/')}/{name}/data"
    stage = ["python", "-m", "leantrain.launch.staging", str(cluster.data_url), local]
    if cluster.data_endpoint_url:
        stage += ["--endpoint-url", cluster.data_endpoint_url]
    lines = ["# Stage the data dir to node-local disk (verified against the manifest, resumable).",
             join_args([*srun, *stage]), ""]
    return (f"data.dir={local}",), lines


def _preflight_step(spec: JobSpec, *, res: JobResources, srun: list[str], spec_args: list[str]) -> list[str]:
    """Preflight under torchrun on every node, with its own rendezvous id."""
    rdzv = torchrun_args(res, max_restarts=0, rdzv_endpoint=ShellRef("$HEAD_NODE:$RDZV_PORT"),
                         rdzv_id=ShellRef("preflight-$SLURM_JOB_ID"))
    worker = ["-m", "leantrain.launch.preflight_worker", *spec_args,
              "--expected-world-size", str(res.min_nodes * res.gpus_per_node),
              "--timeout-s", str(int(spec.cluster.preflight_timeout_s))]
    return [
        "# Preflight on every rank: all join, same versions, ports, DNS, disk, data. Failing hosts go to",
        f"# {HEALTH_FILE_NAME} and are excluded next time.",
        join_args([*srun, "torchrun", *rdzv, *worker]), "",
    ]


def slurm_script(
    spec: JobSpec,
    *,
    command: TrainCommand,
    run_dir: Path,
    nnodes: str | None = None,
    nproc: int | None = None,
    max_restarts: int | None = None,
    job_spec: str | None = None,
    dry_run: bool = False,
    env_refs: dict[str, str] | None = None,
    source: Path | None = None,
) -> str:
    """The sbatch file's text. Pure: reads the health file, writes nothing. `job_spec`: the frozen spec's text,
    which the job writes to `command.spec_path` when it starts. `dry_run`: a missing image or node set-up becomes
    a placeholder (the job file is for reading) instead of an error. `env_refs`: the spec file's `${VAR}`
    values (job_spec.raw_env_references), whose variables an apptainer job passes into the image. `source`: the
    spec file, whose stem names the job when neither run.name nor run.dir does (resources.job_name)."""
    res = job_resources(spec, nnodes=nnodes, nproc=nproc)
    cluster = spec.cluster
    run_dir = Path(run_dir).resolve()
    restarts = torchrun_restarts(spec, max_restarts)  # 0 when fault.auto_restart is off, as for a local launch
    exclude = excluded_hosts(run_dir, crash_threshold=cluster.unhealthy_after_crashes)
    name = job_name(spec, source=source)
    sbatch = _sbatch_options(spec, res=res, run_dir=run_dir, name=name, exclude=exclude)

    # Inside the image the job needs the run dir, the spec's folder and the data (or the node-local stage).
    data_root = cluster.node_local_dir if is_remote(cluster.data_url) else str(Path(spec.data.dir).resolve())
    mounts = list(dict.fromkeys([str(run_dir), str(Path(command.spec_path).parent), data_root]))
    image = None if cluster.slurm_runtime == "host" else job_image(
        spec, dry_run=dry_run, why=f"cluster.slurm_runtime: {cluster.slurm_runtime}")
    container, prefix = _runtime_prefix(spec, mounts=mounts, image=image)
    # Elastic: a failed node's step must not take the others down (torchrun re-forms the group without it).
    kill = ["--kill-on-bad-exit=0", "--no-kill"] if res.elastic else ["--kill-on-bad-exit=1"]
    # --label: each output line starts with its node's task number (16,384 ranks' lines share slurm-<id>.out)
    srun = ["srun", "--ntasks-per-node=1", "--label", *kill, f"--cpus-per-task={res.cpus_per_node}", *container,
            *prefix]
    extra_sets, stage_lines = _stage_step(spec, srun=srun, name=name)
    rdzv = torchrun_args(res, max_restarts=restarts, rdzv_endpoint=ShellRef("$HEAD_NODE:$RDZV_PORT"),
                         rdzv_id=ShellRef("$SLURM_JOB_ID"))
    train = ["train", *command.spec_args(run_dir=str(run_dir), extra_sets=extra_sets)]
    preflight_lines = _preflight_step(spec, res=res, srun=srun, spec_args=command.spec_args(
        run_dir=str(run_dir), extra_sets=extra_sets)) if cluster.preflight else []
    health = [*prefix, "python", "-m", "leantrain.launch.health", ShellRef("$RUN_DIR"), "--crash-threshold",
              str(cluster.unhealthy_after_crashes)]
    if cluster.slurm_runtime != "host":  # the batch shell runs outside the image: read the file inside it
        health = ["srun", "--overlap", "--nodes=1", "--ntasks=1", *container, *health]
    health_cmd = join_args(health)
    env_lines = _environment_lines(spec, image=image, dry_run=dry_run, env_refs=env_refs)
    spec_lines = [] if job_spec is None else [
        "# The spec this job runs, frozen when the job file was written (`${VAR}` values resolve on the nodes).",
        f"cat > {quote_arg(command.spec_path)} <<'LEANTRAIN_JOB_SPEC'", job_spec.rstrip("\n"), "LEANTRAIN_JOB_SPEC"]
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
        f"RUN_DIR={quote_arg(run_dir)}",
        f"RDZV_PORT={cluster.rdzv_port}",
        'mkdir -p "$RUN_DIR"',
        'exec > >(tee -a "$RUN_DIR/slurm-$SLURM_JOB_ID.out") 2>&1  # the console, also in the run dir',
        *spec_lines,
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
        "# A rank that refuses the job writes why here; torchrun's restarts in this allocation then refuse at once.",
        f'export {REFUSAL_ENV}="$RUN_DIR/refused-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}.json"',
        *([f'export APPTAINERENV_{REFUSAL_ENV}="${REFUSAL_ENV}"'] if cluster.slurm_runtime == "apptainer" else []),
        "# Train: torchrun's elastic agent on every node, c10d rendezvous on the first node. node_run keeps each",
        "# rank's output in RUN_DIR/logs/<host>/ and records a crash of its node in node_health.json.",
        join_args([*srun, "python", "-m", "leantrain.launch.node_run", ShellRef("$RUN_DIR"), "--", "torchrun", *rdzv,
                   "-m", "leantrain.cli", *train]) + " &",
        # fault.auto_restart: false is no restart at all, torchrun's (above) nor Slurm's requeue after a failure
        *_wait_for_training(max_requeues=cluster.max_requeues if spec.fault.auto_restart else 0,
                            health_cmd=health_cmd),
    ]
    return "\n".join(header + body)
