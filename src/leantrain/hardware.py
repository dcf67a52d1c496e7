"""Accelerator and interconnect catalog: peak dense FLOP/s by dtype, memory, and bandwidths.

All FLOP/s are dense (no 2:4 sparsity). Bandwidths are per GPU and per direction, in bytes/s, which is
what a ring collective's cost model needs (NVIDIA quotes NVLink as bidirectional: we halve it).
Memory is what the device reports to the framework: nvidia-smi's total in MiB for NVIDIA parts (so an
"80GB" H100 holds 81,559 MiB = 79.6 GiB) and rocm-smi's for AMD; the datasheet's GB figure is in the comment.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError

GB = 1e9
GiB = 2**30
MiB = 2**20
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model: compute peaks, memory and default links."""

    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s; a dtype the hardware lacks is absent
    memory_bytes: float
    memory_bandwidth_bytes_s: float
    intra_node_bandwidth_bytes_s: float  # GPU-to-GPU inside a node, one direction
    inter_node_bandwidth_bytes_s: float  # per GPU across nodes (its NIC share), one direction
    default_gpus_per_node: int = 8
    tdp_w: float | None = None  # the datasheet's maximum board power: the sustained matmul rate at that limit
    default_power_w: float | None = None  # the power limit the part ships with when below its TDP
    attention_flops: float | None = None  # FlashAttention-2 FLOP/s measured on the part (the kernel SDPA runs)
    # what torch.cuda.get_device_capability reports on the part (NVIDIA's compute capability; ROCm's gfx942 reads
    # (9, 4)): the rehearsal picks the kernels the trainer would pick there (model/moe.py). None: the host CPU.
    cuda_capability: tuple[int, int] | None = None
    notes: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)

    def peak_for(self, dtype: str) -> float:
        """Peak dense FLOP/s for a compute dtype; fp16 runs at the bf16 rate on every listed part."""
        key = "bf16" if dtype == "fp16" else dtype
        if key not in self.peak_flops:
            have = ", ".join(sorted(self.peak_flops))
            raise UserInputError(f"accelerator {self.name} has no {dtype} tensor-core rate (it has: {have})")
        return self.peak_flops[key]

    def supports(self, dtype: str) -> bool:
        return ("bf16" if dtype == "fp16" else dtype) in self.peak_flops


def _acc(name: str, *, fp32: float, tf32: float | None, bf16: float, fp8: float | None, **kw: object) -> Accelerator:
    peaks = {"fp32": fp32 * TFLOPS, "bf16": bf16 * TFLOPS}
    if tf32 is not None:
        peaks["tf32"] = tf32 * TFLOPS
    if fp8 is not None:
        peaks["fp8"] = fp8 * TFLOPS
    return Accelerator(name=name, peak_flops=peaks, **kw)  # type: ignore[arg-type]


