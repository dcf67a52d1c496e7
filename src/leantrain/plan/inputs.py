"""What the planner needs from a spec, resolved once: shape, bytes per value, accelerator numbers, knobs.

Every later function (memory, timing, search) takes a `PlanInputs` and a `Layout`, never the raw spec, so
the search can evaluate thousands of layouts without re-reading or re-validating anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Literal

from leantrain.errors import UserInputError
from leantrain.hardware import GB, Accelerator, get_accelerator, host_cpu_peak_flops
from leantrain.plan.adapters import lora_param_count
from leantrain.plan.flops import FlopsPerToken, Recompute, flops_per_token
from leantrain.plan.layout import Layout
from leantrain.spec.rules import forward_autocasts, wraps_in_fsdp
from leantrain.spec.schema import JobSpec
from leantrain.spec.shapes import ModelShape, resolve_shape

# Bytes per value of each dtype name used in the spec.
DTYPE_BYTES = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
# Adam keeps two moments. torchao's AdamW8bit stores 1 byte per value plus one fp32 scale per block of 256.
MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0 + 4.0 / 256}

# Default share of peak FLOP/s a large bf16 matmul sustains inside a training step (kernels and launch gaps
# included; the memory-bound ops are priced apart, ELEMENTWISE_PASSES). A100 and Hopper (H100/H800/H200) are
# fitted, with ELEMENTWISE_PASSES, on all throughput runs of plan/published_runs.yaml (bench/plan_accuracy.py;
# fitted on one half, the other half is predicted within the out-of-sample error docs/plan.md records).
# B200, MI300X and L40S have no published runs in the file: H100's value scaled by judgement, not fitted.
# cpu: the share of the host's measured matmul peak (hardware.host_cpu_peak_flops, a large square matmul)
# that the CPU examples' small matrices reach in a step: 16-50 % MFU measured for examples/tiny-cpu.yaml and
# 23-27 % for examples/finetune-lora-cpu.yaml on a 2-core host, so the plan (and the low_mfu alert's floor, half
# the plan) sits below what a healthy CPU run does.
DEFAULT_COMPUTE_EFFICIENCY = {"A100": 0.66, "H100": 0.68, "H800": 0.68, "H200": 0.68, "B200": 0.5,
                              "MI300X": 0.45, "L40S": 0.6, "cpu": 0.25}
FALLBACK_COMPUTE_EFFICIENCY = 0.55
# GEMM efficiency by shape (plan/timing.py gemm_time_factor): a GEMM of M×K×N takes F/R + GEMM_KAPPA·B/W, its
# FLOPs F at the large-GEMM rate R = GEMM_RATE_SHARE × peak plus a share GEMM_KAPPA of its operand and result
# bytes B at HBM bandwidth W that the kernel does not hide. Fitted to 32 H100 (sm_90) bf16 shapes measured by XLA
# (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h @372d578, M, K, N
# 256-4096, batch 1-4): median |error| 3.2 %. A GEMM's efficiency is then 1 / (1 + κ·(R/W)·B/F): near 1 for the
# big per-GPU GEMMs of a wide model, lower for narrow layers and wide tensor parallelism, and lower on a part
# with a higher FLOP/byte ratio (H100 over A100; the 2.4 TB/s H100-HBM2e).
GEMM_RATE_SHARE = 0.89
GEMM_KAPPA = 0.6
# FP8 GEMMs (torchao's Float8 linears, what the trainer uses; Transformer Engine stacks set `plan.fp8_speedup`):
# the GEMM's FLOPs run FP8_GEMM_SPEEDUP × faster, its bytes do not, and dynamic scaling adds FP8_CAST_BYTES of HBM
# traffic per element of input, weight and output gradient (amax and cast). The two constants solve torchao's
# two published H100 linear speed-ups (torchao/float8/README.md, "Performance": M, K, N = 1024, 2048, 1024 →
# 0.80×; 4096, 8192, 16384 → 1.39×) under the GEMM model above: small GEMMs lose, large ones approach the limit.
# MFU stays measured against the bf16 peak, as the trainer does.
FP8_GEMM_SPEEDUP = 1.78
FP8_CAST_BYTES = 2.44
# FlashAttention's work per attention FLOP the planner counts (plan/flops.py: QKᵀ and A·V over the whole sequence,
# backward 2× forward): a causal kernel skips the masked half, and its backward does 2.5× the forward's work
# (recomputing QKᵀ); both as Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py counts FLOPs, the
# script behind the hardware catalog's attention_flops: 0.5 × (1 + 2.5) / 3.
FLASH_WORK_PER_FLOP = 0.5 * 3.5 / 3
# Power-capped parts (`hardware.power_w`, or the catalog's default_power_w below its TDP): the sustained matmul
# rate scales as (power / TDP) ** POWER_EXPONENT (≤ 1): "capping an H100 at 600 W typically loses 10 to 15 % step
# throughput" (factryze.ai Scale Atlas, "Power Capping"), i.e. 0.875 at 6/7 of 700 W for the middle of that range:
# ln 0.875 / ln(6/7) = 0.87. Not fitted: torchtitan's 500 W H100 rows (bench/published_heldout.yaml) test it.
POWER_EXPONENT = 0.87
# Memory-bound work (norms, activations, residual adds, softmax, RoPE, dropout): passes over the bytes a
# layer saves for backward (plan/activations.py, no recompute) at HBM bandwidth per forward + backward, scaled
# like the FLOPs when recompute repeats a forward (each saved tensor is written by its op, read by the next,
# read again in the backward, and its gradient written and read). Fitted with the efficiencies above; it
# trades off against them (3 and 1 fitted on the two halves, docs/plan.md). It is what makes small
# hidden sizes and unfused attention slower per FLOP than large GEMMs.
ELEMENTWISE_PASSES = 5.0
# Eager stacks (no torch.compile / TE fusion: `plan.kernels: eager`) run each norm, activation, residual add and
# fp8 cast as its own kernel, reading and writing its tensors: their own pass count, fitted on the eager runs of
# the same file (torchtitan's and LLM Foundry's) after the fused one.
ELEMENTWISE_PASSES_EAGER = 17.0
# Mixture-of-experts layers cost a fixed time per layer and micro-batch that no FLOP or byte term prices: a dropless
# dispatcher waits on the host for each expert's token count before it can size the all-to-all and the grouped GEMM
# (NVIDIA/Megatron-LM @d98e8a64dd megatron/core/transformer/moe/token_dispatcher.py: the all-to-all dispatcher's
# `_maybe_dtoh_and_synchronize` at `cuda_sync_point`; fused_a2a.py, the DeepEP path: "the CPU will wait for GPU's
# signal to arrive"), and the router, permutes and their fp8 casts are small launch-bound kernels. Megatron-Bridge's
# MoE guide (NVIDIA-NeMo/Megatron-Bridge docs/training/moe-optimization.md @067f987df) names "small expert GEMMs +
# host overhead" as MoE's compute-efficiency wall, lists "decrease TP or increase MBS" against kernel-launch
# overhead, and allows full CUDA graphs for drop-and-pad MoE (dropless only with device-initiated grouped GEMMs
# among other changes). Seconds per MoE layer per micro-batch (forward + backward), fitted on the MoE throughput
# runs of plan/published_runs.yaml (`moe_runs`, all Megatron/NeMo with EP > 1; bench/plan_accuracy.py, the error
# with one release left out in docs/plan.md). Being fitted, it also absorbs whatever else those MoE layers lost that
# no term prices (load imbalance, small grouped GEMMs, the all-to-all's real cost). `plan.moe_layer_overhead_ms`
# overrides it (0 for a sync-free, CUDA-graphed stack).
MOE_LAYER_OVERHEAD_S = 0.00325
# Whole runs spend GPU time the step-time and failure models do not see: batch-size and sequence-length
# ramps at the start (Llama 3 report §3.4.1), loss-spike rollbacks, stragglers and slow nodes, evaluation
# and data stalls, power-capped fleets (Llama 2 §2.2.1: 350-400 W A100s). The planner's whole-run time
# divides by this share (after the expected goodput). Fitted on the whole-run entries of
# plan/published_runs.yaml (bench/plan_accuracy.py fits it on half of them and reports the error on the rest,
# docs/plan.md); `plan.whole_run_efficiency` overrides it with a fleet's own figure.
DEFAULT_WHOLE_RUN_EFFICIENCY = 0.81
# Latency of one point-to-point send or all-to-all call (start-up, kernel launch): ~10-30 µs on NVLink/IB.
COLLECTIVE_LATENCY_S = 20e-6
# Ring collectives pay a latency per ring step, as NCCL's own tuning model prices them (NVIDIA/nccl
# src/graph/tuning.cc, Simple protocol): a base of 8.4 µs plus 5.7 µs per step over NVLink and 6.6 µs per step
# over the network; an all-reduce may use the tree instead, 50 µs per level over the network. A ring over n
# ranks takes n − 1 steps (2(n − 1) for an all-reduce), a tree 2·log2(n) levels: this is what makes one
# FSDP group over thousands of GPUs slow, and HSDP exist.
RING_BASE_LATENCY_S = 8.4e-6
RING_STEP_LATENCY_S = {"intra": 5.7e-6, "inter": 6.6e-6}
TREE_LEVEL_LATENCY_S = 50e-6
# Device-to-host copy bandwidth per GPU for staging an async checkpoint (PCIe Gen4/5 x16 practical).
HOST_COPY_BYTES_S = 20 * GB


@dataclass(frozen=True)
class PlanInputs:
    """A spec reduced to the numbers the analytic model uses (all SI units: bytes, seconds, FLOP)."""

    shape: ModelShape
    flops: FlopsPerToken
    seq_len: int
    global_batch_tokens: int
    tokens_total: float
    compute_dtype: str
    act_bytes: float  # bytes per activation value (the compute dtype; fp8 training keeps bf16 activations)
    weight_bytes: float  # working copy of the weights used in matmuls
    grad_bytes: float
    master_bytes: float  # a separate fp32 master copy, 0 when the weights are already fp32
    moment_bytes: float  # per Adam moment
    peak_flops: float
    memory_bytes: float
    intra_node_bytes_s: float
    inter_node_bytes_s: float
    memory_bandwidth_bytes_s: float
    gpus_per_node: int
    compute_efficiency: float
    dp_overlap: float
    tp_overlap: float
    ep_overlap: float
    framework_reserve_bytes: float
    flash_attention: bool
    cpu_offload: bool
    accelerator: str
    fused_kernels: bool = False  # fused norm / SwiGLU / RoPE kernels (torch.compile, TE): fewer saved tensors
    fused_loss: bool = False  # a fused cross-entropy: only the compute-dtype logits kept, gradient in place
    linear_input_bytes: float = 2.0  # bytes per cached Linear input (1 with fp8 storage, DeepSeek-V3 §3.3.3)
    grad_sync: str = "every_micro_batch"
    loss_parallel: bool = True  # vocabulary-parallel loss under TP (the trainer's, with or without a pipeline)
    finetune: str = "none"  # none (pretraining) | full | lora | qlora
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    adapter_params: float = 0.0  # LoRA adapter parameters of the whole model (plan/finetune.py)
    dpo_reference: str = "none"  # finetune.method dpo: none | base (LoRA, adapters off) | copy (full DPO)
    preference: bool = False  # finetune.method dpo (DPO or ORPO): data parallelism / FSDP only (spec/rules.py)
    fp8_speedup: float = 1.0  # large-GEMM rate over bf16 for fp8 GEMMs (peak_flops stays the bf16 peak)
    fp8_cast_bytes: float = FP8_CAST_BYTES  # HBM bytes per GEMM operand element that fp8 scaling adds
    power_factor: float = 1.0  # sustained matmul rate at the power limit over the rate at TDP
    attention_flops_s: float = 0.0  # FlashAttention kernel's measured FLOP/s (hardware catalog); 0: the GEMM rate
    moe_node_limit: int | None = None  # nodes a token's experts may span (node-limited routing, plan/dispatch.py)
    elementwise_passes: float = ELEMENTWISE_PASSES  # memory-bound passes over a layer's activations (timing.py)
    moe_layer_overhead_s: float = MOE_LAYER_OVERHEAD_S  # fixed time per MoE layer and micro-batch (timing.py)
    recompute_early_stop: bool = True  # torch's non-reentrant checkpoint (plan.recompute_early_stop)
    fsdp_single_rank: bool = False  # parallelism.fsdp_single_rank: one rank wrapped in FSDP2 all the same

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:  # computed once: the search's caches key on the inputs thousands of times
        return self._hash

    @property
    def compute_flops_s(self) -> float:
        """FLOP/s one GPU sustains on large matmuls: peak × efficiency × power factor (× the fp8 speed-up)."""
        return self.peak_flops * self.compute_efficiency * self.fp8_speedup * self.power_factor

    @property
    def trains_base(self) -> bool:
        """Whether every base weight has gradients and optimizer states (not LoRA/QLoRA)."""
        return self.finetune in ("none", "full")

    @property
    def recompute_skips_down(self) -> bool:
        """Whether full recompute stops before a dense block's down projection (`FlopsPerToken.hardware`): with
        torch's early stop and a plain bf16/fp32 matmul, which saves its input before it runs. A float8 Linear
        (torchao's autograd function saves after its GEMM) and LoRA/QLoRA's base-then-adapter pair run it again."""
        return self.recompute_early_stop and self.compute_dtype != "fp8" and self.trains_base

    def autocast_casts(self, layout: Layout) -> bool:
        """Whether the forward runs under `torch.autocast` over fp32 parameters, where every Linear casts its
        fp32 input to bf16 itself and saves that copy: bf16 compute with fp32 master weights and no FSDP2 (one
        data-parallel rank, no TP, not `fsdp_single_rank`), the trainer's own rule (spec/rules.py
        `forward_autocasts`, `wraps_in_fsdp`). Under FSDP2 the parameters are
        gathered in bf16 and the blocks run in bf16, so the Linears reading one norm share its bf16 output.
        Counted for the eager kernels of a trained base (compile and adapters not measured)."""
        fsdp = wraps_in_fsdp(dp=layout.dp, tp=layout.tp, fsdp_single_rank=self.fsdp_single_rank)
        return (self.compute_dtype == "bf16" and not self.fused_kernels and self.trains_base and forward_autocasts(
            compute="bf16", master_weights="fp32" if self.master_bytes > 0 else "bf16", fsdp=fsdp))

    def hardware_flops_per_token(self, recompute: Recompute) -> float:
        """FLOPs executed per token. LoRA/QLoRA skip the frozen base's weight-gradient matmuls (a third of
        its 6·N) and add the adapters' own 6 FLOPs per adapter parameter."""
        flops = self.flops.hardware(recompute, early_stop=self.recompute_skips_down)
        if not self.trains_base:
            flops += -self.flops.matmul / 3 + 6.0 * self.adapter_params
        if self.dpo_reference != "none":  # DPO: the reference model's forward (2 of the 6 FLOPs per parameter)
            flops += self.flops.matmul / 3
        return flops

    def with_memory(self, memory_bytes: float) -> PlanInputs:
        return replace(self, memory_bytes=memory_bytes)


