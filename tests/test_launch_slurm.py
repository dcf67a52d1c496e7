"""Slurm job files: #SBATCH lines, the srun torchrun command (parsed by torchrun's own parser), the node-health
exclude list, and the time-limit signal → checkpoint → requeue path run against fake srun/scontrol."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from leantrain.ckpt.control import CHECKPOINT_REQUEST_NAME
from leantrain.cli import main
from leantrain.errors import UserInputError
from leantrain.launch.health import excluded_hosts, record_failure
from leantrain.launch.resources import TrainCommand, job_resources
from leantrain.launch.slurm import slurm_script
from leantrain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed-10b.yaml"
TINY = REPO / "examples" / "tiny-cpu.yaml"
VENV = "cluster.slurm_venv=/shared/venvs/leantrain"  # the nodes' leantrain: a venv on shared storage
IMAGE = "cluster.image=registry.example.com/ml/leantrain@sha256:" + "0" * 64


def env_hook(tmp_path: Path) -> str:
    """An env hook that bash can source (the scripts that run here): the cluster's set-up of a venv with
    leantrain, here this interpreter's."""
    hook = tmp_path / "env.sh"
    hook.write_text(f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"\n')
    return f"cluster.env_hook={hook}"


def sbatch_options(text: str) -> dict[str, str | None]:
    options: dict[str, str | None] = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            flag = line.removeprefix("#SBATCH ").strip()
            key, _, value = flag.partition("=")
            options[key] = value or None
    return options


def srun_torchrun_lines(text: str) -> list[list[str]]:
    """Each `srun ... torchrun ...` line split as bash would (variables left unexpanded)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("srun "):
            words = shlex.split(line.removesuffix(" &"))
            if "torchrun" in words:
                lines.append(words)
    return lines


def torchrun_parsed(words: list[str]):
    """Parse the words after `torchrun` with torchrun's own argument parser: it must accept them."""
    return get_args_parser().parse_args(words[words.index("torchrun") + 1:])


def test_slurm_job_has_nodes_gpus_exclusive_requeue_signal_and_c10d_torchrun(tmp_path: Path) -> None:
    spec = load_spec(SEED, profile="rehearsal", overrides=[VENV, "cluster.slurm_partition=gpu", "fault.max_restarts=5"])
    text = slurm_script(spec, command=TrainCommand(spec_path=SEED, profile="rehearsal"), run_dir=tmp_path / "run")
    options = sbatch_options(text)
    assert options["--nodes"] == "4" and options["--gpus-per-node"] == "8"
    assert "--exclusive" in options and "--requeue" in options
    assert options["--signal"] == "B:USR1@120" and options["--time"] == "24:00:00"
    assert options["--partition"] == "gpu" and options["--ntasks-per-node"] == "1"
    assert "--exclude" not in options
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)

    preflight, train = srun_torchrun_lines(text)
    args = torchrun_parsed(train)
    assert args.nnodes == "4" and args.nproc_per_node == "8" and args.max_restarts == 5
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "$HEAD_NODE:$RDZV_PORT"
    assert args.module and args.training_script == "leantrain.cli"
    assert args.training_script_args[:2] == ["train", str(SEED)]
    assert args.training_script_args[2:4] == ["--profile", "rehearsal"]
    assert 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")\nHEAD_NODE="${NODES[0]}"' in text
    pre = torchrun_parsed(preflight)
    assert pre.training_script == "leantrain.launch.preflight_worker" and pre.max_restarts == 0
    assert text.index("preflight_worker") < text.index("leantrain.cli train")


def test_elastic_nodes_and_remote_data_are_staged_first(tmp_path: Path) -> None:
    spec = load_spec(SEED, profile="rehearsal", overrides=[VENV,
        "fault.min_nodes=2", "fault.max_nodes=6", "cluster.data_url=s3://bucket/data", "cluster.preflight=false",
    ])
    text = slurm_script(spec, command=TrainCommand(spec_path=SEED, profile="rehearsal"), run_dir=tmp_path)
    assert sbatch_options(text)["--nodes"] == "2-6"
    (train,) = srun_torchrun_lines(text)
    args = torchrun_parsed(train)
    assert args.nnodes == "2:6"
    local_dir = "/tmp/leantrain/run/data"
    assert ["--set", f"data.dir={local_dir}"] == args.training_script_args[4:6]
    stage = next(line for line in text.splitlines() if "leantrain.launch.staging" in line)
    assert shlex.split(stage)[-2:] == ["s3://bucket/data", local_dir]
    assert text.index("leantrain.launch.staging") < text.index("leantrain.cli")