CATALOG: dict[str, Accelerator] = {
    a.name: a
    for a in [
        # tdp_w (maximum board power, for hardware.power_w): A100 SXM 400 W, H100 SXM 700 W (technolynx.com "Power,
        # Thermals, and the Hidden Governors of Performance", 2026, citing NVIDIA's specifications; torchtitan's
        # H100 benchmark: "700W TDP"); H200 SXM 700 W and B200 1000 W (NVIDIA GPU table in public code, as the
        # datasheets give them). Parts without a TDP here refuse hardware.power_w.
        # attention_flops: FlashAttention-2 (what torch SDPA runs) measured by Azure's AI-benchmarking-guide
        # (Azure_Results/ND_{A100_v4,H100_v5,H200_v5}_results.md, "Flash Attention 2.0", batch 2, seq 8192):
        # A100 179.5 TFLOPS (head dim 64), H100 327.9, H200 329.3 (head dim 128): 58 % of A100's bf16 peak but
        # 33 % of Hopper's, which is why attention-heavy PyTorch runs fall short on Hopper. Parts without one
        # price attention at their GEMM rate.
        # NVIDIA A100 Tensor Core GPU datasheet (2021): FP32 19.5, TF32 156, BF16 312 TFLOPS dense;
        # 40GB HBM2 at 1,555 GB/s; NVLink3 600 GB/s bidirectional; HDR 200 Gb/s InfiniBand per GPU (DGX A100).
        _acc("A100-40GB", fp32=19.5, tf32=156, bf16=312, fp8=None, memory_bytes=40960 * MiB,
             tdp_w=400, attention_flops=179.5 * TFLOPS,
             memory_bandwidth_bytes_s=1555 * GB, intra_node_bandwidth_bytes_s=300 * GB,
             inter_node_bandwidth_bytes_s=25 * GB, cuda_capability=(8, 0)),
        # Same datasheet, 80GB SXM: HBM2e at 2,039 GB/s.
        _acc("A100-80GB", fp32=19.5, tf32=156, bf16=312, fp8=None, memory_bytes=81920 * MiB,
             tdp_w=400, attention_flops=179.5 * TFLOPS,
             memory_bandwidth_bytes_s=2039 * GB, intra_node_bandwidth_bytes_s=300 * GB,
             inter_node_bandwidth_bytes_s=25 * GB, aliases=("A100",), cuda_capability=(8, 0)),
        # NVIDIA H100 datasheet, SXM5: FP32 67, TF32 494.5, BF16 989.5, FP8 1,979 TFLOPS dense; 80GB HBM3
        # at 3.35 TB/s; NVLink4 900 GB/s bidirectional; ConnectX-7 400 Gb/s per GPU (DGX H100).
        _acc("H100-SXM", fp32=67, tf32=494.5, bf16=989.5, fp8=1979, memory_bytes=81559 * MiB,
             tdp_w=700, attention_flops=327.9 * TFLOPS,
             memory_bandwidth_bytes_s=3350 * GB, intra_node_bandwidth_bytes_s=450 * GB,
             inter_node_bandwidth_bytes_s=50 * GB, aliases=("H100",), cuda_capability=(9, 0)),
        # Same datasheet, PCIe: FP32 51, TF32 378, BF16 756, FP8 1,513 TFLOPS dense; 2.0 TB/s;
        # PCIe Gen5 x16 64 GB/s per direction; 200 Gb/s NIC per GPU assumed.
        _acc("H100-PCIe", fp32=51, tf32=378, bf16=756, fp8=1513, memory_bytes=81559 * MiB,
             memory_bandwidth_bytes_s=2000 * GB, intra_node_bandwidth_bytes_s=64 * GB,
             inter_node_bandwidth_bytes_s=25 * GB, cuda_capability=(9, 0)),
        # Meta's Grand Teton H100 (torchtitan benchmarks/llama3_h100_202412_torchtitan.md): SXM H100 with 96GB
        # HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, run at its default 500 W power limit ("tuning it up to 700W TDP
        # can potentially provide further speedups"). Same SMs as H100-SXM, so the same datasheet peaks; the power
        # limit lowers the sustained rate (plan/inputs.py POWER_EXPONENT). Memory: 96 GB as torchtitan states (no
        # nvidia-smi total published).
        _acc("H100-HBM2e", fp32=67, tf32=494.5, bf16=989.5, fp8=1979, memory_bytes=96 * GB,
             tdp_w=700, attention_flops=327.9 * TFLOPS, default_power_w=500,
             memory_bandwidth_bytes_s=2400 * GB, intra_node_bandwidth_bytes_s=450 * GB,
             inter_node_bandwidth_bytes_s=50 * GB, aliases=("H100-96GB",), cuda_capability=(9, 0)),
        # H800 SXM (China export part): H100-SXM compute and memory, NVLink cut to 400 GB/s bidirectional.
        _acc("H800", fp32=67, tf32=494.5, bf16=989.5, fp8=1979, memory_bytes=81559 * MiB,
             memory_bandwidth_bytes_s=3350 * GB, intra_node_bandwidth_bytes_s=200 * GB,
             inter_node_bandwidth_bytes_s=50 * GB, cuda_capability=(9, 0)),
        # NVIDIA H200 datasheet: H100-SXM compute; 141GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional.
        _acc("H200", fp32=67, tf32=494.5, bf16=989.5, fp8=1979, memory_bytes=143771 * MiB,
             tdp_w=700, attention_flops=329.3 * TFLOPS,
             memory_bandwidth_bytes_s=4800 * GB, intra_node_bandwidth_bytes_s=450 * GB,
             inter_node_bandwidth_bytes_s=50 * GB, cuda_capability=(9, 0)),
        # NVIDIA HGX B200 spec (8 GPUs): BF16 36 PF and FP8 72 PF with sparsity -> 2.25 / 4.5 PF dense per
        # GPU; TF32 1.1 PF dense; FP32 75 TF; 180GB HBM3e at 8 TB/s; NVLink5 1.8 TB/s bidirectional.
        _acc("B200", fp32=75, tf32=1100, bf16=2250, fp8=4500, memory_bytes=183359 * MiB,
             tdp_w=1000, memory_bandwidth_bytes_s=8000 * GB, intra_node_bandwidth_bytes_s=900 * GB,
             inter_node_bandwidth_bytes_s=50 * GB, cuda_capability=(10, 0)),
        # AMD Instinct MI300X datasheet: FP32 163.4, TF32 653.7, BF16 1,307.4, FP8 2,614.9 TFLOPS dense;
        # 192GB HBM3 at 5.3 TB/s; Infinity Fabric 896 GB/s aggregate peer bandwidth (bidirectional).
        _acc("MI300X", fp32=163.4, tf32=653.7, bf16=1307.4, fp8=2614.9, memory_bytes=192 * GiB,
             memory_bandwidth_bytes_s=5300 * GB, intra_node_bandwidth_bytes_s=448 * GB,
             inter_node_bandwidth_bytes_s=50 * GB, cuda_capability=(9, 4)),
        # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16 362, FP8 733 TFLOPS dense; 48GB GDDR6 at
        # 864 GB/s; PCIe Gen4 x16 32 GB/s per direction; 100 Gb/s Ethernet per GPU assumed.
        _acc("L40S", fp32=91.6, tf32=183, bf16=362, fp8=733, memory_bytes=46068 * MiB,
             memory_bandwidth_bytes_s=864 * GB, intra_node_bandwidth_bytes_s=32 * GB,
             inter_node_bandwidth_bytes_s=12.5 * GB, cuda_capability=(8, 9)),
        # The host CPU: nominal numbers for planning only; the trainer measures the real peak at run time
        # (measure_cpu_peak_flops) because CPUs differ by orders of magnitude. bf16 has no fast path on
        # most CPUs (3-4x slower than fp32 on this project's test machine), so it is listed at fp32/4.
        _acc("cpu", fp32=0.1, tf32=None, bf16=0.025, fp8=None, memory_bytes=16 * GiB,
             memory_bandwidth_bytes_s=20 * GB, intra_node_bandwidth_bytes_s=5 * GB,
             inter_node_bandwidth_bytes_s=1.25 * GB, default_gpus_per_node=1),
    ]
}

