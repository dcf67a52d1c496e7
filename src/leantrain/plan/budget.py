"""Budget (GPU count, days, GPU-hours, cost), storage, and the checkpoint interval.

- GPUs for a target: C / (peak × assumed MFU × target seconds), rounded up; spare = ceil(GPUs × (1 + f)).
  C is the seed's 6·N·D with the nominal N (for MoE its active share) by default (`budget.sizing_flops:
  6ND`), or the detailed
  count that MFU is measured against (`detailed`).
- Storage: tokenized data at 2 bytes per token when the vocabulary fits uint16 (< 65,536 ids, as
  Megatron's IndexedDataset), else 4; times `data.replicas`; plus the raw text (`bytes_per_token_raw`).
  A checkpoint holds the trained weights at master precision and both Adam moments: every parameter, or for
  LoRA/QLoRA only the adapters (the frozen base is referenced by hash, not saved: ckpt/base_ref.py).
- Checkpoint save time: the checkpoint over the job's write bandwidth, `checkpoint.write_bandwidth_gb_s` or
  by default 1 GB/s per node writing in parallel (`write_bandwidth_gb_s_per_node`; Llama 3 §3.3.1: Tectonic
  sustained 2 TB/s for 2,048 nodes).
- Checkpoint interval: Daly (2006) higher-order optimum (Young's √(2·δ·M) when δ ≪ M), δ the time a save
  blocks training (the full write, or only the device-to-host copy when saving asynchronously), M the job's
  mean time between failures. Default failure rate from Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected
  interruptions in 54 days on 16,384 GPUs = 4.7e-4 failures per GPU-day.
  Expected goodput: Daly's exponential-failure model (save stalls, lost work and a restart per failure),
  which stays right where δ/M is not small (first-order formulas go negative there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leantrain.hardware import GB, GiB
from leantrain.plan.finetune import adapter_params
from leantrain.plan.inputs import HOST_COPY_BYTES_S, PlanInputs
from leantrain.plan.layout import Layout
from leantrain.plan.memory import checkpointed_state_bytes
from leantrain.spec.schema import JobSpec

SECONDS_PER_DAY = 86400.0
HOST_MEMORY_GB_PER_GPU = 64  # cluster.memory_gb_per_node's default per GPU (what the job files request)
FAST_TIER_COPIES = 2  # the fast tier keeps a rank's own shard and the copy it holds for a peer (ckpt/memory_tier.py)
TMPFS_SHARE_OF_MEMORY = 0.5  # Linux mounts /dev/shm at half the host's memory unless told otherwise
TMPFS_ROOTS = ("/dev/shm", "/run/shm")
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
DEFAULT_FAILURES_PER_GPU_DAY = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS)


@dataclass(frozen=True)
class Budget:
    sizing_flops: float  # the FLOPs that size the GPU count
    num_gpus_exact: float
    num_gpus: int
    num_gpus_with_spare: int
    days: float
    gpu_hours: float
    cost: float
    cost_per_million_tokens: float


def gpus_for_days(*, total_flops: float, flops_per_gpu_s: float, days: float) -> float:
    """GPUs (unrounded) that deliver `total_flops` in `days` at an effective per-GPU rate."""
    return total_flops / (flops_per_gpu_s * days * SECONDS_PER_DAY)


def days_for_gpus(*, total_flops: float, flops_per_gpu_s: float, num_gpus: int) -> float:
    return total_flops / (flops_per_gpu_s * num_gpus * SECONDS_PER_DAY)


def sizing_params(inputs: PlanInputs) -> float:
    """N in 6·N·D: the nominal size; for mixture-of-experts its active share (the top-k routed and shared
    experts a token passes through, not all experts): nominal × active / total."""
    shape = inputs.shape
    if shape.moe is None:
        return shape.nominal_params
    return shape.nominal_params * shape.active_params() / shape.total_params()


def sizing_total_flops(spec: JobSpec, inputs: PlanInputs) -> float:
    """The FLOPs that size the job: seed 6·N·D (nominal N, active for MoE) or the detailed FLOPs × tokens."""
    if spec.budget.sizing_flops == "6ND":
        return 6.0 * sizing_params(inputs) * inputs.tokens_total
    return inputs.flops.model * inputs.tokens_total


def make_budget(spec: JobSpec, inputs: PlanInputs, *, num_gpus: int | None = None) -> Budget:
    """GPU count and days at the assumed MFU; with `num_gpus` (or a fixed count in the spec) report days."""
    b = spec.budget
    total = sizing_total_flops(spec, inputs)
    rate = inputs.peak_flops * b.assumed_mfu
    fixed = num_gpus or spec.budget.num_gpus or spec.hardware.num_gpus
    if fixed is not None:
        exact = float(fixed)
        gpus = fixed
    else:
        assert b.target_days is not None  # the spec check asks for target_days or num_gpus
        exact = gpus_for_days(total_flops=total, flops_per_gpu_s=rate, days=b.target_days)
        gpus = max(1, math.ceil(exact - 1e-9))
    days = days_for_gpus(total_flops=total, flops_per_gpu_s=rate, num_gpus=gpus)
    gpu_hours = days * 24 * gpus
    cost = gpu_hours * b.price_per_gpu_hour
    return Budget(sizing_flops=total, num_gpus_exact=exact, num_gpus=gpus,
                  num_gpus_with_spare=math.ceil(gpus * (1 + b.spare_fraction) - 1e-9), days=days,
                  gpu_hours=gpu_hours, cost=cost, cost_per_million_tokens=cost / inputs.tokens_total * 1e6)


def token_bytes(vocab_size: int) -> int:
    """Bytes per stored token id: uint16 when every id fits, else int32."""
    return 2 if vocab_size <= 2**16 else 4


def checkpoint_bytes(inputs: PlanInputs) -> float:
    """One training checkpoint: the trained weights at master precision + two Adam moments — every parameter
    (all experts), or under LoRA/QLoRA the adapters alone (the frozen base is not saved)."""
    weights = max(inputs.master_bytes, inputs.weight_bytes)
    trained = inputs.shape.total_params() if inputs.trains_base else adapter_params(inputs)
    return trained * (weights + 2 * inputs.moment_bytes)


def storage(spec: JobSpec, inputs: PlanInputs) -> dict[str, float]:
    tokens = inputs.tokens_total
    tokenized = tokens * token_bytes(inputs.shape.vocab_size)
    raw = tokens * spec.data.bytes_per_token_raw
    ckpt = checkpoint_bytes(inputs)
    return {
        "data_bytes": tokenized * spec.data.replicas + raw,
        "tokenized_bytes": tokenized,
        "raw_bytes": raw,
        "replicas": spec.data.replicas,
        "checkpoint_bytes": ckpt,
        "checkpoints_kept_bytes": ckpt * spec.checkpoint.keep_last,
    }


def daly_interval_s(*, blocking_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum compute time between checkpoints:
    √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else M. For δ ≪ M it is Young's √(2δM)."""
    if blocking_s <= 0:
        return 0.0
    if blocking_s >= 2 * mtbf_s:
        return mtbf_s
    x = blocking_s / (2 * mtbf_s)
    return math.sqrt(2 * blocking_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - blocking_s


def expected_goodput(*, interval_s: float, blocking_s: float, mtbf_s: float, restart_s: float) -> float:
    """Useful share of wall time with exponential failures (Daly 2006, eq. 13): wall / work =
    (M/τ)·e^(R/M)·(e^((τ+δ)/M) − 1) for a compute interval τ, save stall δ, MTBF M and restart R."""
    if interval_s <= 0:
        return 0.0
    ratio = mtbf_s / interval_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + blocking_s) / mtbf_s)
    return 1.0 / ratio