def test_health_file_hosts_are_excluded(tmp_path: Path) -> None:
    record_failure(tmp_path, host="node07", kind="preflight", reason="torch 2.0.0 (others 2.13.0)", rank=3)
    record_failure(tmp_path, host="node09", kind="crash", reason="SIGKILL", rank=5)
    assert excluded_hosts(tmp_path) == ["node07"]  # one crash is not yet "repeatedly"
    record_failure(tmp_path, host="node09", kind="crash", reason="SIGKILL again", rank=5)
    spec = load_spec(SEED, profile="rehearsal", overrides=[VENV])
    text = slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    assert sbatch_options(text)["--exclude"] == "node07,node09"


def test_crashes_of_many_hosts_at_once_are_the_jobs_and_exclude_no_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout that runs out of memory, or a bug every rank raises, fails every node: each node's training step
    (launch.node_run) records a crash of its own. Counted, two such failures would exclude every node of the job,
    and the requeue would wait for nodes that do not exist. Crashes of JOB_WIDE_HOSTS (3) or more hosts within
    JOB_WIDE_WINDOW_S are the job's and count against none (a node that finds 3 other hosts' crashes there does
    not write the file at all: 2,048 nodes each rewriting it took 40 s); two hosts at once may be one bad host and
    its peer, and count against both."""
    from leantrain.launch.health import read_health

    clock = [1_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    def crash(*hosts: str) -> None:
        for host in hosts:
            clock[0] += 5  # the nodes' steps end seconds apart
            record_failure(tmp_path, host=host, kind="crash", reason="torch.OutOfMemoryError")
        clock[0] += 3_600

    crash("n1", "n2", "n3", "n4")
    crash("n1", "n2", "n3", "n4")
    assert excluded_hosts(tmp_path) == [] and sorted(read_health(tmp_path)) == ["n1", "n2", "n3"]
    crash("n5", "n6")
    crash("n5", "n6")
    assert excluded_hosts(tmp_path) == ["n5", "n6"]
    crash("n1")  # alone, once: its two job-wide crashes do not count
    assert excluded_hosts(tmp_path) == ["n5", "n6"]
    crash("n1")
    assert excluded_hosts(tmp_path) == ["n1", "n5", "n6"]


def test_resources_flags_override_spec_and_bad_nnodes_is_a_user_error() -> None:
    spec = load_spec(SEED, profile="rehearsal", overrides=[VENV])
    res = job_resources(spec, nnodes="2:8", nproc=4)
    assert (res.min_nodes, res.num_nodes, res.max_nodes, res.gpus_per_node) == (2, 8, 8, 4)
    assert res.gpu_resource == "nvidia.com/gpu"
    assert job_resources(load_spec(TINY)).gpu_resource is None
    open_size = load_spec(SEED)  # no node count in the spec: the planner sizes the job
    planned = job_resources(open_size)
    from leantrain.plan.planner import make_plan

    resources = make_plan(open_size)["resources"]
    assert resources["num_gpus_with_spare"] > resources["num_gpus"]  # 126 > 116 for the seed example
    assert planned.source == "plan resources.num_gpus_with_spare"
    assert planned.num_nodes * 8 >= resources["num_gpus_with_spare"] > (planned.num_nodes - 1) * 8
    # Elastic (the seed example sets fault.elasticity): the spare nodes may be lost, down to what the budget needs,
    # where the layout runs at every count in between. Its 1,024 sequences per step do not divide over the 15
    # data-parallel ranks of 15 nodes (tp 2 × pp 4): the floor stays at 16 (the job re-formed at 15 nodes would
    # fail each restart there); 240 sequences divide over 15 and 16.
    assert planned.min_nodes == planned.num_nodes == planned.max_nodes == 16
    divisible = job_resources(load_spec(SEED, overrides=[f"training.global_batch_tokens={240 * 4096}"]))
    assert divisible.min_nodes == -(-resources["num_gpus"] // 8) == 15 < divisible.num_nodes == divisible.max_nodes
    with pytest.raises(Exception, match="MIN:MAX"):
        job_resources(spec, nnodes="8:2")


def test_cli_emit_writes_owner_only_file_and_audits(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    code = main(["launch", str(SEED), "--profile", "rehearsal", "--set", VENV, "--emit", "slurm", "--out", str(out),
                 "--run-dir", str(tmp_path / "run")])
    assert code == 0
    assert out.stat().st_mode & 0o077 == 0
    assert not (tmp_path / "run").exists()  # --emit writes only the job file (and its audit line beside it)
    assert "launch.emit" in (tmp_path / "audit.log").read_text()
    assert main(["launch", str(SEED), "--profile", "rehearsal", "--emit", "pbs", "--out", str(out)]) == 2
    # a layout that does not fit the launched ranks is refused before any rank starts
    assert main(["launch", str(TINY), "--nproc", "3", "--set", "parallelism.data_parallel=1",
                 "--set", "parallelism.tensor_parallel=2", "--run-dir", str(tmp_path / "r2")]) == 2


def _fake_slurm_bin(bin_dir: Path, log: Path) -> None:
    """srun runs the step's command line only as a marker, except the train step: that runs the real checkpoint
    adapter with a tiny model in a step loop (tests/test_ckpt_hook.py as a script), which saves when asked,
    deletes the request and stops. scontrol prints two hosts and records updates/requeues; at the requeue it
    also records whether the request is still there and which checkpoints exist."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = show ]; then echo node01; echo node02; else echo "scontrol $*" >> {log}; fi\n'
        'if [ "$1" = requeue ]; then\n'
        f'  if [ -e "$RUN_DIR/{CHECKPOINT_REQUEST_NAME}" ]; then echo "request pending" >> {log}; fi\n'
        f'  echo "checkpoints: $(ls "$RUN_DIR/checkpoints" | tr "\\n" " ")" >> {log}\n'
        "fi\n"
    )
    driver = REPO / "tests" / "test_ckpt_hook.py"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f'echo "srun $*" >> {log}\n'
        'case "$*" in *leantrain.cli*)\n'
        f'  OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} {shlex.quote(str(driver))} "$RUN_DIR" {log};;\n'
        "esac\n"
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)


