"""Two ranks under torchrun: SIGKILL + automatic restart resumes bit for bit; elastic resume 2 → 1 and 2 → 4.

One module fixture runs the product's fault drill (golive/drill.py) on a tiny job: a 2-rank reference run and a
2-rank run in which rank 1 is SIGKILLed after step 3 and torchrun (--max-restarts 1) restarts the workers.
The reference run's checkpoints (saved at world size 2) are then resumed at 1 and at 4 ranks.

Elastic tolerance: another world size changes the reduction order of the gradient average and the number of
micro-batches per rank, so losses are compared with a relative tolerance of ELASTIC_REL_TOL (seen: ~1e-7).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from rich.console import Console

from leantrain.ckpt.fault import FaultPlan
from leantrain.ckpt.hook import TrainerCheckpointer
from leantrain.ckpt.watchdog import read_hangs
from leantrain.data.sampler import PackedBatchSampler
from leantrain.golive.drill import run_drill
from leantrain.golive.validate import drill_check
from leantrain.launch.resources import TrainCommand
from leantrain.launch.torchrun import launch_local
from leantrain.observe.report_data import load_run
from leantrain.spec import JobSpec, load_spec
from leantrain.train.trainer import Trainer
from test_resume_exact import MAX_STEPS, logged_losses, write_resume_spec

ELASTIC_REL_TOL = 1e-4
KILL_AT = 3
SAMPLES_PER_STEP = 4  # global_batch_tokens / seq_len in write_resume_spec


@pytest.fixture(scope="module")
def drilled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("drill")
    spec_file = write_resume_spec(root)
    # A job's checkpoint.url holding a (planted) checkpoint: the drill must neither resume from it nor write it.
    job_ckpts = root / "job-checkpoints"
    (job_ckpts / "step-00000005").mkdir(parents=True)
    (job_ckpts / "step-00000005" / "COMMIT").write_text("the job's")
    overrides = [f"checkpoint.url={job_ckpts}"]
    spec = load_spec(spec_file)  # the other tests' spec: checkpoints in each run dir
    console = Console(file=io.StringIO(), width=160)
    result = run_drill(load_spec(spec_file, overrides=overrides), spec_path=spec_file, overrides=overrides,
                       profile=None, run_dir=root / "run",
                       kill_at=KILL_AT, during_save=False, corrupt_latest=False, console=console)
    return {"root": root, "spec_file": spec_file, "spec": spec, "result": result, "job_checkpoints": job_ckpts,
            "reference": Path(result["drill_dir"]) / "reference", "faulted": Path(result["drill_dir"]) / "faulted",
            "output": console.file.getvalue()}  # type: ignore[attr-defined]


def reference_losses(run_dir: Path) -> dict[int, float]:
    return {step: values[-1] for step, values in logged_losses(run_dir).items()}


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def resume_dir_from(drilled: dict[str, Any], name: str, *, step: int) -> Path:
    """A fresh run dir holding only the reference run's (2-rank) checkpoint of `step`."""
    folder = f"step-{step:08d}"
    run_dir = drilled["root"] / name
    shutil.copytree(drilled["reference"] / "checkpoints" / folder, run_dir / "checkpoints" / folder)
    return run_dir


@pytest.mark.slow
def test_sigkill_of_one_rank_restarts_and_resumes_bit_for_bit(drilled: dict[str, Any]) -> None:
    result = drilled["result"]
    assert result["passed"], (result, drilled["output"][-3000:])
    job = drilled["job_checkpoints"]  # with checkpoint.url set, the drill kept to its own locations
    assert sorted(p.name for p in job.rglob("*")) == ["COMMIT", "step-00000005"]
    assert (job / "step-00000005" / "COMMIT").read_text() == "the job's"
    assert (drilled["faulted"] / "checkpoints" / "step-00000002" / "COMMIT").is_file()
    reference = reference_losses(drilled["reference"])
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    logged = logged_losses(drilled["faulted"])
    assert logged[KILL_AT] == [reference[KILL_AT]] * 2  # logged before the kill, redone after the resume
    assert all(value == reference[step] for step, values in logged.items() for value in values)  # bitwise
    restarts = [e for e in events(drilled["faulted"]) if e["kind"] == "restart"]
    assert len(restarts) == 1
    restart = restarts[0]
    assert restart["attempt"] == 1 and restart["resumed_from"] == 2 and restart["planned"] is True
    assert 0 < restart["recovery_s"] < 120
    assert result["steps_lost"] == KILL_AT - 2 and result["max_loss_diff"] == 0.0 and result["num_kills"] == 1
    assert 0 < result["goodput"] < 1
    # validate reads drill.json from the run dir
    check = drill_check(load_run(drilled["root"] / "run"))
    assert check.status == "PASS", check