def write_bandwidth_gb_s(spec: JobSpec, *, num_gpus: int) -> float:
    """The job's checkpoint write bandwidth: `checkpoint.write_bandwidth_gb_s` when given, else the per-node
    figure times the nodes writing in parallel (each rank writes its own shards: ckpt/)."""
    ck = spec.checkpoint
    if ck.write_bandwidth_gb_s is not None:
        return ck.write_bandwidth_gb_s
    return ck.write_bandwidth_gb_s_per_node * max(1, math.ceil(num_gpus / spec.hardware.gpus_per_node))


def checkpoint_interval(spec: JobSpec, inputs: PlanInputs, *, num_gpus: int, step_s: float) -> dict[str, float]:
    """Daly interval in seconds and steps, the save time, the job MTBF and the expected goodput."""
    ckpt = checkpoint_bytes(inputs)
    save_s = ckpt / (write_bandwidth_gb_s(spec, num_gpus=num_gpus) * GB)
    blocking_s = ckpt / num_gpus / HOST_COPY_BYTES_S if spec.checkpoint.async_save else save_s
    rate = spec.fault.failures_per_gpu_day or DEFAULT_FAILURES_PER_GPU_DAY
    mtbf_s = SECONDS_PER_DAY / (rate * num_gpus)
    recommended_s = daly_interval_s(blocking_s=blocking_s, mtbf_s=mtbf_s)
    if spec.checkpoint.interval_steps == "auto":
        interval_steps = max(1, round(recommended_s / step_s))
    else:
        interval_steps = int(spec.checkpoint.interval_steps)
    interval_s = interval_steps * step_s
    goodput = expected_goodput(interval_s=interval_s, blocking_s=blocking_s, mtbf_s=mtbf_s,
                               restart_s=spec.fault.restart_s)
    return {
        "interval_steps": interval_steps,
        "interval_s": interval_s,
        "save_s": save_s,
        "blocking_s": blocking_s,
        "recommended_interval_s": recommended_s,
        "young_interval_s": math.sqrt(2 * blocking_s * mtbf_s),
        "recommended_interval_steps": max(1, round(recommended_s / step_s)),
        "mtbf_s": mtbf_s,
        "delta_over_mtbf": blocking_s / mtbf_s,
        "failures_per_gpu_day": rate,
        "expected_goodput": max(0.0, goodput),
    }


