"""Metrics plumbing: the logger fans out to any sink, JSONL stays valid JSON, TensorBoard tags flatten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from leantrain.observe.metrics import MetricsLogger, build_metrics_logger, console_line, mfu
from leantrain.observe.sinks import Sink, numeric_leaves
from leantrain.train.trainer import moe_balance


class ListSink:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def test_logger_fans_out_to_extra_sinks_and_jsonl(tmp_path: Path) -> None:
    extra = ListSink()
    assert isinstance(extra, Sink)
    logger = build_metrics_logger(tmp_path, tensorboard=False, extra_sinks=[extra])
    logger.log({"step": 1, "loss": float("nan"), "loss_by_source": {"en": float("inf"), "zh": 2.0}})
    logger.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())  # strict JSON: no NaN literals
    assert line["loss"] is None and line["loss_by_source"] == {"en": None, "zh": 2.0}
    assert line["nonfinite"] == ["loss", "loss_by_source.en"]
    assert extra.records[0]["step"] == 1 and extra.closed


def test_other_ranks_log_nowhere(tmp_path: Path) -> None:
    logger = build_metrics_logger(tmp_path, tensorboard=True, enabled=False)
    assert isinstance(logger, MetricsLogger) and logger.sinks == []
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_tags_flatten_nested_records() -> None:
    record = {"step": 3, "loss": 1.5, "ok": True, "loss_by_source": {"en": 1.0}, "moe_expert_load": [[0.5, 0.5]]}
    assert dict(numeric_leaves(record)) == {
        "step": 3.0, "loss": 1.5, "loss_by_source/en": 1.0, "moe_expert_load/0/0": 0.5, "moe_expert_load/0/1": 0.5,
    }


def test_mfu_and_console_line() -> None:
    assert mfu(flops_per_token=6e9, tokens_per_s_per_device=1e4, peak_flops=1e15) == 6e13 / 1e15
    line = console_line({"step": 7, "loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 1234.0, "mfu": 0.25,
                         "step_time_s": 0.1, "mem_bytes": 2**30})
    assert "step      7" in line and "loss   2.5000" in line and "mfu 25.00%" in line


def test_moe_balance_summarises_the_worst_layer() -> None:
    counts = torch.tensor([[10.0, 10.0, 10.0, 10.0], [30.0, 10.0, 0.0, 0.0]])
    summary = moe_balance(counts, aux_loss=0.1, balance="aux_free")
    assert summary["moe_load_max_over_min"] == 30.0  # an idle expert counts as 1, not a division by zero
    assert summary["moe_expert_load"][1] == [0.75, 0.25, 0.0, 0.0]
    assert summary["moe_load_max_over_mean"] == 3.0 and "moe_aux_loss" not in summary


def test_window_time_excludes_eval_checkpoint_and_profiled_step() -> None:
    from leantrain.train.step_metrics import LogWindow, StepResult

    window = LogWindow(start_s=100.0)
    step = dict(loss=torch.tensor(1.0), grad_norm=torch.tensor(1.0), skipped=False, data_wait_s=0.0)
    for _ in range(3):
        window.add(StepResult(**step, comm_s=None, step_s=0.5))
    window.add(StepResult(**step, comm_s=0.2, step_s=2.0))  # the logged step, profiled: slow on purpose
    window.eval_s, window.ckpt_save_s = 30.0, 10.0
    timing = window.timing(now_s=100.0 + 1.5 + 2.0 + 30.0 + 10.0)
    assert timing["steps_timed"] == 3 and timing["step_time_s"] == 0.5
    assert (timing["eval_s"], timing["ckpt_save_s"], timing["profile_step_s"]) == (30.0, 10.0, 2.0)
    # A window that is only the profiled step: that step is the step time.
    single = LogWindow(start_s=0.0)
    single.add(StepResult(**step, comm_s=0.1, step_s=0.8))
    assert single.timing(now_s=0.8)["step_time_s"] == 0.8


def test_cpu_peak_is_measured_once_per_cpu_and_thread_count(tmp_path: Path, monkeypatch: Any) -> None:
    from leantrain import hardware

    calls: list[str] = []

    def fake_measure(*, size: int, repeats: int, dtype: str) -> float:
        calls.append(dtype)
        return 1e9 * (len(calls) + 1)

    monkeypatch.setenv("LEANTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", fake_measure)
    monkeypatch.setattr(hardware, "CPU_PEAK_SAMPLES", 1)  # the self-healing re-measurements: tests/test_hardware.py
    hardware.host_cpu_peak_flops.cache_clear()
    first = hardware.host_cpu_peak_flops("fp32")
    hardware.host_cpu_peak_flops.cache_clear()  # a new process reads the file, it does not measure again
    assert hardware.host_cpu_peak_flops("fp32") == first and calls == ["fp32"]
    cache = json.loads((tmp_path / hardware.CPU_PEAK_CACHE_FILE).read_text())
    assert list(cache) == [hardware.cpu_peak_key("fp32")] and hardware.cpu_model_name() in next(iter(cache))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count is another peak
        hardware.host_cpu_peak_flops.cache_clear()
        assert hardware.host_cpu_peak_flops("fp32") != first and len(calls) == 2
    finally:
        torch.set_num_threads(threads)
        hardware.host_cpu_peak_flops.cache_clear()


def test_the_records_train_returns_are_bounded_and_leave_the_per_rank_lists_out() -> None:
    """Every rank kept every logged record for train()'s return value, each with the world-size-long per-rank
    lists: at 16,384 ranks 256 KB a record, GBs per rank over a long run. The first record (the summary's start)
    and the newest are kept, without those lists; metrics.jsonl keeps everything."""
    from leantrain.train.step_metrics import KEPT_RECORDS, keep_record

    records: list[dict] = []
    world = 16_384
    for step in range(1, 3 * KEPT_RECORDS + 1):
        logged = {"step": step, "loss": 1.0 / step, "rank_step_time_s": [0.5] * world, "rank_mem_bytes": [1] * world}
        keep_record(records, logged)
        assert "rank_step_time_s" in logged  # what was logged is not changed
    assert len(records) == KEPT_RECORDS and records[0]["step"] == 1 and records[-1]["step"] == 3 * KEPT_RECORDS
    assert [r["step"] for r in records[1:]] == list(range(2 * KEPT_RECORDS + 2, 3 * KEPT_RECORDS + 1))
    assert not any("rank_step_time_s" in r or "rank_mem_bytes" in r for r in records)
