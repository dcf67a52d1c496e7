"""The hang watchdog (ckpt/watchdog.py): fires once after hang_timeout_s without a step, not during saves,
records the hang, and is only armed under an elastic agent."""

from __future__ import annotations

import json
from pathlib import Path

from leantrain.ckpt.watchdog import HangWatchdog, read_hangs, under_elastic_agent


def test_fires_once_after_the_timeout_without_a_step_and_records_it(tmp_path: Path) -> None:
    now = [0.0]
    fired: list[int] = []
    dog = HangWatchdog(timeout_s=20.0, run_dir=tmp_path, rank=1, attempt=0, on_hang=lambda: fired.append(1),
                       clock=lambda: now[0])
    now[0] = 100.0
    assert not dog.check()  # not armed before the first step (start-up, compilation, the resume)
    dog.tick(3)
    now[0] = 119.0
    assert not dog.check()
    with dog.paused():  # a checkpoint save is progress, however long it takes
        now[0] = 500.0
        assert not dog.check()
    now[0] = 519.0
    assert not dog.check()
    now[0] = 520.5
    assert dog.check() and fired == [1]
    now[0] = 900.0
    assert not dog.check() and fired == [1]  # once
    # Rank 1 writes only its own record; events.jsonl has one writer, rank 0.
    assert not (tmp_path / "events.jsonl").exists()
    (hang,) = read_hangs(tmp_path)
    assert hang["rank"] == 1 and hang["last_step"] == 3 and hang["idle_s"] >= 20.0 and hang["attempt"] == 0
    assert (tmp_path / "hang" / "rank-1-attempt-0.json").is_file() and read_hangs(tmp_path, attempt=1) == []
    zero = HangWatchdog(timeout_s=20.0, run_dir=tmp_path, rank=0, attempt=0, on_hang=lambda: None,
                        clock=lambda: now[0])
    zero.tick(3)
    now[0] = 1000.0
    assert zero.check()
    event = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert event["kind"] == "hang_abort" and event["rank"] == 0 and event["last_step"] == 3
    assert [h["rank"] for h in read_hangs(tmp_path, attempt=0)] == [0, 1]


def test_armed_only_under_an_elastic_agent() -> None:
    assert not under_elastic_agent({})
    assert under_elastic_agent({"TORCHELASTIC_RUN_ID": "x"})
    assert under_elastic_agent({"TORCHELASTIC_RESTART_COUNT": "0"})


def test_shipped_defaults_find_a_frozen_rank_before_the_collective_timeout_and_within_two_minutes() -> None:
    import pytest

    from leantrain.ckpt.watchdog import POLL_MAX_S
    from leantrain.errors import SpecError
    from leantrain.spec import spec_from_dict
    from leantrain.spec.rules import HANG_POLL_MAX_S

    raw = {"model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "vocab_size": 64},
           "data": {"tokens_total": 1e4, "seq_len": 8}, "training": {"global_batch_tokens": 8}}
    spec = spec_from_dict(raw)
    hang_s, collective_s = spec.monitoring.hang_timeout_s, spec.fault.collective_timeout_s
    assert HANG_POLL_MAX_S == POLL_MAX_S
    assert spec.fault.hang_action == "abort" and spec.fault.auto_restart
    assert hang_s + POLL_MAX_S < collective_s  # the watchdog fires (and labels the hang) first
    assert hang_s + POLL_MAX_S < 120  # detected within 2 minutes of the last finished step
    # Training again within 5 minutes: detection, torchrun's 30 s SIGTERM grace before it SIGKILLs the stopped
    # rank, and a restart budget of two minutes for start-up, rendezvous and the resume.
    assert hang_s + POLL_MAX_S + 30 + 120 < 300
    with pytest.raises(SpecError, match=r"monitoring.hang_timeout_s \(600 s\) must be at least 2 s shorter"):
        spec_from_dict({**raw, "monitoring": {"hang_timeout_s": 600}})
    relaxed = spec_from_dict({**raw, "monitoring": {"hang_timeout_s": 600}, "fault": {"hang_action": "alert"}})
    assert relaxed.monitoring.hang_timeout_s == 600


def test_a_hand_edited_rank_record_takes_its_rank_and_attempt_from_its_name(tmp_path: Path) -> None:
    """`{"attempt": null}` (or no rank) in RUN_DIR/hang/rank-R-attempt-A.json raised a TypeError in validate and
    doctor; the file name, which the writer chose, says whose record it is and from which attempt."""
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "rank-3-attempt-1.json").write_text('{"attempt": null, "idle_s": "long"}')
    (tmp_path / "hang" / "rank-0-attempt-1.json").write_text('{"rank": "x"}')
    records = read_hangs(tmp_path, attempt=1)
    assert [(r["rank"], r["attempt"]) for r in records] == [(0, 1), (3, 1)]
