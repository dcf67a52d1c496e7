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
