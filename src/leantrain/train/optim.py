"""AdamW with fp32, bf16 or 8-bit moment states, and the weight-decay grouping.

- fp32 states: `torch.optim.AdamW`, fused (one kernel per parameter group, on CUDA and on the CPU).
- bf16 states: `AdamWBf16States` below — moments stored in bf16, updated in fp32 arithmetic with multi-tensor
  kernels and written back with stochastic rounding (half the optimizer memory; torch's AdamW keeps states in
  the parameter dtype, so it cannot do this).
- 8bit states: torchao's `AdamW8bit` (block-wise quantised moments, as bitsandbytes); refused clearly
  when torchao is missing. Its first step compiles the update (seconds to tens of seconds on a CPU).
Weight decay applies to matrices only (≥ 2 dims: linear and expert weights, embeddings), not to norm
gains — the usual choice (GPT-2/nanoGPT, torchtitan).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from leantrain.errors import UserInputError
from leantrain.spec.schema import PrecisionSpec, TrainingSpec


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed matrices and undecayed vectors (norm weights)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, training: TrainingSpec, precision: PrecisionSpec, *, device: torch.device
) -> Optimizer:
    """The spec's AdamW; the LR set here is the peak, the scheduler scales it."""
    groups = param_groups(model, weight_decay=training.weight_decay)
    kwargs: dict[str, Any] = {"lr": training.lr, "betas": (training.beta1, training.beta2), "eps": 1e-8}
    if precision.optimizer_state == "fp32":
        return torch.optim.AdamW(groups, **kwargs, fused=True)
    if precision.optimizer_state == "bf16":
        return AdamWBf16States(groups, **kwargs, seed=training.seed)
    return _adamw_8bit(groups, kwargs)