def consumed_by_two_ranks(spec: JobSpec, *, start: int) -> list[list[int]]:
    """The token rows two data-parallel ranks read in one global step from `start` (2 micro-steps each)."""
    rows = []
    samplers = [PackedBatchSampler(spec.data.dir, seq_len=spec.data.seq_len, micro_batch=1, dp_rank=r, dp_size=2,
                                   seed=spec.training.seed) for r in range(2)]
    for sampler in samplers:
        sampler.load_state_dict({"global_sample_index": start})
    for _ in range(2):
        for sampler in samplers:
            rows += sampler.next_batch().tokens.tolist()
    return rows


@pytest.mark.slow
def test_elastic_resume_two_ranks_to_one(drilled: dict[str, Any]) -> None:
    spec: JobSpec = drilled["spec"]
    run_dir = resume_dir_from(drilled, "elastic-1", step=2)
    trainer = Trainer(spec, run_dir=run_dir, checkpointer_factory=TrainerCheckpointer)
    assert trainer.step == 2 and trainer.sampler.global_sample_index == 2 * SAMPLES_PER_STEP
    consumed: dict[int, list[list[int]]] = {}
    next_batch = trainer.sampler.next_batch

    def recording_next_batch() -> Any:
        batch = next_batch()
        consumed.setdefault(trainer.step + 1, []).extend(batch.tokens.tolist())
        return batch

    trainer.sampler.next_batch = recording_next_batch  # type: ignore[method-assign]
    try:
        records = trainer.train()
    finally:
        trainer.close()
    assert trainer.sampler.global_sample_index == MAX_STEPS * SAMPLES_PER_STEP
    for step, rows in consumed.items():  # one rank reads exactly the samples two ranks read at that step
        assert sorted(rows) == sorted(consumed_by_two_ranks(spec, start=(step - 1) * SAMPLES_PER_STEP)), step
    reference = reference_losses(drilled["reference"])
    resumed = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(resumed) == list(range(3, MAX_STEPS + 1))
    assert resumed == pytest.approx({s: reference[s] for s in resumed}, rel=ELASTIC_REL_TOL)
    loaded = [e for e in events(run_dir) if e["kind"] == "checkpoint_loaded"]
    assert loaded[0]["saved_world_size"] == 2 and loaded[0]["world_size"] == 1


@pytest.mark.slow
def test_elastic_resume_two_ranks_to_four(drilled: dict[str, Any]) -> None:
    spec: JobSpec = drilled["spec"]
    run_dir = resume_dir_from(drilled, "elastic-4", step=2)
    code = launch_local(spec, train=TrainCommand(spec_path=drilled["spec_file"]), run_dir=run_dir, nproc=4,
                        nnodes=None, max_restarts=0, console=Console(file=io.StringIO()), timeout_s=300)
    assert code == 0
    reference = reference_losses(drilled["reference"])
    resumed = reference_losses(run_dir)
    assert sorted(resumed) == list(range(3, MAX_STEPS + 1))
    assert resumed == pytest.approx({s: reference[s] for s in resumed}, rel=ELASTIC_REL_TOL)
    loaded = [e for e in events(run_dir) if e["kind"] == "checkpoint_loaded"]
    assert (loaded[0]["step"], loaded[0]["saved_world_size"], loaded[0]["world_size"]) == (2, 2, 4)
    # The 4-rank run's last checkpoint continues the same global sample sequence and the same step counter.
    state: dict[str, Any] = {"sampler": {"global_sample_index": 0}, "train": {"step": 0, "tokens_seen": 0}}
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / f"step-{MAX_STEPS:08d}"), no_dist=True)
    assert state["sampler"]["global_sample_index"] == MAX_STEPS * SAMPLES_PER_STEP
    assert state["train"]["step"] == MAX_STEPS
    info = json.loads((run_dir / "train_info.json").read_text())
    assert info["world_size"] == 4 and info["accum_steps"] == 1
    assert np.isfinite(list(resumed.values())).all()