_BY_ALIAS: dict[str, str] = {
    alias.lower(): acc.name for acc in CATALOG.values() for alias in (acc.name, *acc.aliases)
}


def accelerator_names() -> list[str]:
    """Canonical names, in catalog order."""
    return list(CATALOG)


def canonical_name(name: str) -> str | None:
    """Case-insensitive lookup by name or alias; None when unknown."""
    return _BY_ALIAS.get(name.strip().lower())


def get_accelerator(name: str) -> Accelerator:
    """The catalog entry for `name` (or an alias); a clear error lists the known names."""
    canon = canonical_name(name)
    if canon is None:
        raise UserInputError(f"unknown accelerator {name!r}; known: {', '.join(accelerator_names())}")
    return CATALOG[canon]


def target_capability(name: str) -> tuple[int, int] | None:
    """The catalog's compute capability of accelerator `name`; None for the host CPU or a name not in it."""
    canon = canonical_name(name)
    return CATALOG[canon].cuda_capability if canon is not None else None


def measure_cpu_peak_flops(*, size: int = 512, repeats: int = 5, dtype: str = "fp32") -> float:
    """Measure the host's matmul FLOP/s with torch (best of `repeats`): the CPU 'peak' used for MFU."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from leantrain.dtypes import DTYPES

    torch_dtype = DTYPES[dtype]
    # Real matmuls even when called under a FakeTensorMode (a `leantrain rehearse` trainer): a fake matmul takes
    # no time, and a peak measured so would be cached as thousands of times the host's.
    with unset_fake_temporarily():
        a = torch.randn(size, size, dtype=torch_dtype)
        b = torch.randn(size, size, dtype=torch_dtype)
        torch.matmul(a, b)  # warm-up: first call pays for thread-pool start
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b)
            best_s = min(best_s, time.perf_counter() - start)
    return 2.0 * size**3 / max(best_s, 1e-9)


# Matmul size and repeats for the host's peak: best of many 1024² matmuls, because a shared, busy CPU makes
# single timings low (and MFU look above 100%).
CPU_PEAK_MATMUL_SIZE = 1024
CPU_PEAK_REPEATS = 10


CPU_PEAK_CACHE_FILE = "cpu_peak_flops.json"


def cpu_peak_cache_path() -> Path:
    """Where measured CPU peaks are kept: $LEANTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/leantrain, else ~/.cache."""
    root = os.environ.get("LEANTRAIN_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leantrain")
    return Path(root) / CPU_PEAK_CACHE_FILE


def cpu_model_name() -> str:
    """The CPU's model string (/proc/cpuinfo's `model name` on Linux, else what platform reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_peak_key(dtype: str) -> str:
    """The cache key: CPU model, torch's intra-op thread count (what a matmul can use) and dtype."""
    import torch

    return f"{cpu_model_name()}|threads={torch.get_num_threads()}|{dtype}"


