"""Mixed precision: which dtype the weights live in, which dtype matmuls run in, and what is refused.

- compute bf16 + master fp32 (the default): parameters, gradients and optimizer updates stay fp32;
  forward/backward matmuls run in bf16. Under FSDP (ZeRO-3) that is FSDP2's MixedPrecisionPolicy: the fp32
  shard is gathered as bf16 and gradients are reduced in `precision.grad_reduce`, with no autocast around the
  forward. Without FSDP the forward runs under `torch.autocast`. Either way this is what "bf16 with fp32
  master weights" means in Megatron/torchtitan terms, with no separate copy to keep in sync.
- master bf16: parameters themselves are bf16 (half the memory, less exact updates).
- fp8: torchao's float8 training (dynamic tensor-wise scaling) for the Linear layers, on GPUs with fp8
  tensor cores (compute capability ≥ 8.9); everything else runs in bf16 exactly as above (FSDP2 mixed
  precision, or autocast without FSDP). Under FSDP2 the float8 weights are all-gathered in float8
  (`enable_fsdp_float8_all_gather`) and their scales are computed for all layers in one go after each
  optimizer step (`precompute_float8_dynamic_scale_for_fsdp`), as torchtitan does. MFU is measured against
  the bf16 peak (torchtitan's convention: fp8 shows up as a higher MFU, not a moved goalpost). Under tensor
  parallelism the float8 Linear layers take torchao's float8 TP styles (parallel.tensor). The router gate and
  the output head stay in bf16 (torchtitan's filter). On the CPU `torch._scaled_mm` has a kernel, so fp8 runs
  there too (slowly: for tests and rehearsals, the numerics are the GPU's); other devices and GPUs below
  compute capability 8.9 are refused.
- fp16 needs loss scaling, which this trainer does not implement: refused, pointing to bf16.
- On CUDA, fp32 matmuls (the fp32 compute mode, the optimizer's own math) use TF32 tensor cores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from leantrain.dtypes import DTYPES
from leantrain.errors import UserInputError
from leantrain.spec.rules import float8_gemm_dims, forward_autocasts, rows_fill_every_shard
from leantrain.spec.schema import PrecisionSpec

FP8_MIN_CAPABILITY = (8, 9)  # Ada/Hopper and newer have fp8 tensor cores


@dataclass(frozen=True)
class PrecisionPolicy:
    """The resolved numeric formats for one device."""

    compute: str  # fp32 | bf16 | fp8
    param_dtype: torch.dtype
    device_type: str

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The context each forward runs in: bf16 autocast for bf16 and for the non-float8 part of fp8 (float8
        Linear layers cast their own inputs), nothing for fp32 or bf16 master weights."""
        if self.compute in ("bf16", "fp8") and self.param_dtype != torch.bfloat16:
            return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_context(self, *, fsdp: bool) -> Callable[[], contextlib.AbstractContextManager[None]]:
        """What each forward runs in, by the rule the planner also reads (spec/rules.py `forward_autocasts`):
        `autocast` without FSDP2; under FSDP2's mixed precision the weights are gathered in bf16 already, and
        autocast would only add casts."""
        master = "bf16" if self.param_dtype == torch.bfloat16 else "fp32"
        autocasts = forward_autocasts(compute=self.compute, master_weights=master, fsdp=fsdp)
        return self.autocast if autocasts else contextlib.nullcontext

    @property
    def peak_dtype(self) -> str:
        """The dtype whose catalog peak MFU is measured against: bf16 for fp8 runs (torchtitan's convention)."""
        return "bf16" if self.compute == "fp8" else self.compute


def resolve_precision(spec: PrecisionSpec, *, device: torch.device) -> PrecisionPolicy:
    """Check the spec's formats against the device and return the policy, or refuse with the field named."""
    if spec.compute == "fp16":
        raise UserInputError(
            "precision.compute: fp16 needs dynamic loss scaling, which this trainer does not implement; "
            "use bf16 (same speed on every GPU with fp16 tensor cores since A100) or fp32"
        )
    if spec.compute == "fp8":
        _check_fp8_device(device)
    if spec.compute == "fp32" and spec.master_weights == "bf16":
        raise UserInputError("precision.master_weights: bf16 with compute fp32 is contradictory; use compute: bf16")
    return PrecisionPolicy(compute=spec.compute, param_dtype=DTYPES[spec.master_weights], device_type=device.type)


