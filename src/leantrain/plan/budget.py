"""Budget (GPU count, days, GPU-hours, cost), storage, and the checkpoint interval.

- GPUs for a target: C / (peak × assumed MFU × target seconds), rounded up; spare = ceil(GPUs × (1 + f)).
  C is the rule of thumb 6·N·D with the nominal N (for MoE its active share) by default (`budget.sizing_flops:
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

from leantrain.errors import UserInputError
from leantrain.hardware import GB, GiB
from leantrain.plan.activations import stage_layers
from leantrain.plan.finetune import adapter_params
from leantrain.plan.inputs import HOST_COPY_BYTES_S, PlanInputs, sequences_per_step
from leantrain.plan.layout import Layout
from leantrain.plan.memory import candidate_stages, stage_params
from leantrain.spec.schema import JobSpec

SECONDS_PER_DAY = 86400.0
HOST_MEMORY_GB_PER_GPU = 64  # cluster.memory_gib_per_node's default per GPU, GiB (what the job files request)
FAST_TIER_COPIES = 2  # the fast tier keeps a rank's own shard and the copy it holds for a peer (ckpt/memory_tier.py)
TMPFS_SHARE_OF_MEMORY = 0.5  # Linux mounts /dev/shm at half the host's memory unless told otherwise
TMPFS_ROOTS = ("/dev/shm", "/run/shm")
# Host memory of one training process (process_host_bytes; docs/plan.md "Host memory"):
# - runtime: Python with torch and leantrain imported, plus on a GPU the CUDA context's host side and the CUDA
#   libraries mapped into it. GPU 3 GiB is an allowance: a process that made one CUDA tensor peaks at 2.06 GB
#   RSS (torch 2.2, CUDA 11.8, lazy module loading: pytorch/pytorch#113326; lazy loading took the context's
#   host memory from 667 MB to 287 MB: pytorch/pytorch#86509); the rest is headroom for what the first steps
#   load (more kernels, NCCL's host-side buffers), not measured here. CPU 0.5 GiB: a rank of this repo's tiny
#   2-rank CPU job peaks at 0.42 GB RSS when its model is built (model_ready's host_rss_peak_bytes, torch 2.13).
# - loader: the trainer reads PREFETCH_PER_MICRO_BATCH × its micro-batches ahead (data/prefetch.py, depth
#   2 × accumulation steps) plus the one the producer holds; a micro-batch is micro_batch rows of seq_len + 1
#   int64 token ids and a 1-byte loss mask, plus an int64 source id per row; on CUDA the batches are pinned and
#   torch's caching host allocator rounds each block up to a power of two (PINNED_ROUNDING, the worst case).
# - async_staging: `checkpoint.async_save` stages the rank's shard to one private CPU copy (DCP's
#   BlockingAsyncStager, ckpt/dcp_io.stage_to_cpu), held until the background write ends.
# - fast_tier_in_flight: during a fast-tier save a device shard gets one CPU copy (none for CPU tensors,
#   ckpt/memory_format.py) and the rank holds the buffer of the peer's copy it received (ckpt/memory_tier.py).
# - cpu_offload: `parallelism.cpu_offload` keeps the rank's weights at master precision, its Adam moments and
#   its gradients in host memory (FSDP2's CPUOffloadPolicy).
HOST_RUNTIME_BYTES = {"gpu": 3.0 * GiB, "cpu": 0.5 * GiB}
PREFETCH_PER_MICRO_BATCH = 2
BATCH_BYTES_PER_TOKEN = 8 + 1  # int64 token id + uint8 loss mask
BATCH_BYTES_PER_ROW = 8  # int64 source id
PINNED_ROUNDING = 2
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
    """The FLOPs that size the job: 6·N·D (nominal N, active for MoE) or the detailed FLOPs × tokens."""
    if spec.budget.sizing_flops == "6ND":
        return 6.0 * sizing_params(inputs) * inputs.tokens_total
    return inputs.flops.model * inputs.tokens_total


# More GPUs than any cluster has (the largest published runs: ~10^5): a unit slip, not a job to plan (the layout
# search's divisor walk would take hours over such a count).
MAX_GPUS = 10**6


def make_budget(spec: JobSpec, inputs: PlanInputs, *, num_gpus: int | None = None) -> Budget:
    """GPU count and days at the assumed MFU; with `num_gpus` (or a fixed count in the spec) report days."""
    b = spec.budget
    total = sizing_total_flops(spec, inputs)
    rate = inputs.peak_flops * b.assumed_mfu
    fixed = num_gpus or spec.budget.num_gpus or spec.hardware.num_gpus
    if fixed is not None:
        exact = float(fixed)
        gpus = fixed
        if gpus > MAX_GPUS:
            raise UserInputError(f"{gpus:,} GPUs (budget.num_gpus, hardware.num_gpus or --what-if) is more than any "
                                 f"cluster ({MAX_GPUS:,})")
    else:
        assert b.target_days is not None  # the spec check asks for target_days or num_gpus
        exact = gpus_for_days(total_flops=total, flops_per_gpu_s=rate, days=b.target_days)
        gpus = max(1, math.ceil(exact - 1e-9))
        if gpus > MAX_GPUS:
            raise UserInputError(
                f"the budget needs {exact:.3g} GPUs ({total:.3g} FLOPs at {rate:.3g} FLOP/s a GPU for "
                f"budget.target_days {b.target_days:g}), more than any cluster ({MAX_GPUS:,}): check "
                "hardware.peak_flops (FLOP/s: 989e12 for an H100's bf16, not 989), budget.assumed_mfu, "
                "data.tokens_total and budget.target_days")
    days = days_for_gpus(total_flops=total, flops_per_gpu_s=rate, num_gpus=gpus)
    gpu_hours = days * 24 * gpus
    cost = gpu_hours * b.price_per_gpu_hour
    return Budget(sizing_flops=total, num_gpus_exact=exact, num_gpus=gpus,
                  num_gpus_with_spare=math.ceil(gpus * (1 + b.spare_fraction) - 1e-9), days=days,
                  gpu_hours=gpu_hours, cost=cost, cost_per_million_tokens=cost / inputs.tokens_total * 1e6)


def token_bytes(vocab_size: int) -> int:
    """Bytes per stored token id: uint16 when every id fits, else int32."""
    return 2 if vocab_size <= 2**16 else 4


def checkpointed_bytes_per_param(inputs: PlanInputs) -> float:
    """A trained parameter in a checkpoint: its weight at master precision and its two Adam moments."""
    return max(inputs.master_bytes, inputs.weight_bytes) + 2 * inputs.moment_bytes


def checkpoint_bytes(inputs: PlanInputs) -> float:
    """One training checkpoint: the trained weights at master precision + two Adam moments — every parameter
    (all experts), or under LoRA/QLoRA the adapters alone (the frozen base is not saved)."""
    trained = inputs.shape.total_params() if inputs.trains_base else adapter_params(inputs)
    return trained * checkpointed_bytes_per_param(inputs)


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


def checkpoint_interval(spec: JobSpec, inputs: PlanInputs, *, num_gpus: int, step_s: float,
                        layout: Layout | None = None) -> dict[str, float]:
    """Daly interval in seconds and steps, the save time, the job MTBF and the expected goodput.

    A synchronous save blocks for the whole write. An asynchronous one, as the trainer runs it (ckpt/manager.py),
    blocks for the rank's device-to-host copy of its own state (`layout`'s heaviest rank: the whole replica at
    ZeRO-0; without a layout the checkpoint over the GPUs), and a save waits for the previous write to finish: the
    auto interval is never shorter than the write (ckpt/policy.py `AutoInterval`), and a fixed one shorter than the
    write stalls every save for the difference. Its checkpoint is durable only once written, so a failure loses,
    on average, the write time beyond the interval's lost work (priced with the restart)."""
    ckpt = checkpoint_bytes(inputs)
    save_s = ckpt / (write_bandwidth_gb_s(spec, num_gpus=num_gpus) * GB)
    async_save = spec.checkpoint.async_save
    staged = checkpointed_state_bytes(inputs, layout) if layout is not None else ckpt / num_gpus
    copy_s = staged / HOST_COPY_BYTES_S
    rate = spec.fault.failures_per_gpu_day or DEFAULT_FAILURES_PER_GPU_DAY
    mtbf_s = SECONDS_PER_DAY / (rate * num_gpus)
    daly_s = daly_interval_s(blocking_s=copy_s if async_save else save_s, mtbf_s=mtbf_s)
    recommended_s = max(daly_s, save_s) if async_save else daly_s
    steps_for = max(1, round(recommended_s / step_s))
    if async_save and steps_for * step_s < save_s:
        steps_for = math.ceil(save_s / step_s)
    interval_steps = steps_for if spec.checkpoint.interval_steps == "auto" else int(spec.checkpoint.interval_steps)
    interval_s = interval_steps * step_s
    wait_s = max(0.0, save_s - interval_s) if async_save else 0.0
    blocking_s = copy_s + wait_s if async_save else save_s
    lag_s = min(save_s, interval_s) if async_save else 0.0
    goodput = expected_goodput(interval_s=interval_s, blocking_s=blocking_s, mtbf_s=mtbf_s,
                               restart_s=spec.fault.restart_s + lag_s)
    return {
        "interval_steps": interval_steps,
        "interval_s": interval_s,
        "save_s": save_s,
        "blocking_s": blocking_s,
        "host_copy_s": copy_s if async_save else 0.0,
        "write_wait_s": wait_s,
        "durability_lag_s": lag_s,
        "recommended_interval_s": recommended_s,
        "young_interval_s": math.sqrt(2 * (copy_s if async_save else save_s) * mtbf_s),
        "recommended_interval_steps": steps_for,
        "mtbf_s": mtbf_s,
        "delta_over_mtbf": blocking_s / mtbf_s,
        "failures_per_gpu_day": rate,
        "expected_goodput": max(0.0, goodput),
    }