# A timing on a busy machine can only be slower than on an idle one, so every measurement is a lower bound
# on the peak and the cache keeps the highest. Self-healing rule: the first CPU_PEAK_SAMPLES processes on a host
# each measure again (one measurement taken under load does not stick), and a run that beat the plan at 100 %
# efficiency (calibrate: faster than the cached peak allows) measures again at once (remeasure_cpu_peak).
CPU_PEAK_SAMPLES = 3


@functools.lru_cache(maxsize=8)
def host_cpu_peak_flops(dtype: str = "fp32") -> float:
    """The CPU peak the planner and the trainer's MFU both use, per host, CPU model, thread count and dtype,
    from the cache file (`cpu_peak_cache_path`): the highest of the measurements so far, measured again by
    each process until CPU_PEAK_SAMPLES have been taken, then read, so MFU and alerts do not move with the
    noise of a busy machine."""
    dtype = "bf16" if dtype == "bf16" else "fp32"
    flops, samples = _cached_peak(dtype)
    if flops > 0 and samples >= CPU_PEAK_SAMPLES:
        return flops
    return _measure_and_keep_max(dtype)


def remeasure_cpu_peak(dtype: str = "fp32") -> float:
    """Measure the host's peak now and keep the highest (a run showed the cached value to be too low); the
    process's memoised peak is dropped so the planner and MFU read the new one."""
    dtype = "bf16" if dtype == "bf16" else "fp32"
    value = _measure_and_keep_max(dtype)
    host_cpu_peak_flops.cache_clear()
    return value


def _cached_peak(dtype: str) -> tuple[float, int]:
    """(highest measured FLOP/s, number of measurements); a bare number (the older format) is one."""
    entry = _read_peak_cache(cpu_peak_cache_path()).get(cpu_peak_key(dtype))
    if isinstance(entry, (int, float)) and entry > 0:
        return float(entry), 1
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return float(entry["flops"]), int(entry.get("samples") or 1)
    return 0.0, 0


def _measure_and_keep_max(dtype: str) -> float:
    value = measure_cpu_peak_flops(size=CPU_PEAK_MATMUL_SIZE, repeats=CPU_PEAK_REPEATS, dtype=dtype)
    path, key = cpu_peak_cache_path(), cpu_peak_key(dtype)
    flops, samples = _cached_peak(dtype)  # read again: another rank may have written meanwhile
    best = max(value, flops)
    _write_peak_cache(path, {**_read_peak_cache(path), key: {"flops": best, "samples": samples + 1}})
    return best


def _read_peak_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_peak_cache(path: Path, data: dict[str, Any]) -> None:
    """Atomic replace (ranks on one host may write at once); a read-only home only loses the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def host_memory_bytes() -> float:
    """Physical memory of this host, for the `cpu` accelerator."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return CATALOG["cpu"].memory_bytes


def accelerator_memory_bytes(hardware: Any) -> float:
    """Memory per accelerator for a spec's `hardware` section: `memory_gb` / `memory_gib` when set, else the
    catalog's."""
    override = getattr(hardware, "memory_bytes", None)
    if override:
        return float(override)
    return float(get_accelerator(hardware.accelerator).memory_bytes)
