"""AdamW with fp32, bf16 or 8-bit moment states, and the weight-decay grouping.

- fp32 states: `torch.optim.AdamW`, fused (one kernel per parameter group, on CUDA and on the CPU).
- bf16 states: `AdamWBf16States` below — moments stored in bf16, updated in fp32 arithmetic
  (half the optimizer memory; torch's AdamW keeps states in the parameter dtype, so it cannot do this).
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
        return AdamWBf16States(groups, **kwargs)
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


class AdamWBf16States(Optimizer):
    """AdamW (decoupled decay, Loshchilov & Hutter 2019) whose moments are stored in bf16.

    Arithmetic is fp32: moments are upcast, updated, and rounded back each step. Parameters keep their own
    dtype (fp32 master weights in the default policy). Bias corrections are computed on the device from the
    step tensor (no host read); `found_inf` (set by `step_if_finite`) masks a step on the device.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamWBf16States does not take a closure")
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                keep = None if found_inf is None else 1.0 - found_inf.to(state["step"].device)
                state["step"] += 1 if keep is None else keep
                step = state["step"]
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = (1 - torch.pow(beta1, step)).to(grad.device)
                bias2 = (1 - torch.pow(beta2, step)).to(grad.device)
                denom = (exp_avg_sq / bias2).sqrt_().add_(group["eps"])
                update = exp_avg / bias1 / denom
                master = p.float()
                master.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                if keep is None:
                    state["exp_avg"].copy_(exp_avg)
                    state["exp_avg_sq"].copy_(exp_avg_sq)
                    p.copy_(master)
                    continue
                keep_here = keep.to(grad.device).bool()
                state["exp_avg"].copy_(torch.where(keep_here, exp_avg, state["exp_avg"].float()))
                state["exp_avg_sq"].copy_(torch.where(keep_here, exp_avg_sq, state["exp_avg_sq"].float()))
                p.copy_(torch.where(keep_here, master, p.float()))