def node_host_bytes(spec: JobSpec, inputs: PlanInputs) -> float:
    """A node's host memory: `cluster.memory_gib_per_node` (or `memory_gb_per_node` with its unit), else what the
    job files request (64 GiB per GPU)."""
    return (spec.cluster.host_memory_gib or HOST_MEMORY_GB_PER_GPU * inputs.gpus_per_node) * GiB


def _tier_need(spec: JobSpec, *, shard_bytes: float, local_ranks: int) -> tuple[float, str]:
    need = FAST_TIER_COPIES * local_ranks * shard_bytes
    return need, (f"the fast tier needs {need / GiB:.1f} GiB of host memory per node ({FAST_TIER_COPIES} × "
                  f"{shard_bytes / GiB:.2f} GiB state per rank × {local_ranks} ranks in {spec.checkpoint.memory_dir})")


def k8s_shm_problem(spec: JobSpec, *, shard_bytes: float, local_ranks: int) -> str | None:
    """The fast tier against the Kubernetes /dev/shm volume (`cluster.k8s_shm_gb`): None when it fits, else one
    line with the size to set. The plan and `launch --emit k8s` (with the job's ranks per node) both ask here."""
    need, what = _tier_need(spec, shard_bytes=shard_bytes, local_ranks=local_ranks)
    if need <= spec.cluster.k8s_shm_gb * GiB:
        return None
    return (f"{what}, more than the Kubernetes /dev/shm volume (cluster.k8s_shm_gb: {spec.cluster.k8s_shm_gb}): "
            f"set cluster.k8s_shm_gb to at least {math.ceil(need / GiB)}")


