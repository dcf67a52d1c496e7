"""The accelerator catalog."""

from __future__ import annotations

import pytest

from leantrain.errors import UserInputError
from leantrain.hardware import CATALOG, get_accelerator, measure_cpu_peak_flops

REQUIRED = ["A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H800", "H200", "B200", "MI300X", "L40S", "cpu"]


def test_catalog_has_the_required_parts() -> None:
    assert set(REQUIRED) <= set(CATALOG)


@pytest.mark.parametrize("name", REQUIRED)
def test_entries_are_plausible(name: str) -> None:
    acc = CATALOG[name]
    assert acc.peak_flops["bf16"] >= acc.peak_flops["fp32"] / 4 > 0
    if "fp8" in acc.peak_flops:
        assert acc.peak_flops["fp8"] == pytest.approx(2 * acc.peak_flops["bf16"], rel=0.02)
    assert acc.memory_bytes > 1e9 and acc.memory_bandwidth_bytes_s > 1e9
    assert acc.intra_node_bandwidth_bytes_s >= acc.inter_node_bandwidth_bytes_s


def test_known_numbers_and_aliases() -> None:
    assert get_accelerator("h100").peak_for("bf16") == pytest.approx(989.5e12)
    assert get_accelerator("A100").name == "A100-80GB"
    assert get_accelerator("H100-SXM").peak_for("fp16") == get_accelerator("H100-SXM").peak_for("bf16")


def test_missing_dtype_and_unknown_name_are_user_errors() -> None:
    with pytest.raises(UserInputError, match="no fp8"):
        get_accelerator("A100-80GB").peak_for("fp8")
    with pytest.raises(UserInputError, match="unknown accelerator 'TPU'"):
        get_accelerator("TPU")


def test_cpu_peak_is_measured() -> None:
    assert measure_cpu_peak_flops(size=128, repeats=2) > 1e8


def test_the_cpu_peak_is_measured_with_real_matmuls_under_fake_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rehearsal's trainer asks for the host peak inside FakeTensorMode: the measurement must still time real
    matmuls (a fake one takes no time, and the cache would keep a peak thousands of times the host's)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from leantrain.hardware import measure_cpu_peak_flops

    kinds: list[bool] = []
    matmul = torch.matmul

    def recorded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        kinds.append(isinstance(a, FakeTensor))
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", recorded)
    with FakeTensorMode():
        measure_cpu_peak_flops(size=64, repeats=2)
    assert kinds and not any(kinds)  # every timed matmul was on real tensors


def _planted_cache(tmp_path, monkeypatch, entry, measured: float):
    """A cache dir (not the user's) holding `entry` for this host's fp32 key, and a measurement returning
    `measured`; returns the list of measurement calls."""
    import json

    from leantrain import hardware

    calls: list[str] = []

    def fake_measure(*, size: int, repeats: int, dtype: str) -> float:
        calls.append(dtype)
        return measured

    monkeypatch.setenv("LEANTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", fake_measure)
    (tmp_path / hardware.CPU_PEAK_CACHE_FILE).write_text(json.dumps({hardware.cpu_peak_key("fp32"): entry}))
    hardware.host_cpu_peak_flops.cache_clear()
    return calls


def test_a_low_cached_cpu_peak_heals(tmp_path, monkeypatch) -> None:
    """The bug seen twice: 25.9 GFLOP/s measured on a loaded machine and cached (the old bare-number format)
    stuck for good. Now the next processes measure again and the cache keeps the highest; once
    CPU_PEAK_SAMPLES measurements are in, the value is read, not measured."""
    from leantrain import hardware

    calls = _planted_cache(tmp_path, monkeypatch, 25.9e9, measured=120e9)
    try:
        assert hardware.host_cpu_peak_flops("fp32") == 120e9
        for _ in range(hardware.CPU_PEAK_SAMPLES + 2):  # new processes
            hardware.host_cpu_peak_flops.cache_clear()
            assert hardware.host_cpu_peak_flops("fp32") == 120e9
        assert len(calls) == hardware.CPU_PEAK_SAMPLES - 1  # the planted one counts as one measurement
    finally:
        hardware.host_cpu_peak_flops.cache_clear()


def test_a_lower_measurement_never_replaces_a_higher_peak(tmp_path, monkeypatch) -> None:
    from leantrain import hardware

    _planted_cache(tmp_path, monkeypatch, {"flops": 120e9, "samples": 1}, measured=25.9e9)
    try:
        assert hardware.host_cpu_peak_flops("fp32") == 120e9
    finally:
        hardware.host_cpu_peak_flops.cache_clear()


def test_a_settled_low_peak_heals_when_a_run_beats_it(tmp_path, monkeypatch) -> None:
    """A low value with all its samples taken (every one under load) is re-measured when a run shows it is
    too low (calibrate: faster than the plan at 100 % efficiency), and the planner then reads the new one."""
    from leantrain import hardware

    calls = _planted_cache(tmp_path, monkeypatch, {"flops": 25.9e9, "samples": 3}, measured=120e9)
    try:
        assert hardware.host_cpu_peak_flops("fp32") == 25.9e9 and calls == []
        assert hardware.remeasure_cpu_peak("fp32") == 120e9
        assert hardware.host_cpu_peak_flops("fp32") == 120e9 and calls == ["fp32"]
    finally:
        hardware.host_cpu_peak_flops.cache_clear()