def _check_fp8_device(device: torch.device) -> None:
    if device.type == "cpu":  # torch._scaled_mm's CPU kernel: the same float8 GEMMs, for tests and rehearsals
        return
    if device.type != "cuda":
        raise UserInputError(
            f"precision.compute: fp8 needs a GPU with fp8 tensor cores (compute capability ≥ 8.9, e.g. H100); "
            f"this run is on {device.type}. Use bf16 or fp32 here."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise UserInputError(
            f"precision.compute: fp8 needs compute capability ≥ 8.9; {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}. Use bf16."
        )


def fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """Which Linear layers go to float8: dims divisible by 16 (the fp8 GEMM's rule), not the output head and not
    an MoE router's gate (its logits pick the experts: torchtitan leaves both in bf16)."""
    if not isinstance(module, nn.Linear) or fqn == "output" or fqn.endswith("router.gate"):
        return False
    return float8_gemm_dims(module.out_features, module.in_features)


def fills_every_shard(module: nn.Module, *, shards: int, tp: int, colwise: bool) -> bool:
    """Whether FSDP2's chunks of this Linear's weight rows (dim 0, after tensor parallelism's split of them)
    leave no rank empty (`spec.rules.rows_fill_every_shard`, which the planner counts by too). Only a column-wise
    Linear has its rows split by TP (`colwise`); a row-wise one (wo, w2) keeps all of them and splits its columns,
    and one TP leaves whole (MLA's latents) keeps both."""
    return rows_fill_every_shard(module.out_features // max(tp, 1) if colwise else module.out_features, shards)


def apply_precision(
    model: nn.Module, policy: PrecisionPolicy, *, swap: bool = True, cast: bool = True,
    fsdp_float8_all_gather: bool = False, fsdp_shards: int = 1, tp: int = 1, tp_colwise: Collection[str] | None = None,
) -> nn.Module:
    """Swap Linear layers to float8 (fp8; on the meta device, before parallelize) and cast parameters to the
    master dtype (buffers such as RoPE tables and expert counts stay fp32). Returns the model.

    `fsdp_float8_all_gather`: the model will be FSDP2-sharded (`fsdp_shards` ranks, after `tp`), so the float8
    weights are gathered in float8 — except a layer with too few rows to give every rank some: torchao's float8
    all-gather and its one-shot scale precompute take each rank's local amax (`_foreach_norm(ord=inf)`,
    `max(abs)`), which an empty shard cannot give (it raises, on the GPU as on the CPU); such layers gather in
    the master dtype and still compute in float8. Found by rehearsing DeepSeek-V3 at 2,048 ranks (FSDP128).
    `tp_colwise`: the Linears TP splits by rows (`parallel.tensor.colwise_linears`); None counts every Linear as
    split, which gathers some whose rows would fill every rank in the master dtype (never the other way).
    """
    if swap and policy.compute == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def fp8(gathered: bool) -> Callable[[nn.Module, str], bool]:
            def accept(module: nn.Module, fqn: str) -> bool:
                if not fp8_linear_filter(module, fqn):
                    return False
                split = tp_colwise is None or fqn in tp_colwise
                return not fsdp_float8_all_gather or fills_every_shard(
                    module, shards=fsdp_shards, tp=tp, colwise=split) == gathered
            return accept

        for gathered in (True, False) if fsdp_float8_all_gather else (False,):
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=gathered)
            convert_to_float8_training(model, config=config, module_filter_fn=fp8(gathered))
    if cast and policy.param_dtype != torch.float32:
        for param in model.parameters():
            param.data = param.data.to(policy.param_dtype)
    return model


def float8_post_step(parts: list[nn.Module], policy: PrecisionPolicy, *, fsdp: bool) -> Callable[[], None]:
    """What runs after each optimizer step: under fp8 + FSDP2, torchao's one-shot scale precompute for the
    float8 all-gather (one all-reduce for every layer instead of one per layer); otherwise nothing."""
    if policy.compute != "fp8" or not fsdp:
        return lambda: None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute() -> None:
        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return precompute


def enable_tf32(device: torch.device) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores on CUDA (torch leaves matmuls at full fp32)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