def fast_tier(spec: JobSpec, inputs: PlanInputs, layout: Layout) -> dict[str, object]:
    """The fast tier's memory per node (`checkpoint.memory_interval_steps`): FAST_TIER_COPIES × local ranks ×
    the heaviest rank's checkpointed state, against the node. On tmpfs (`checkpoint.memory_dir` under /dev/shm,
    the default) that is host memory: at most the default tmpfs size (half of `cluster.memory_gib_per_node`,
    default 64 GiB per GPU) and, on Kubernetes, the /dev/shm volume (`cluster.k8s_shm_gb`). A memory_dir on a
    node-local disk is for the preflight to check on the node. `problems` say what does not fit and what would."""
    ck = spec.checkpoint
    if ck.memory_interval_steps is None:
        return {"enabled": False}
    local_ranks = min(inputs.gpus_per_node, layout.num_gpus)
    shard = checkpointed_state_bytes(inputs, layout)
    need, what = _tier_need(spec, shard_bytes=shard, local_ranks=local_ranks)
    out: dict[str, object] = {"enabled": True, "memory_dir": str(ck.memory_dir), "shard_bytes_per_rank": shard,
                              "local_ranks": local_ranks, "bytes_per_node": need, "problems": []}
    if not str(ck.memory_dir).startswith(TMPFS_ROOTS):
        out.update(kind="disk", fits=None)
        return out
    host = node_host_bytes(spec, inputs)
    tmpfs, k8s_shm = host * TMPFS_SHARE_OF_MEMORY, spec.cluster.k8s_shm_gb * GiB
    problems: list[str] = []
    if need > tmpfs:
        problems.append(f"{what}, more than the default tmpfs holds on a node with {host / GiB:.0f} GiB "
                        f"(half of it): raise cluster.memory_gib_per_node (and /dev/shm's size), put "
                        f"checkpoint.memory_dir on a node-local disk, or shard the state over more GPUs")
    if (shm := k8s_shm_problem(spec, shard_bytes=shard, local_ranks=local_ranks)) is not None:
        problems.append(shm)
    out.update(kind="tmpfs", host_memory_bytes_per_node=host, tmpfs_bytes=tmpfs, k8s_shm_bytes=k8s_shm,
               fits_tmpfs=need <= tmpfs, fits_k8s_shm=shm is None, fits=not problems, problems=problems)
    return out


