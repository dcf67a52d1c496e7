"""The job's attempt (ckpt/attempt.py): agreed once per start, numbered in order within one torchrun job, a
membership change (no rank's count rose) told from a worker failure, and passed to the hook, which records
the restart with its cause and does not agree again."""

from __future__ import annotations

from pathlib import Path

import pytest

import leantrain.ckpt.attempt as attempt_mod
from leantrain.ckpt.attempt import JobAttempt, agree_job_attempt
from leantrain.ckpt.hook import TrainerCheckpointer
from test_ckpt_hook import make_trainer, step
from test_ckpt_manager import events, make_spec


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A torchrun worker of job `job-9` whose agent is pid 4242; notes go to tmp_path."""
    notes = tmp_path / "notes"
    monkeypatch.setattr(attempt_mod, "notes_dir", lambda: notes)
    monkeypatch.setattr(attempt_mod.os, "getppid", lambda: 4242)
    monkeypatch.setattr(attempt_mod, "_process_start", lambda pid: "777")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-9")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    return notes


def test_without_torchrun_the_attempt_is_the_count_and_nothing_is_noted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attempt_mod, "notes_dir", lambda: tmp_path / "notes")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert agree_job_attempt() == agree_job_attempt() == JobAttempt(0, membership_change=False)
    assert not (tmp_path / "notes").exists()


def test_one_jobs_starts_are_numbered_in_order_and_a_membership_change_is_told_apart(
    agent: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert agree_job_attempt() == JobAttempt(0)  # first start
    assert agree_job_attempt() == JobAttempt(1, membership_change=True)  # same agent, count still 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a worker failed
    assert agree_job_attempt() == JobAttempt(2, membership_change=False)
    assert agree_job_attempt() == JobAttempt(3, membership_change=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "5")
    assert agree_job_attempt() == JobAttempt(5, membership_change=False)


def test_another_agent_or_job_starts_afresh(agent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agree_job_attempt()
    monkeypatch.setattr(attempt_mod, "_process_start", lambda pid: "778")  # a later torchrun, pid recycled
    assert agree_job_attempt() == JobAttempt(0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-10")
    assert agree_job_attempt() == JobAttempt(0)


def test_the_ranks_agree_and_only_local_rank_0_notes(agent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that joined (no note) and one that did not (its note): both see the membership change; a failure
    counted on a third node's agent makes it a worker failure on every rank."""
    agree_job_attempt()  # the old node's first start
    joined = [0, attempt_mod.NONE, attempt_mod.NONE]

    def with_joined(values: list[int]) -> list[int]:
        return [max(a, b) for a, b in zip(values, joined, strict=True)]

    monkeypatch.setenv("LOCAL_RANK", "1")  # not the note's writer: the note stays as the first start left it
    assert agree_job_attempt(with_joined) == JobAttempt(1, membership_change=True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    joined[0] = 1
    assert agree_job_attempt(with_joined) == JobAttempt(1, membership_change=False)


def test_a_garbled_note_is_no_earlier_start_and_exited_agents_notes_go(agent: Path) -> None:
    agent.mkdir()
    (agent / "job-9-4242-777.json").write_text("{")
    gone = agent / "job-9-999999999-1.json"
    gone.write_text('{"attempt": 3, "count": 3}')
    assert agree_job_attempt() == JobAttempt(0)
    assert not gone.exists()
    assert agree_job_attempt() == JobAttempt(1, membership_change=True)


def test_the_hook_takes_the_agreed_attempt_and_records_the_restart_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given the job's attempt, the hook agrees on nothing itself; a membership change resumes the run's own
    newest checkpoint (not `--resume none`'s refusal) and is labelled as such in the restart event."""
    from leantrain.ckpt.manager import CheckpointManager
    from leantrain.ckpt.resume import ResumeRequest

    run_dir = tmp_path / "run"
    spec = make_spec(checkpoint={"interval_steps": 2})
    first = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(first, attempt=JobAttempt(0))
    hook.load_latest(first)
    for _ in range(2):
        step(first, hook)
    hook.close()

    def no_agreement(self: CheckpointManager, values: list[int]) -> list[int]:
        raise AssertionError("the hook agreed on the attempt again")

    monkeypatch.setattr(CheckpointManager, "highest", no_agreement)
    again = make_trainer(spec, run_dir)
    hook = TrainerCheckpointer(again, resume=ResumeRequest(mode="none"), attempt=JobAttempt(1, membership_change=True))
    try:
        assert hook.attempt == 1 and hook.load_latest(again) and again.step == 2
    finally:
        hook.close()
    restarts = [e for e in events(run_dir) if e["event"] == "restart"]
    assert [(e["attempt"], e["cause"], e["resumed_from"]) for e in restarts] == [(1, "membership change", 2)]


def test_train_warns_when_torchrun_shares_its_store_with_the_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun hands the workers its one store for every round:
    rank 0 says so (once per start, before the process group), since a restart can then time out connecting."""
    import leantrain.train.command as command
    import leantrain.train.runtime as runtime

    class Started(Exception):
        pass

    def init_runtime(spec: object) -> None:
        raise Started

    monkeypatch.setattr(runtime, "init_runtime", init_runtime)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for shared, warned in (("True", True), ("False", False)):
        caplog.clear()
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
        with caplog.at_level("WARNING", logger="leantrain.train"), pytest.raises(Started):
            command.job_attempt(make_spec())
        assert any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage() for r in caplog.records) == warned