def _launch_with_fault(drilled: dict[str, Any], *, plan: FaultPlan, train: TrainCommand, run_dir: Path) -> int:
    """Two ranks under torchrun (one restart allowed) with the fault plan in their environment, restored after."""
    saved = {k: os.environ.get(k) for k in plan.to_env()}
    os.environ.update(plan.to_env())
    try:
        return launch_local(drilled["spec"], train=train, run_dir=run_dir, nproc=2, nnodes=None, max_restarts=1,
                            console=Console(file=io.StringIO()), timeout_s=600)
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch_two_hosts(drilled: dict[str, Any], *, plan: FaultPlan, run_dir: Path,
                      max_restarts: int = 1) -> tuple[list[int], list[str]]:
    """Two hosts emulated on this machine: two `leantrain launch --nnodes 2 --nproc 1` (one torchrun agent each,
    as on two nodes) meeting at a c10d rendezvous on 127.0.0.1, one rank per agent; returns both exit codes and
    both consoles. The agent that joins first hosts the rendezvous store, the other connects to it."""
    env = {**os.environ, **plan.to_env(), "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
           "LEANTRAIN_RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}"}
    argv = [sys.executable, "-m", "leantrain.cli", "launch", str(drilled["spec_file"]), "--nnodes", "2",
            "--nproc", "1", "--max-restarts", str(max_restarts), "--run-dir", str(run_dir)]
    return _run_agents(argv, env, [run_dir.parent / f"{run_dir.name}-agent-{i}.log" for i in range(2)])