@pytest.mark.slow
def test_time_limit_signal_asks_for_checkpoint_then_requeues_with_exclusions(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    record_failure(run_dir, host="node07", kind="preflight", reason="driver mismatch")
    (run_dir / CHECKPOINT_REQUEST_NAME).touch()  # left by an earlier allocation: must not stop this one at once
    spec = load_spec(SEED, profile="rehearsal", overrides=[env_hook(tmp_path), "cluster.checkpoint_signal_s=40"])
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(spec, command=TrainCommand(spec_path=SEED, profile="rehearsal"), run_dir=run_dir))
    log = tmp_path / "slurm.log"
    _fake_slurm_bin(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node[01-02]", "RUN_DIR": str(run_dir)}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not Path(f"{log}.train-started").exists():  # the adapter is built and stepping
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    lines = log.read_text().splitlines()
    assert any("--rdzv-endpoint=node01:29500" in line and "--rdzv-id=42" in line for line in lines)
    (stopped,) = [line for line in lines if line.startswith("trainer stopped")]
    assert stopped.endswith(": checkpoint requested"), stopped
    saved_step = int(stopped.split()[4].rstrip(":"))
    update = lines.index("scontrol update JobId=42 ExcNodeList=node07")
    assert lines[update + 1:update + 3] == ["scontrol requeue 42", f"checkpoints: step-{saved_step:08d} "]
    assert not (run_dir / CHECKPOINT_REQUEST_NAME).exists()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "checkpoint_request_done"] == [saved_step]


def test_container_mode_runs_every_step_in_the_image_with_the_needed_mounts(tmp_path: Path) -> None:
    spec = load_spec(SEED, profile="rehearsal", overrides=["cluster.slurm_runtime=pyxis", IMAGE])
    text = slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    for words in srun_torchrun_lines(text):
        image = next(w for w in words if w.startswith("--container-image="))
        assert image == f"--container-image={spec.cluster.image}"
        mounts = next(w for w in words if w.startswith("--container-mounts=")).split("=", 1)[1].split(",")
        assert {f"{tmp_path}:{tmp_path}", f"{SEED.parent}:{SEED.parent}"} <= set(mounts)
    assert f"export LEANTRAIN_IMAGE={spec.cluster.image}" in text  # lineage records the image
    assert sys.executable not in text  # nothing of the submit host's venv