def fast_tier(spec: JobSpec, inputs: PlanInputs, layout: Layout) -> dict[str, object]:
    """The fast tier's memory per node (`checkpoint.memory_interval_steps`): FAST_TIER_COPIES × local ranks ×
    the heaviest rank's checkpointed state, against the node. On tmpfs (`checkpoint.memory_dir` under /dev/shm,
    the default) that is host memory: at most the default tmpfs size (half of `cluster.memory_gb_per_node`,
    default 64 GiB per GPU) and, on Kubernetes, the /dev/shm volume (`cluster.k8s_shm_gb`). A memory_dir on a
    node-local disk is for the preflight to check on the node. `problems` say what does not fit and what would."""
    ck, cluster = spec.checkpoint, spec.cluster
    if ck.memory_interval_steps is None:
        return {"enabled": False}
    local_ranks = min(inputs.gpus_per_node, layout.num_gpus)
    shard = checkpointed_state_bytes(inputs, layout)
    need = FAST_TIER_COPIES * local_ranks * shard
    out: dict[str, object] = {"enabled": True, "memory_dir": str(ck.memory_dir), "shard_bytes_per_rank": shard,
                              "local_ranks": local_ranks, "bytes_per_node": need, "problems": []}
    if not str(ck.memory_dir).startswith(TMPFS_ROOTS):
        out.update(kind="disk", fits=None)
        return out
    host = (cluster.memory_gb_per_node or HOST_MEMORY_GB_PER_GPU * inputs.gpus_per_node) * GiB
    tmpfs, k8s_shm = host * TMPFS_SHARE_OF_MEMORY, cluster.k8s_shm_gb * GiB
    problems: list[str] = []
    what = (f"the fast tier needs {need / GiB:.1f} GiB of host memory per node ({FAST_TIER_COPIES} × "
            f"{shard / GiB:.2f} GiB state per rank × {local_ranks} ranks in {ck.memory_dir})")
    if need > tmpfs:
        problems.append(f"{what}, more than the default tmpfs holds on a node with {host / GiB:.0f} GiB "
                        f"(half of it): raise cluster.memory_gb_per_node (and /dev/shm's size), put "
                        f"checkpoint.memory_dir on a node-local disk, or shard the state over more GPUs")
    if need > k8s_shm:
        problems.append(f"{what}, more than the Kubernetes /dev/shm volume (cluster.k8s_shm_gb: "
                        f"{cluster.k8s_shm_gb}): raise it to at least {math.ceil(need / GiB)}")
    out.update(kind="tmpfs", host_memory_bytes_per_node=host, tmpfs_bytes=tmpfs, k8s_shm_bytes=k8s_shm,
               fits_tmpfs=need <= tmpfs, fits_k8s_shm=need <= k8s_shm, fits=not problems, problems=problems)
    return out