def _run_agents(argv: list[str], env: dict[str, str], logs: list[Path], *,
                second_when: Callable[[], bool] | None = None) -> tuple[list[int], list[str]]:
    """Two torchrun agents running `argv` (their consoles in `logs`): the second starts right after the first, or
    once `second_when()` holds; returns both exit codes and both consoles."""
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(path.open("w")) for path in logs]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs.append(subprocess.Popen(argv, stdout=outs[0], stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            deadline = time.monotonic() + 300
            while second_when is not None and not second_when():
                assert procs[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
                time.sleep(0.1)
            procs.append(subprocess.Popen(argv, stdout=outs[1], stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            codes = [proc.wait(timeout=900) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return codes, [path.read_text() for path in logs]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize(("hosts", "frozen"), [(1, 1), (2, 1), (2, 0)],
                         ids=["one-host", "two-hosts", "two-hosts-rank0-frozen"])
def test_frozen_rank_aborts_the_group_restarts_it_and_loses_nothing(
    drilled: dict[str, Any], hosts: int, frozen: int
) -> None:
    """With the shipped defaults (monitoring.hang_timeout_s 90 s, fault.collective_timeout_s 120 s): a rank is
    SIGSTOPped after step 3 (a stuck GPU); the other rank's hang watchdog aborts before any collective times
    out, torchrun kills the frozen rank and restarts the group, which resumes from the step-2 checkpoint; the
    restart is labelled a hang naming the frozen rank, and the losses equal the uninterrupted run's.
    `two-hosts`: the same with each rank on its own torchrun agent (`--nnodes 2`), rank 1 frozen on node 1: the
    agent of the aborted rank restarts after the failure, the other when its peer rejoins the rendezvous (a
    membership change, which torchrun does not count as a restart). `two-hosts-rank0-frozen`: rank 0 frozen on
    node 0, so rank 0's agent is the one restarted by the membership change (its restart count stays 0): the
    ranks agree on the highest count, so the new rank 0 still records the restart as a hang."""
    run_dir = drilled["root"] / f"frozen-{hosts}-{frozen}"
    healthy = 1 - frozen
    plan = FaultPlan(kill_at_step=KILL_AT, kill_rank=frozen, freeze=True)
    spec = drilled["spec"]
    assert (spec.monitoring.hang_timeout_s, spec.fault.collective_timeout_s) == (90.0, 120.0)  # the defaults
    if hosts == 1:
        train = TrainCommand(spec_path=drilled["spec_file"])
        code = _launch_with_fault(drilled, plan=plan, train=train, run_dir=run_dir)
        assert code == 0
    else:
        codes, consoles = _launch_two_hosts(drilled, plan=plan, run_dir=run_dir)
        assert codes == [0, 0], [text[-3000:] for text in consoles]
        # Both agents restarted their workers (torchrun's INFO lines): the aborted rank's node after the
        # failure, the frozen rank's node when the other rejoined (it stopped the frozen rank, then the group
        # re-formed).
        failed = [i for i, text in enumerate(consoles) if "Worker group FAILED" in text]
        rejoined = [i for i, text in enumerate(consoles) if f"new nodes from group_rank={frozen}" in text]
        assert len(failed) == 1 and len(rejoined) == 1 and failed != rejoined, [t[-3000:] for t in consoles]
    kinds = events(run_dir)
    (hang,) = read_hangs(run_dir)  # one file per rank: only the healthy rank aborted
    assert hang["rank"] == healthy and hang["last_step"] == KILL_AT and hang["attempt"] == 0
    assert sorted(p.name for p in (run_dir / "hang").iterdir()) == [f"rank-{healthy}-attempt-0.json"]
    if healthy == 0:  # rank 0 is the one writer of events.jsonl
        assert [e["rank"] for e in kinds if e["kind"] == "hang_abort"] == [0]
    restart = [e for e in kinds if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["cause"] == "hang" and restart[0]["resumed_from"] == 2, restart
    assert restart[0]["attempt"] == 1
    assert restart[0]["hang_ranks"] == [healthy] and restart[0]["frozen_ranks"] == [frozen]
    # The targets with the shipped settings: detected within 2 minutes of the last step, training
    # again within 5 (detection, the agent's teardown of the stopped process, restart and resume).
    assert hang["idle_s"] < 120, hang
    assert restart[0]["recovery_s"] < 300, restart[0]
    print(f"frozen rank {frozen}, {hosts} host(s): detected after {hang['idle_s']:.1f} s, "
          f"training again after {restart[0]['recovery_s']:.1f} s")
    from leantrain.golive.doctor import watchdog_hang_findings
    from leantrain.golive.validate import health_checks
    from leantrain.observe.report_data import load_run

    run = load_run(run_dir)
    restarts = next(c for c in health_checks(run) if c.name == "no unexpected restarts")
    assert f"1 hang (ranks [{healthy}] aborted after step 3, suspect frozen: [{frozen}])" in restarts.evidence
    (finding,) = watchdog_hang_findings(run)
    assert f"ranks [{healthy}] saw no step" in finding.evidence and f"did not: [{frozen}]" in finding.evidence
    reference = reference_losses(drilled["reference"])
    assert {step: values[-1] for step, values in logged_losses(run_dir).items()} == reference


@pytest.mark.heavy
@pytest.mark.slow
def test_sigkill_on_node_1_of_two_hosts_restarts_both_and_resumes_bit_for_bit(drilled: dict[str, Any]) -> None:
    """Two emulated hosts (two `launch --nnodes 2` agents), rank 1 SIGKILLed on node 1 after step 3: whichever
    agent restarts by failure or by the membership change, the ranks agree on attempt 1, rank 0 records one
    restart from step 2 (cause `drill`: the fault marker names the kill), and the losses equal the uninterrupted
    run's."""
    run_dir = drilled["root"] / "killed-2"
    codes, consoles = _launch_two_hosts(drilled, plan=FaultPlan(kill_at_step=KILL_AT, kill_rank=1), run_dir=run_dir)
    assert codes == [0, 0], [text[-3000:] for text in consoles]
    restart = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["attempt"] == 1 and restart[0]["resumed_from"] == 2, restart
    assert restart[0]["cause"] == "drill" and restart[0]["planned"] is True  # the fault marker's kill
    assert restart[0]["recovery_s"] < 300, restart[0]
    print(f"SIGKILL on node 1 of 2 hosts: training again after {restart[0]['recovery_s']:.1f} s")
    assert not (run_dir / "hang").exists()
    reference = reference_losses(drilled["reference"])
    assert {step: values[-1] for step, values in logged_losses(run_dir).items()} == reference


@pytest.mark.heavy
@pytest.mark.slow
def test_a_rank_killed_on_one_of_two_hosts_is_that_hosts_crash_alone(drilled: dict[str, Any]) -> None:
    """Two emulated hosts, no restarts left: rank 1 is SIGKILLed after step 3, rank 0 fails in its next collective
    (gloo: "Connection closed by peer"), and both launches exit 1. Only the killed rank's launch records a crash
    (torchrun.host_fault); both hosts share this machine's name, so the health file shows one crash, rank 1's,
    where each launch used to record one."""
    from leantrain.launch.health import read_health

    run_dir = drilled["root"] / "killed-no-restart"
    codes, consoles = _launch_two_hosts(drilled, plan=FaultPlan(kill_at_step=KILL_AT, kill_rank=1), run_dir=run_dir,
                                        max_restarts=0)
    assert codes == [1, 1], [text[-3000:] for text in consoles]
    texts = [" ".join(text.split()) for text in consoles]
    host = read_health(run_dir).get(socket.gethostname())
    assert host is not None and host.crashes == 1 and host.ranks == [1], (host, [t[-2000:] for t in texts])
    assert sum("failed because a peer did" in text for text in texts) == 1, [t[-2000:] for t in texts]


@pytest.mark.slow
def test_memory_tier_resumes_a_lost_node_from_its_peer_copy(drilled: dict[str, Any], tmp_path: Path) -> None:
    """Fast tier every step, copy on the other rank: rank 1 is SIGKILLed after step 3 and its node's memory
    is lost with it; the restart resumes from step 3 (the durable tier has step 2) with rank 1's shard sent
    back by its peer, and the losses equal the uninterrupted reference run's."""
    run_dir = drilled["root"] / "memory-tier"
    plan = FaultPlan(kill_at_step=KILL_AT, kill_rank=1, lose_node=True)
    train = TrainCommand(spec_path=drilled["spec_file"], overrides=(
        "checkpoint.memory_interval_steps=1", "checkpoint.memory_peer_offset=1",
        f"checkpoint.memory_dir={tmp_path / 'shm'}"))
    code = _launch_with_fault(drilled, plan=plan, train=train, run_dir=run_dir)
    assert code == 0
    kinds = events(run_dir)
    loaded = [e for e in kinds if e["kind"] == "checkpoint_loaded"]
    restart = [e for e in kinds if e["kind"] == "restart"]
    assert loaded[-1]["tier"] == "memory" and loaded[-1]["step"] == KILL_AT and loaded[-1]["durable_step"] == 2
    assert restart[0]["resumed_from"] == KILL_AT
    assert {step: values[-1] for step, values in logged_losses(run_dir).items()} == reference_losses(
        drilled["reference"])
    assert not any((tmp_path / "shm").rglob("*.pt"))  # the finished run gave the memory back


@pytest.mark.slow
def test_fast_tier_beside_async_durable_saves_on_two_ranks(tmp_path: Path) -> None:
    """The fast tier every step with a peer copy, beside async durable saves every 2 steps, on 2 ranks: every
    rank takes the same decision on every step (the durable steps are no fast-tier steps, decided on the main
    thread, not from the save thread's last_saved_step), so the peers' exchanges always meet: the run ends (no
    deadlock), fast checkpoints at the odd steps, durable ones at the even steps, nothing failed."""
    spec_file = write_resume_spec(tmp_path, async_save=True)
    run_dir = tmp_path / "run"
    train = TrainCommand(spec_path=spec_file, overrides=(
        "checkpoint.memory_interval_steps=1", "checkpoint.memory_peer_offset=1",
        f"checkpoint.memory_dir={tmp_path / 'shm'}"))
    code = launch_local(load_spec(spec_file), train=train, run_dir=run_dir, nproc=2, nnodes=None, max_restarts=0,
                        console=Console(file=io.StringIO()), timeout_s=300)
    assert code == 0
    kinds = events(run_dir)
    assert [e["step"] for e in kinds if e["kind"] == "memory_checkpoint_saved"] == [1, 3, 5]
    assert all(e["peer"] == 1 for e in kinds if e["kind"] == "memory_checkpoint_saved")
    assert not [e for e in kinds if e["kind"] in ("memory_checkpoint_failed", "memory_tier_disabled")]
    assert [e["step"] for e in kinds if e["kind"] == "checkpoint_saved"] == [2, 4, 6]


def _last_logged_step(metrics: Path) -> int:
    """The newest step in a metrics file another process is writing (a line cut short is not read)."""
    steps = [0]
    with contextlib.suppress(OSError):
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                steps.append(int(json.loads(line).get("step", 0)))
    return max(steps)


MEMBERSHIP_STEPS = 400  # long enough (~10 s of steps) for the second node to join while the first trains


@pytest.mark.heavy
@pytest.mark.slow
def test_a_node_joining_is_a_membership_change_restart_that_resumes_at_the_larger_world(tmp_path: Path) -> None:
    """An elastic job (`--nnodes 1:2`) trains on one node; a second node's agent joins the rendezvous while it
    trains. No worker failed, so torchrun restarts the first node's workers without counting a restart
    (TORCHELASTIC_RESTART_COUNT stays 0 on both nodes): the ranks still agree on attempt 1 from the first
    agent's note (ckpt/attempt.py), the new rank 0 records one restart with `cause: membership change`, resumes
    the newest checkpoint at world size 2 and trains to the end; validate warns about it, never fails it."""
    spec_file = write_resume_spec(tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
           "LEANTRAIN_RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}"}
    argv = [sys.executable, "-m", "leantrain.cli", "launch", str(spec_file), "--nnodes", "1:2", "--nproc", "1",
            "--max-restarts", "1", "--run-dir", str(run_dir), "--set", f"training.max_steps={MEMBERSHIP_STEPS}"]
    metrics = run_dir / "metrics.jsonl"
    codes, texts = _run_agents(argv, env, [tmp_path / f"agent-{i}.log" for i in range(2)],
                               second_when=lambda: _last_logged_step(metrics) >= 4)  # once the first node trains
    assert codes == [0, 0], [text[-3000:] for text in texts]
    kinds = events(run_dir)
    restart = [e for e in kinds if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["cause"] == "membership change" and restart[0]["attempt"] == 1, restart
    assert restart[0]["planned"] is False and restart[0]["resumed_from"] >= 4, restart
    loaded = [e for e in kinds if e["kind"] == "checkpoint_loaded"]
    assert (loaded[-1]["saved_world_size"], loaded[-1]["world_size"]) == (1, 2), loaded
    assert json.loads((run_dir / "train_info.json").read_text())["world_size"] == 2
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(1, MEMBERSHIP_STEPS + 1))
    assert np.isfinite([values[-1] for values in losses.values()]).all()
    from leantrain.golive.validate import health_checks

    check = next(c for c in health_checks(load_run(run_dir)) if c.name == "no unexpected restarts")
    assert check.status == "WARN" and "1 membership change(s)" in check.evidence, check
    print(f"node joined after step {restart[0]['resumed_from']}: training again at world size 2 after "
          f"{restart[0]['recovery_s']:.1f} s")