def test_apptainer_runtime_and_env_hook_replace_the_submit_hosts_venv(tmp_path: Path) -> None:
    spec = load_spec(SEED, profile="rehearsal", overrides=["cluster.slurm_runtime=apptainer", IMAGE])
    text = slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    for words in srun_torchrun_lines(text):
        at = words.index("apptainer")
        assert words[at:at + 4] == ["apptainer", "exec", "--nv", "--cleanenv"]
        assert words[at + 6] == f"docker://{spec.cluster.image}"
        assert words[at + 7] == "torchrun" or words[at + 7:at + 10] == ["python", "-m", "leantrain.launch.node_run"]
        assert str(tmp_path) in words[at + 5].split(",")
    assert 'export APPTAINERENV_TORCH_NCCL_ASYNC_ERROR_HANDLING="$TORCH_NCCL_ASYNC_ERROR_HANDLING"' in text
    assert sys.executable not in text
    hooked = slurm_script(load_spec(SEED, profile="rehearsal", overrides=["cluster.env_hook=/shared/env.sh"]),
                          command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    assert "source /shared/env.sh" in hooked and sys.executable not in hooked
    shared = slurm_script(load_spec(SEED, profile="rehearsal", overrides=[VENV]), command=TrainCommand(spec_path=SEED),
                          run_dir=tmp_path)
    assert "source /shared/venvs/leantrain/bin/activate" in shared and sys.executable not in shared
    plain = load_spec(SEED, profile="rehearsal")  # host runtime, nothing named: never the submit host's venv
    with pytest.raises(UserInputError, match="cluster.slurm_venv"):
        slurm_script(plain, command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    dry = slurm_script(plain, command=TrainCommand(spec_path=SEED), run_dir=tmp_path, dry_run=True)
    assert ': "${LEANTRAIN_VENV:?' in dry and sys.executable not in dry
    with pytest.raises(UserInputError, match="cluster.image"):  # a container runtime needs the image
        slurm_script(load_spec(SEED, profile="rehearsal", overrides=["cluster.slurm_runtime=pyxis"]),
                     command=TrainCommand(spec_path=SEED), run_dir=tmp_path)


@pytest.mark.parametrize(("preset", "expected"), [
    ("infiniband", {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "PHB"}),
    ("roce", {"NCCL_IB_GID_INDEX": "3", "NCCL_IB_TC": "106"}),
    ("tcp", {"NCCL_IB_DISABLE": "1", "NCCL_NSOCKS_PERTHREAD": "4"}),
])
def test_nccl_fabric_preset_and_spec_overrides_are_exported(tmp_path: Path, preset: str,
                                                             expected: dict[str, str]) -> None:
    spec = load_spec(SEED, profile="rehearsal", overrides=[VENV,
        f"cluster.nccl_preset={preset}", "cluster.nccl_env={NCCL_IB_HCA: 'mlx5_0,mlx5_1', NCCL_DEBUG: WARN}"])
    text = slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    exported = dict(line.removeprefix("export ").split("=", 1) for line in text.splitlines()
                    if line.startswith("export NCCL_"))
    assert {k: v.strip("'") for k, v in exported.items()}.items() >= {**expected, "NCCL_DEBUG": "WARN"}.items()
    if preset != "tcp":
        assert exported["NCCL_IB_HCA"].strip("'") == "mlx5_0,mlx5_1"  # the spec's entry wins over the preset
    assert text.index("export NCCL_") < text.index("torchrun")
    assert "export NCCL_" not in slurm_script(load_spec(SEED, profile="rehearsal", overrides=[VENV]),
                                              command=TrainCommand(spec_path=SEED), run_dir=tmp_path)


def test_elastic_job_survives_a_node_loss_and_failures_requeue(tmp_path: Path) -> None:
    elastic = load_spec(SEED, profile="rehearsal", overrides=[VENV, "fault.min_nodes=3", "fault.max_nodes=4"])
    text = slurm_script(elastic, command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    assert "--no-kill" in sbatch_options(text)
    for words in srun_torchrun_lines(text):
        assert "--kill-on-bad-exit=1" not in words and {"--kill-on-bad-exit=0", "--no-kill"} <= set(words)
    fixed = slurm_script(load_spec(SEED, profile="rehearsal", overrides=[VENV, "fault.elasticity=false"]),
                         command=TrainCommand(spec_path=SEED), run_dir=tmp_path)
    assert "--no-kill" not in sbatch_options(fixed)
    assert all("--kill-on-bad-exit=1" in words for words in srun_torchrun_lines(fixed))
    assert all("--label" in words for words in srun_torchrun_lines(fixed))  # each line names its node's task
    assert '[ "$FAILED" -lt 3 ]' in text


@pytest.mark.parametrize(("failed_before", "requeued", "auto_restart"),
                         [("0", True, "true"), ("3", False, "true"), ("0", False, "false")])
def test_failed_training_requeues_until_max_requeues(tmp_path: Path, failed_before: str, requeued: bool,
                                                    auto_restart: str) -> None:
    """After a failure the job requeues itself up to cluster.max_requeues times; with fault.auto_restart: false
    never (it requeued anyway)."""
    spec = load_spec(SEED, profile="rehearsal", overrides=[env_hook(tmp_path), "cluster.preflight=false",
                                                          f"fault.auto_restart={auto_restart}"])
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "slurm-7.failure-requeues").write_text(f"{failed_before}\n")  # failure requeues so far
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$1" = show ]; then echo n1; else echo "scontrol $*" >> {log}; fi\n')
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\necho "srun $*" >> {log}\ncase "$*" in *leantrain.cli*) exit 1;; esac\n')
    (bin_dir / "python").write_text("#!/bin/bash\nexit 0\n")  # the health file reader: no host to exclude
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n1", "SLURM_RESTART_COUNT": failed_before}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("scontrol requeue 7" in log.read_text()) is requeued


def test_demo_stage_writes_both_job_files(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from leantrain.launch.command import demo_stage

    summary = demo_stage(SimpleNamespace(out_dir=tmp_path))
    sbatch, manifests = tmp_path / "jobs" / "seed-10b.sbatch", tmp_path / "jobs" / "seed-10b.k8s.yaml"
    assert str(sbatch) in summary and str(manifests) in summary
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    assert "kind: PyTorchJob" in manifests.read_text()


def test_emitted_job_runs_the_spec_frozen_in_the_run_dir(tmp_path: Path) -> None:
    """The script carries the frozen spec and writes it into the run dir when the job starts (owner-only); the
    submit host gets the job file only."""
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    assert main(["launch", str(SEED), "--profile", "rehearsal", "--set", "training.lr=2e-4", "--set",
                 env_hook(tmp_path), "--set", "cluster.preflight=false", "--emit", "slurm", "--out", str(out),
                 "--run-dir", str(run_dir)]) == 0
    assert not run_dir.exists()
    text = out.read_text()
    (train,) = srun_torchrun_lines(text)
    frozen = run_dir / "job-spec.yaml"
    assert torchrun_parsed(train).training_script_args[:2] == ["train", str(frozen.resolve())]
    assert "--profile" not in train and "--set" not in train and str(SEED) not in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nif [ \"$1\" = show ]; then echo n1; fi\n")
    (bin_dir / "srun").write_text("#!/bin/bash\nexit 0\n")  # the allocation's steps: done at once
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1"}
    done = subprocess.run(["bash", str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert frozen.stat().st_mode & 0o077 == 0 and (run_dir / "slurm-9.out").is_file()
    spec = load_spec(frozen)  # the same job: profile and override applied, secrets still references
    assert spec.hardware.num_nodes == 4 and spec.training.lr == 2e-4
    assert "${AWS_SECRET_ACCESS_KEY}" in frozen.read_text()


def test_slurm_script_passes_bash_n_and_shellcheck(tmp_path: Path) -> None:
    """Every runtime's script parses (bash -n); shellcheck, where installed, finds no error or warning."""
    import shutil

    scripts = []
    for runtime in (["cluster.slurm_runtime=pyxis", IMAGE], ["cluster.slurm_runtime=apptainer", IMAGE], [VENV],
                    [VENV, "cluster.data_url=s3://bucket/data", "cluster.nccl_preset=efa"]):
        spec = load_spec(SEED, profile="rehearsal", overrides=runtime)
        path = tmp_path / f"job-{len(scripts)}.sbatch"
        path.write_text(slurm_script(spec, command=TrainCommand(spec_path=tmp_path / "run" / "job-spec.yaml"),
                                     run_dir=tmp_path / "run", job_spec="task: pretrain\n"))
        subprocess.run(["bash", "-n", str(path)], check=True)
        if "cluster.nccl_preset=efa" in runtime:  # EFA: NCCL through the aws-ofi-nccl plugin, never TCP silently
            text = path.read_text()
            assert "export FI_PROVIDER=efa" in text and "export NCCL_NET='AWS Libfabric'" in text
        scripts.append(str(path))
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); bash -n passed")
    done = subprocess.run(["shellcheck", "--severity=warning", "--shell=bash", *scripts], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout


def test_an_elastic_range_is_checked_at_every_node_count_and_emit_refuses_a_layout_that_cannot_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun may re-form an elastic job at any node count from MIN to MAX. Only the two ends were checked, and
    `--emit` checked none: a job file whose ranks fail at start (after the queue) was written."""
    from leantrain.launch import torchrun

    # 8 micro-batches of 4 × 128 tokens per step: 2, 4 and 8 data-parallel ranks divide them, 6 do not.
    spec = load_spec(TINY, overrides=["training.global_batch_tokens=4096"])
    with pytest.raises(UserInputError, match=r"at 6 ranks.*1\.\.4.*runs at 1, 2, 4 node\(s\): set fault\.min_nodes "
                                             r"\(or --nnodes MIN\) to 4"):
        torchrun.check_layout(spec, nproc=2, min_nodes=1, max_nodes=4)
    assert [d.dp for d in torchrun.check_layout(spec, nproc=2, min_nodes=1, max_nodes=2)] == [2, 4]
    out = tmp_path / "job.sbatch"
    base = ["launch", str(TINY), "--set", VENV, "--emit", "slurm", "--out", str(out)]
    for args in (["--set", "training.global_batch_tokens=4096", "--nnodes", "1:4", "--nproc", "2"],
                 ["--nnodes", "3", "--nproc", "5"]):  # the spec's dp 2 stretched to 15 ranks
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert "training.global_batch_tokens" in err and "Traceback" not in err
        assert not out.exists()
    assert main([*base, "--set", "training.global_batch_tokens=4096", "--nnodes", "1:2", "--nproc", "2"]) == 0
    assert "#SBATCH --nodes=1-2" in out.read_text()


def test_an_elastic_floor_above_the_jobs_count_is_left_to_check_layout_and_lost_elasticity_is_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """seed-10b with 8 nodes and fault.max_nodes 16 runs only at 8 and 16 nodes: the derived floor (16) was above
    the job's 8 and the error named 'fault.min_nodes..max_nodes = 16..16', which the user never set. And sized from
    the plan with fault.elasticity on, a job that cannot shrink was written as a fixed one without a word."""
    out = tmp_path / "job.sbatch"
    base = ["launch", str(SEED), "--set", VENV, "--emit", "slurm", "--dry-run", "--out", str(out)]
    assert main([*base, "--set", "hardware.num_nodes=8", "--set", "fault.max_nodes=16"]) == 2
    err = capsys.readouterr().err
    assert "re-form at any node count in 8..16" in err and "runs at 8, 16 node(s)" in err and "16..16" not in err
    assert main(base) == 0
    assert "note: fault.elasticity is on, but the job is not elastic" in capsys.readouterr().out.replace("\n", " ")


def _run_with_fake_slurm(tmp_path: Path, script: Path, *, train: str = "exit 0", **env: str) -> tuple[int, str]:
    """Run a job file against fake `scontrol` (one node; records updates and requeues) and `srun` (records its
    words, shell-quoted, and the APPTAINERENV_ variables it got; the train step runs `train`). Returns (exit code,
    the log)."""
    bin_dir, log = tmp_path / "fake-bin", tmp_path / "fake-slurm.log"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$1" = show ]; then echo n1; else echo "scontrol $*" >> {log}; fi\n')
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\n(printf srun; printf " %q" "$@"; echo) >> {log}\n'
        f'(env | grep ^APPTAINERENV_ | sort) >> {log} || true\n'
        f'case "$*" in *leantrain.cli*) {train};; esac\n')
    (bin_dir / "python").write_text("#!/bin/bash\nexit 0\n")  # the health file reader: no host to exclude
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
                "SLURM_JOB_NODELIST": "n1", **env}
    proc = subprocess.run(["bash", str(script)], env=full_env, capture_output=True, text=True, timeout=60)
    return proc.returncode, (log.read_text() if log.exists() else "") + proc.stdout + proc.stderr


def test_apptainer_passes_the_specs_secret_variables_by_name(tmp_path: Path) -> None:
    """`--cleanenv` dropped every variable the spec references (`${AWS_ACCESS_KEY_ID}`, the webhook's, ...): the
    ranks and the staging step got none. They are passed by name; no value is written into the file."""
    out = tmp_path / "job.sbatch"
    assert main(["launch", str(SEED), "--profile", "rehearsal", "--set", "cluster.slurm_runtime=apptainer",
                 "--set", IMAGE, "--set", "cluster.preflight=false", "--set", "cluster.data_url=s3://bucket/data",
                 "--set", "monitoring.webhook_url_env=ALERT_URL", "--emit", "slurm", "--out", str(out),
                 "--run-dir", str(tmp_path / "run")]) == 0
    secrets = {"AWS_ACCESS_KEY_ID": "AKIA-test-id", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
               "ALERT_URL": "https://hooks.example/x"}
    code, log = _run_with_fake_slurm(tmp_path, out, **secrets)
    assert code == 0, log
    text = out.read_text()
    for name, value in secrets.items():
        assert value not in text and name in text
        assert f"APPTAINERENV_{name}={value}" in log  # every srun step (staging, training) gets it
    assert "APPTAINERENV_AWS_SESSION_TOKEN" not in log  # unset in the job: not passed as an empty value
    stage = next(line for line in log.splitlines() if "leantrain.launch.staging" in line)
    assert "--cleanenv" in stage


def test_a_dollar_or_quote_in_a_path_or_value_is_written_literally(tmp_path: Path) -> None:
    """Values with `$` went into double quotes: `--run-dir '/shared/my runs/l8$x'` became RUN_DIR="…/l8$x", which
    bash expanded. Literal values are single-quoted; only the script's own variables ($HEAD_NODE, …) expand."""
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "my runs" / "l8$x it's"
    assert main(["launch", str(SEED), "--profile", "rehearsal", "--set", env_hook(tmp_path), "--set",
                 "cluster.preflight=false", "--set", "cluster.nccl_env={NCCL_SOCKET_IFNAME: '$eth0'}",
                 "--emit", "slurm", "--out", str(out), "--run-dir", str(run_dir)]) == 0
    code, log = _run_with_fake_slurm(tmp_path, out, x="EXPANDED", eth0="EXPANDED",
                                     train='echo "IF=$NCCL_SOCKET_IFNAME"')
    assert code == 0, log
    assert (run_dir / "slurm-7.out").is_file() and (run_dir / "job-spec.yaml").is_file()
    assert "EXPANDED" not in log and "IF=$eth0" in log
    (train,) = [shlex.split(line) for line in log.splitlines() if line.startswith("srun") and "leantrain.cli" in line]
    assert train[train.index("--run-dir") + 1] == str(run_dir.resolve())
    assert "--rdzv-endpoint=n1:29500" in train and "--rdzv-id=7" in train  # the script's own variables expand


def test_auto_restart_off_gives_torchrun_no_restarts(tmp_path: Path) -> None:
    """`fault.auto_restart: false` was ignored: the job file still gave torchrun `--max-restarts=fault.max_restarts`.
    It is 0 then, as for a local launch (torchrun.restarts); an explicit --max-restarts still wins."""
    off = load_spec(SEED, profile="rehearsal", overrides=[VENV, "fault.auto_restart=false", "fault.max_restarts=10"])
    for restarts, expected in ((None, 0), (2, 2)):
        text = slurm_script(off, command=TrainCommand(spec_path=SEED), run_dir=tmp_path, max_restarts=restarts)
        preflight, train = srun_torchrun_lines(text)
        assert torchrun_parsed(train).max_restarts == expected and torchrun_parsed(preflight).max_restarts == 0
    on = load_spec(SEED, profile="rehearsal", overrides=[VENV, "fault.max_restarts=10"])
    (_, train) = srun_torchrun_lines(slurm_script(on, command=TrainCommand(spec_path=SEED), run_dir=tmp_path))
    assert torchrun_parsed(train).max_restarts == 10


def test_time_limit_requeues_do_not_use_up_the_failure_requeue_budget(tmp_path: Path) -> None:
    """SLURM_RESTART_COUNT counts every requeue, the script's own checkpoint-then-requeue at the time limit too:
    after max_requeues time limits no crash was requeued. Failure requeues are counted on their own, in the run
    dir; the time-limit path (USR1, here sent by the fake train step) does not count."""
    run_dir = tmp_path / "run"
    spec = load_spec(SEED, profile="rehearsal", overrides=[env_hook(tmp_path), "cluster.preflight=false"])
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=run_dir))
    request = f'"$RUN_DIR/{CHECKPOINT_REQUEST_NAME}"'
    time_limit = f"kill -USR1 $PPID; while [ ! -e {request} ]; do sleep 0.1; done; rm -f {request}; exit 0"
    env = {"RUN_DIR": str(run_dir), "SLURM_RESTART_COUNT": "5"}  # five time-limit requeues so far
    code, log = _run_with_fake_slurm(tmp_path, script, train=time_limit, **env)
    assert code == 0 and log.count("scontrol requeue 7") == 1, log
    assert not (run_dir / "slurm-7.failure-requeues").exists()
    for attempt in range(1, 5):  # crashes: requeued max_requeues (3) times, whatever SLURM_RESTART_COUNT says
        (tmp_path / "fake-slurm.log").unlink()
        code, log = _run_with_fake_slurm(tmp_path, script, train="exit 1", **env)
        assert code == 1 and ("scontrol requeue 7" in log) is (attempt <= 3), log
        assert (run_dir / "slurm-7.failure-requeues").read_text().strip() == str(min(attempt, 3))


def test_a_job_its_ranks_refuse_ends_with_exit_2_and_no_requeue(tmp_path: Path) -> None:
    """A rank that refuses the job's input writes why to LEANTRAIN_REFUSAL_FILE (errors.record_refusal), a file of
    this allocation in the run dir: the script then exits 2 with the reason and does not requeue, where another
    allocation would only refuse again (each requeue a full start of every node). A crash still requeues."""
    run_dir = tmp_path / "run"
    spec = load_spec(SEED, profile="rehearsal", overrides=[env_hook(tmp_path), "cluster.preflight=false"])
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=run_dir))
    refuse = ('python3 -c "import json, os; open(os.environ[\'LEANTRAIN_REFUSAL_FILE\'], \'w\').write('
              'json.dumps({\'message\': \'data.dir has no manifest.json\', \'rank\': \'0\'}))"; exit 1')
    code, log = _run_with_fake_slurm(tmp_path, script, train=refuse, SLURM_RESTART_COUNT="2")
    assert code == 2, log
    assert "the ranks refused the job (not requeued" in log and "data.dir has no manifest.json" in log
    assert "scontrol requeue" not in log and (run_dir / "refused-7-2.json").exists()
    (tmp_path / "fake-slurm.log").unlink()
    code, log = _run_with_fake_slurm(tmp_path, script, train="exit 1", SLURM_RESTART_COUNT="3")  # a new allocation
    assert code == 1 and "scontrol requeue 7" in log, log


FAKE_TORCHRUN = r'''#!/bin/bash
# torchrun as a node's agent ends when its rank fails: the rank's log under --log-dir, the failure summary
for arg in "$@"; do case "$arg" in --log-dir=*) LOG_DIR="${arg#--log-dir=}";; esac; done
mkdir -p "$LOG_DIR/7_x/attempt_0/0" && printf '%s\n' "$STUB_RANK_LOG" > "$LOG_DIR/7_x/attempt_0/0/stderr.log"
printf '%s\n' "Traceback (most recent call last):" '  File "run.py", line 1' \
  "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: " "=====" \
  "Root Cause (first observed failure):" "[0]:" "  host      : n1" "  rank      : 3 (local_rank: 0)" \
  "  exitcode  : $STUB_EXIT (pid: 11)" "====="
exit 1
'''


@pytest.mark.parametrize(("rank_exit", "rank_log", "crashed"), [
    ("-9", "step 3", True),  # an OOM kill on this node
    ("1", "[rank3]: RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.9]:4301. This is typically "
          "caused by a remote worker crashing.", False),  # another node's rank died
])
def test_a_node_whose_rank_failed_of_its_own_is_recorded_and_the_requeue_excludes_it(
        tmp_path: Path, rank_exit: str, rank_log: str, crashed: bool) -> None:
    """The training step runs torchrun under launch.node_run on every node: a node whose rank failed of its own
    gets a crash in node_health.json (`cluster.unhealthy_after_crashes`, 2, exclude it: the second failure's
    requeue passes it to ExcNodeList); one whose rank only saw another node's rank fail gets none. Until
    2026-12-07 no crash inside a Slurm job was recorded. Real bash, node_run and health reader; fake srun (runs
    its command on this machine), scontrol and torchrun."""
    run_dir, bin_dir, log = tmp_path / "run", tmp_path / "bin", tmp_path / "calls.log"
    hook = tmp_path / "env.sh"  # this interpreter's leantrain, the fakes first
    venv_bin = shlex.quote(str(Path(sys.executable).parent))
    hook.write_text(f'export PATH={shlex.quote(str(bin_dir))}:{venv_bin}:"$PATH"\n')
    spec = load_spec(SEED, profile="rehearsal", overrides=[f"cluster.env_hook={hook}", "cluster.preflight=false"])
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(spec, command=TrainCommand(spec_path=SEED), run_dir=run_dir))
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$1" = show ]; then echo n1; else echo "scontrol $*" >> {log}; fi\n')
    # srun: drop its own options, run the step here
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
           "LEANTRAIN_NODE_NAME": "n1", "STUB_EXIT": rank_exit, "STUB_RANK_LOG": rank_log}
    for failure in (1, 2):
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in out, out
        calls = log.read_text()
        assert calls.count("scontrol requeue 7") == failure, calls
        health = json.loads((run_dir / "node_health.json").read_text()) if crashed else {"hosts": {}}
        assert (run_dir / "node_health.json").exists() is crashed
        if crashed:
            assert health["hosts"]["n1"]["crashes"] == failure and health["hosts"]["n1"]["ranks"] == [3]
            assert "n1 crashed: rank 3 (local rank 0) failed of its own: exit code -9" in out, out
        else:
            assert "not counted against n1: rank 3 (local rank 0) failed because a peer did" in out, out
        assert ("ExcNodeList=n1" in calls) is (crashed and failure == 2), calls
    assert (run_dir / "logs" / socket.gethostname() / "7_x" / "attempt_0" / "0" / "stderr.log").is_file()


def test_slurms_sigterm_reaches_torchrun_once_and_node_run_waits_for_it(tmp_path: Path) -> None:
    """Slurm signals the step's processes (scancel, preemption): torchrun runs in node_run's process group, so it
    gets SIGTERM once (its agent passes it on to the ranks, which checkpoint), and node_run waits for it, whatever
    that takes, and exits with its code."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "got-term"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\ntrap \'echo term >> {seen}; sleep 2; echo "$@" >> {seen}; '
                                      'exit 7\' TERM\necho started\nwhile :; do sleep 0.1; done\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "leantrain.launch.node_run", str(tmp_path / "run"), "--",
                             "torchrun", "-m", "leantrain.cli", "train"], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # as srun's task: its own process group
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    os.killpg(proc.pid, signal.SIGTERM)  # what Slurm does to the step
    assert proc.wait(timeout=60) == 7
    lines = seen.read_text().splitlines()
    assert lines[0] == "term" and len(lines) == 2, lines  # once
    words = lines[1].split()
    assert words[0].startswith("--log-dir=") and words[1:4] == ["--redirects=3", "--tee=3", "--local-ranks-filter=0"]
    assert words[-3:] == ["-m", "leantrain.cli", "train"]