def step_if_finite(optimizer: Optimizer, finite: torch.Tensor) -> None:
    """`optimizer.step()` when `finite` (a 0-dim bool tensor on the device) is true, else no change at all.

    torch's fused AdamW and `AdamWBf16States` skip on the device: they take `found_inf` as under torch's
    GradScaler (the update and the step count are masked in the kernel), so the host never waits for the flag.
    Other optimizers (torchao's AdamW8bit) read the flag on the host: one sync per step.
    """
    if isinstance(optimizer, AdamWBf16States) or (
            isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused")):
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
        optimizer.step()
        return
    if bool(finite):
        optimizer.step()


def _adamw_8bit(groups: list[dict[str, Any]], kwargs: dict[str, Any]) -> Optimizer:
    try:
        from torchao.optim import AdamW8bit
    except ImportError as err:
        raise UserInputError(
            "precision.optimizer_state: 8bit needs torchao (pip install torchao, next to your torch); "
            f"it could not be imported ({err}). Use fp32 or bf16."
        ) from None
    # torchao keeps the LR as a tensor so a scheduler changing it does not recompile the update.
    return AdamW8bit(groups, **kwargs)


# Parameters are updated in chunks of at most this many local elements: the fp32 temporaries of one update
# (moments, denominator, update, new value) then stay near 6 x 4 B x CHUNK_ELEMENTS (1.5 GiB) however large the
# shard, while the kernel count stays a few per chunk (torch's foreach AdamW takes whole lists at once).
CHUNK_ELEMENTS = 2**26


def stochastic_round_bf16(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (fp32) in bf16, rounded up or down at random with the odds of its distance to each (unbiased:
    E[round(x)] = x), so that updates smaller than half a bf16 step are not all lost, as with round-to-nearest.

    The technique of "Revisiting BFloat16 Training" (Zamirai et al., 2020) and of torchao's bf16 optimizers
    (`bf16_stochastic_round`, torchao/optim/quant_utils.py): 16 random bits are added to the low half of the fp32
    pattern and the low half is dropped. Non-finite values are kept as they are."""
    bits = x.float().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = ((bits + noise) & -(1 << 16)).view(torch.float32)  # the low 16 bits dropped: exact in bf16
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the optimizer's arithmetic is elementwise: no placement needs to be known)."""
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWBf16States(Optimizer):
    """AdamW (decoupled decay, Loshchilov & Hutter 2019) whose moments are stored in bf16.

    Arithmetic is fp32: moments are upcast, updated, and rounded back each step. Parameters keep their own
    dtype (fp32 master weights in the default policy). Bias corrections are computed on the device from the
    step tensors (no host read); `found_inf` (set by `step_if_finite`) masks a step on the device.

    One step runs torch's multi-tensor (`torch._foreach_*`) kernels on the local shards, per (device, dtype)
    bucket, as torch's own `foreach` AdamW does: no per-parameter DTensor dispatch. With `stochastic_rounding`
    (the default) every bf16 value written (moments; parameters when they are bf16) is rounded stochastically
    (`stochastic_round_bf16`); the noise comes from a generator seeded from (`seed`, the step number, the group),
    so a run is reproducible and resumes exactly (the step number is saved with the group). Not from the rank: the
    copies of a parameter on several ranks (data-parallel replicas at ZeRO-0 and under HSDP, norms and routers on
    tensor-parallel peers) hold the same tensors in the same order, so they draw the same noise and stay equal;
    seeded per rank they drifted apart (rounded differently from the same gradients).
    torchao's `_AdamW(bf16_stochastic_round=True)` does not fit here: its states take the parameter's dtype
    (fp32 with fp32 masters), it compiles one function per parameter, and it has no `found_inf`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "rounding_step": 0})
        self.stochastic_rounding, self.seed = stochastic_rounding, seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, *, group_index: int, step: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed(hash((self.seed, step, group_index)) & (2**63 - 1))  # ints: the same on every rank
        return generator

    def _bf16(self, values: list[torch.Tensor], generator: torch.Generator | None) -> list[torch.Tensor]:
        if generator is None:
            return [v.to(torch.bfloat16) for v in values]
        return [stochastic_round_bf16(v, generator=generator) for v in values]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamWBf16States does not take a closure")
        found_inf = getattr(self, "found_inf", None)
        for group_index, group in enumerate(self.param_groups):
            group["rounding_step"] = group.get("rounding_step", 0) + 1  # absent in checkpoints from before
            buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = _local(p)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                chunks = buckets.setdefault((local.device, local.dtype), [[]])
                if chunks[-1] and sum(_local(q).numel() for q in chunks[-1]) + local.numel() > CHUNK_ELEMENTS:
                    chunks.append([])
                chunks[-1].append(p)
            for (device, dtype), chunks in buckets.items():
                generator = (self._generator(device, group_index=group_index, step=group["rounding_step"])
                             if self.stochastic_rounding else None)
                for params in chunks:
                    self._update(params, group, found_inf=found_inf, device=device, generator=generator,
                                 round_params=generator if dtype == torch.bfloat16 else None)

    def _update(self, params: list[torch.Tensor], group: dict[str, Any], *, found_inf: torch.Tensor | None,
                device: torch.device, generator: torch.Generator | None,
                round_params: torch.Generator | None) -> None:
        """One AdamW step of `params` (one device and dtype) with multi-tensor kernels on their local shards."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        keep = None if found_inf is None else 1.0 - found_inf.to(steps[0].device)
        if keep is None:
            torch._foreach_add_(steps, 1)
        else:  # the list overload: a 0-dim tensor as the scalar operand is read on the host (a sync per step)
            torch._foreach_add_(steps, [keep] * len(steps))
        local_params = [_local(p) for p in params]
        grads = [_local(p.grad).float() for p in params]  # type: ignore[union-attr]
        moments = [_local(s["exp_avg"]) for s in states]
        squares = [_local(s["exp_avg_sq"]) for s in states]
        exp_avg = [m.float() for m in moments]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        exp_avg_sq = [v.float() for v in squares]
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        on_device = [s.to(device) for s in steps]
        bias1 = torch._foreach_pow(beta1, on_device)  # 1 - beta**step, from the step tensors
        bias2 = torch._foreach_pow(beta2, on_device)
        for bias in (bias1, bias2):
            torch._foreach_neg_(bias)
            torch._foreach_add_(bias, 1)
        denom = torch._foreach_div(exp_avg_sq, bias2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(exp_avg, bias1)
        torch._foreach_div_(update, denom)
        master = torch._foreach_mul([p.float() for p in local_params], 1 - lr * decay)  # new tensors: `p` kept
        torch._foreach_add_(master, update, alpha=-lr)
        new_params = self._bf16(master, round_params) if round_params is not None else master
        writes = ((moments, self._bf16(exp_avg, generator)), (squares, self._bf16(exp_avg_sq, generator)),
                  (local_params, new_params))
        if keep is None:
            for old, new in writes:
                torch._foreach_copy_(old, new)
            return
        # A skipped step (found_inf) leaves every value as it was, decided on the device: a masked copy (torch has
        # no multi-tensor `where`; these are local tensors, so one plain kernel each).
        keep_here = keep.to(device).bool()
        for old, new in writes:
            torch._foreach_copy_(old, [torch.where(keep_here, n, o) for o, n in zip(old, new, strict=True)])