def default_compute_efficiency(accelerator: str) -> float:
    """The shipped compute efficiency of `accelerator` (fitted for A100 and Hopper, judged for the rest)."""
    for prefix, value in DEFAULT_COMPUTE_EFFICIENCY.items():
        if accelerator.startswith(prefix):
            return value
    return FALLBACK_COMPUTE_EFFICIENCY


def plan_inputs(spec: JobSpec, *, optimizer_state: Literal["fp32", "bf16", "8bit"] | None = None) -> PlanInputs:
    """Resolve a spec once; `optimizer_state` overrides the spec's (the 'what would fit' probe uses it)."""
    shape = resolve_shape(spec.model)
    acc = get_accelerator(spec.hardware.accelerator)
    hw, prec, knobs = spec.hardware, spec.precision, spec.plan
    compute = prec.compute
    act_bytes = 2.0 if compute == "fp8" else DTYPE_BYTES[compute]
    weight_bytes = 2.0 if compute in ("bf16", "fp16", "fp8") else 4.0
    master_bytes = 4.0 if prec.master_weights == "fp32" and weight_bytes < 4 else 0.0
    efficiency = knobs.compute_efficiency or default_compute_efficiency(acc.name)
    fp8_speedup = 1.0
    if hw.peak_flops is not None:
        peak = hw.peak_flops
    elif acc.name == "cpu":
        # CPUs differ by orders of magnitude: measure this host, as the trainer's MFU does. On a CPU a "GPU" is
        # one process, and gpus_per_node processes share the host's cores.
        peak = host_cpu_peak_flops(compute) / hw.gpus_per_node
    else:  # fp8 runs: MFU against the bf16 peak (the trainer's and torchtitan's convention), run faster
        peak = acc.peak_for("bf16" if compute == "fp8" else compute)
        fp8_speedup = (knobs.fp8_speedup or FP8_GEMM_SPEEDUP) if compute == "fp8" else 1.0
    kernels = knobs.kernels
    fused = spec.training.compile if kernels == "auto" else kernels == "fused"
    fused_loss = kernels == "fused" if knobs.fused_loss is None else knobs.fused_loss
    ft = spec.finetune
    return _with_adapters(PlanInputs(
        shape=shape,
        flops=flops_per_token(shape, seq_len=spec.data.seq_len, causal_halving=knobs.causal_halving),
        seq_len=spec.data.seq_len,
        global_batch_tokens=spec.training.global_batch_tokens,
        tokens_total=spec.data.tokens_total,
        compute_dtype=compute,
        act_bytes=act_bytes,
        weight_bytes=weight_bytes,
        grad_bytes=DTYPE_BYTES[prec.grad_reduce] if weight_bytes < 4 else 4.0,
        master_bytes=master_bytes,
        moment_bytes=MOMENT_BYTES[optimizer_state or prec.optimizer_state],
        peak_flops=peak,
        memory_bytes=hw.memory_bytes if hw.memory_bytes is not None else acc.memory_bytes,
        intra_node_bytes_s=(hw.intra_node_bandwidth_gb_s * GB if hw.intra_node_bandwidth_gb_s
                            else acc.intra_node_bandwidth_bytes_s),
        inter_node_bytes_s=(hw.inter_node_bandwidth_gb_s * GB if hw.inter_node_bandwidth_gb_s
                            else acc.inter_node_bandwidth_bytes_s),
        memory_bandwidth_bytes_s=acc.memory_bandwidth_bytes_s,
        gpus_per_node=hw.gpus_per_node,
        compute_efficiency=efficiency,
        dp_overlap=knobs.dp_overlap,
        tp_overlap=knobs.tp_overlap,
        ep_overlap=knobs.ep_overlap,
        framework_reserve_bytes=knobs.framework_reserve_gb * GB,
        flash_attention=knobs.flash_attention,
        cpu_offload=spec.parallelism.cpu_offload,
        accelerator=acc.name,
        fused_kernels=fused,
        fused_loss=fused_loss,
        linear_input_bytes=1.0 if compute == "fp8" and fused else act_bytes,
        grad_sync=spec.parallelism.grad_sync,
        loss_parallel=spec.parallelism.loss_parallel,
        finetune=ft.weights if spec.task == "finetune" else "none",  # dpo: the weights it trains
        lora_rank=ft.lora.rank if ft.weights in ("lora", "qlora") else 0,
        lora_targets=tuple(ft.lora.targets),
        lora_dropout=ft.lora.dropout,
        dpo_reference=("copy" if ft.weights == "full" else "base") if spec.task == "finetune" and ft.method == "dpo"
        and ft.dpo.loss != "orpo" else "none",  # ORPO has no reference model
        preference=spec.finetune.method == "dpo",
        fp8_speedup=fp8_speedup,
        power_factor=_power_factor(acc, hw.power_w),
        attention_flops_s=(acc.attention_flops or 0.0) if hw.peak_flops is None else 0.0,
        moe_node_limit=knobs.moe_node_limit,
        elementwise_passes=(ELEMENTWISE_PASSES if fused else ELEMENTWISE_PASSES_EAGER)
        if knobs.elementwise_passes is None else knobs.elementwise_passes,
        # a CPU has no device waiting on the host: its op dispatch is in the measured CPU efficiency
        moe_layer_overhead_s=(0.0 if acc.name == "cpu" else MOE_LAYER_OVERHEAD_S) if knobs.moe_layer_overhead_ms is None
        else knobs.moe_layer_overhead_ms / 1e3,
        recompute_early_stop=knobs.recompute_early_stop,
        fsdp_single_rank=spec.parallelism.fsdp_single_rank,
    ))


def _power_factor(acc: Accelerator, power_w: float | None) -> float:
    """Sustained matmul rate at the GPU's power limit over its rate at TDP (POWER_EXPONENT)."""
    power = power_w if power_w is not None else acc.default_power_w
    if power is None:
        return 1.0
    if acc.tdp_w is None:
        raise UserInputError(f"hardware.power_w: the catalog has no TDP for {acc.name}; leave power_w unset")
    return min(1.0, power / acc.tdp_w) ** POWER_EXPONENT


def _with_adapters(inputs: PlanInputs) -> PlanInputs:
    if not inputs.lora_rank:
        return inputs
    count = lora_param_count(inputs.shape, rank=inputs.lora_rank, targets=inputs.lora_targets)
    return replace(inputs, adapter_params=count)


def sequences_per_step(inputs: PlanInputs) -> int:
    """Sequences in one optimizer step (the global batch in sequences, at least one)."""
    return max(1, math.ceil(inputs.global_batch_tokens / inputs.seq_len))