def process_host_bytes(spec: JobSpec, inputs: PlanInputs, layout: Layout) -> dict[str, float]:
    """Host memory one training process holds besides the fast tier's files, by part (HOST_RUNTIME_BYTES and
    the notes above it): the runtime, the loader's read-ahead, the async save's staged copy, a fast-tier save
    in flight and CPU-offloaded state. `total` is their sum."""
    ck = spec.checkpoint
    shard = checkpointed_state_bytes(inputs, layout)
    on_gpu = inputs.accelerator != "cpu"
    micro_batches = layout.num_microbatches(sequences_per_step(inputs))
    batch = layout.micro_batch * ((inputs.seq_len + 1) * BATCH_BYTES_PER_TOKEN + BATCH_BYTES_PER_ROW)
    pinned = PINNED_ROUNDING if on_gpu else 1
    parts = {
        "runtime": HOST_RUNTIME_BYTES["gpu" if on_gpu else "cpu"],
        "loader": (PREFETCH_PER_MICRO_BATCH * micro_batches + 1) * batch * pinned,
        "async_staging": shard if ck.async_save else 0.0,
        "fast_tier_in_flight": (shard * (2 if on_gpu else 1)) if ck.memory_interval_steps is not None else 0.0,
        "cpu_offload": shard * (1 + inputs.grad_bytes / _state_bytes_per_param(inputs)) if inputs.cpu_offload
        else 0.0,
    }
    return {**parts, "total": sum(parts.values())}


def _state_bytes_per_param(inputs: PlanInputs) -> float:
    return max(inputs.master_bytes, inputs.weight_bytes) + 2 * inputs.moment_bytes  # checkpointed_state_bytes'


def host_memory(spec: JobSpec, inputs: PlanInputs, layout: Layout, tier: dict[str, object]) -> dict[str, object]:
    """A node's host memory against what it must hold: local ranks × `process_host_bytes` plus the fast tier's
    files when they are on tmpfs (host memory; on Kubernetes a memory-backed /dev/shm volume counts against the
    pod's memory limit, which is `cluster.memory_gib_per_node`). `problems`: one line naming the field and the
    size that would do."""
    local_ranks = min(inputs.gpus_per_node, layout.num_gpus)
    per_process = process_host_bytes(spec, inputs, layout)
    files = float(tier["bytes_per_node"]) if tier.get("kind") == "tmpfs" else 0.0  # type: ignore[arg-type]
    need = local_ranks * per_process["total"] + files
    host = node_host_bytes(spec, inputs)
    problems = []
    if need > host:
        field = (f"cluster host memory {host / GiB:.0f} GiB" if spec.cluster.host_memory_gib
                 else f"cluster.memory_gib_per_node unset: {host / GiB:.0f} GiB, {HOST_MEMORY_GB_PER_GPU} per GPU")
        problems.append(f"a node needs {need / GiB:.1f} GiB of host memory ({local_ranks} ranks × "
                        f"{per_process['total'] / GiB:.1f} GiB per process"
                        + (f" + {files / GiB:.1f} GiB fast tier in {spec.checkpoint.memory_dir}" if files else "")
                        + f"), more than it has ({field}): set cluster.memory_gib_per_node to at least "
                        f"{math.ceil(need / GiB)}")
    return {"per_process": per_process, "local_ranks": local_ranks, "processes_bytes_per_node":
            local_ranks * per_process["total"], "fast_tier_bytes_per_node": files, "bytes_per_node": need,
            "host_memory_bytes_per_node": host, "fits": need <= host, "problems": problems}


def checkpointed_state_bytes(inputs: PlanInputs, layout: Layout) -> float:
    """The checkpointed state on the heaviest GPU: its shard of the trained weights at master precision and
    both Adam moments (LoRA/QLoRA: the adapters only; a frozen base is never saved), sharded as `_states`
    shards them (`StageParams.sharded`), CPU-offloaded or not. What the fast tier (ckpt/memory_tier.py) writes
    per rank."""
    layers = stage_layers(inputs.shape.n_layers, layout.pp, layout.virtual_stages)
    per_param = checkpointed_bytes_per_param(inputs)
    best = 0.0
    for stage in candidate_stages(layers):
        sp = stage_params(inputs.shape, layout, layers=layers[stage], first=stage == 0, last=stage == layout.pp - 1,
                          first_layer=sum(layers[:stage]))
        local = sp.sharded(layout)
        if not inputs.trains_base:  # the adapters' share of this GPU's slice of the model
            local *= adapter_params(inputs) / max(inputs.shape.total_params(), 1.0)
        best = max(best, local * per_param)
    return best
