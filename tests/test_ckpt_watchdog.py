"""The hang watchdog (ckpt/watchdog.py): fires once after hang_timeout_s without a step, not during saves,
records the hang, and is only armed under an elastic agent."""

from __future__ import annotations

import json
from pathlib import Path

from leantrain.ckpt.watchdog import HANG_FILE, HangWatchdog, read_hang, under_elastic_agent


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
    event = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert event["kind"] == "hang_abort" and event["rank"] == 1 and event["last_step"] == 3
    assert event["idle_s"] >= 20.0
    hang = read_hang(tmp_path)
    assert hang is not None and hang["attempt"] == 0 and (tmp_path / HANG_FILE).is_file()


def test_armed_only_under_an_elastic_agent() -> None:
    assert not under_elastic_agent({})
    assert under_elastic_agent({"TORCHELASTIC_RUN_ID": "x"})
    assert under_elastic_agent({"TORCHELASTIC_RESTART_COUNT": "0"})
