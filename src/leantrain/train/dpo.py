"""Direct preference optimisation (`finetune.method: dpo`; Rafailov et al. 2023, "Direct Preference Optimization").

Data: `format: preference` sources (data/preference.py): each micro-batch of `micro_batch` rows is
micro_batch / 2 pairs, chosen rows first, then rejected rows, with targets outside the responses set to
IGNORE_INDEX. A sequence's log-probability is the sum of its response tokens' log-probabilities.

The reference model, in a pass without gradients before each step's forward/backward:
- lora / qlora (`finetune.dpo.weights`): the policy itself with its adapters off (their scale set to 0 for the
  pass: the frozen base is exactly the reference), so the reference costs no memory, as TRL's and
  torchtune's LoRA DPO do;
- full: a frozen copy of the init_from weights, built and sharded like the policy (its parameters once more
  per rank, no gradients or optimizer state; the planner counts it, plan/finetune.py).

Loss (per pair, mean over the micro-batch's pairs, as TRL's DPOTrainer): with Δ = (log π(y_c) − log π_ref(y_c))
− (log π(y_r) − log π_ref(y_r)), `sigmoid`: −log σ(β Δ); `ipo`: (Δ_c/|y_c| − Δ_r/|y_r| − 1/(2β))², the log-ratios
per response token (TRL's normalisation). Metrics, means over the log window's pairs on every rank:
`rewards/chosen` = β (log π(y_c) − log π_ref(y_c)), `rewards/rejected` likewise, `rewards/margin` = their
difference, `rewards/accuracy` = the share of pairs with chosen reward > rejected reward.

`orpo` (Hong et al. 2024, TRL's ORPOTrainer) uses no reference model (no reference pass, no copy): the chosen
responses' token-mean NLL − β · log σ(log odds(ȳ_c) − log odds(ȳ_r)), ȳ the per-token mean log-probability;
its rewards are β · ȳ.

Runs on one process and under FSDP2 / data parallelism (the reference pass is one more forward of the same
sharded model); tensor and pipeline parallelism are refused (spec/rules.py). Nothing here has state: a
resumed run rebuilds the reference from init_from and continues bit for bit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.model.lora import LoRALinear
from leantrain.spec.schema import JobSpec
from leantrain.train.step_metrics import IGNORE_INDEX

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
STATS = 5  # sums over pairs: chosen reward, rejected reward, margin, correct, and the number of pairs


def enabled(spec: JobSpec) -> bool:
    return spec.task == "finetune" and spec.finetune.method == "dpo"


@contextlib.contextmanager
def adapters_off(modules: list[nn.Module]) -> Iterator[None]:
    """The LoRA layers' updates switched off (scale 0) inside the block: the frozen base model."""
    layers = [m for part in modules for m in part.modules() if isinstance(m, LoRALinear)]
    scales = [layer.scale for layer in layers]
    for layer in layers:
        layer.scale = 0.0
    try:
        yield
    finally:
        for layer, scale in zip(layers, scales, strict=True):
            layer.scale = scale


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's target tokens, their count), both (rows,) fp32; targets that are
    IGNORE_INDEX count nothing. logits (rows, seq, vocab), targets (rows, seq)."""
    token_logps = -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none",
                                   ignore_index=IGNORE_INDEX).view(targets.shape)  # (rows, seq), 0 where ignored
    return token_logps.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1).float()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, without cancellation (switching at −ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(policy: torch.Tensor, counts: torch.Tensor, *, beta: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (Hong et al. 2024), as TRL's ORPOTrainer: the chosen responses' token-mean NLL minus β · log σ of the
    log odds ratio of the per-token mean log-probabilities. Returns (per-pair loss whose mean is the loss,
    chosen rewards β·mean log p(y_c), rejected rewards), each (pairs,)."""
    chosen_count, _ = counts.chunk(2)
    mean_chosen, mean_rejected = (policy / counts.clamp(min=1.0)).chunk(2)
    nll = -policy.chunk(2)[0].sum() / chosen_count.sum().clamp(min=1.0)
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    per_pair = nll - beta * F.logsigmoid(log_odds)
    return per_pair, beta * mean_chosen.detach(), beta * mean_rejected.detach()


def pair_loss(policy: torch.Tensor, reference: torch.Tensor | None, counts: torch.Tensor, *, beta: float,
              loss: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen rewards, rejected rewards), each (pairs,), from per-row log-probabilities
    (rows = chosen rows then rejected rows) and response token counts."""
    if loss == "orpo":
        return orpo_loss(policy, counts, beta=beta)
    assert reference is not None, "sigmoid and ipo compare with the reference model's log-probabilities"
    chosen_ratio, rejected_ratio = (policy - reference).chunk(2)
    if loss == "ipo":
        chosen_count, rejected_count = counts.chunk(2)
        delta = chosen_ratio / chosen_count.clamp(min=1.0) - rejected_ratio / rejected_count.clamp(min=1.0)
        per_pair = (delta - 1 / (2 * beta)) ** 2
    else:
        per_pair = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return per_pair, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


class DpoLoss:
    """The loss function the parallel model calls on each micro-batch's logits, in micro-batch order; the
    reference log-probabilities of those micro-batches were computed before. Keeps, like SourceLoss,
    `loss_sum` and `tokens` per source (here: DPO loss summed over pairs, and pairs) and the reward sums."""

    def __init__(self, reference: list[torch.Tensor | None], *, beta: float, loss: str, num_sources: int,
                 device: torch.device) -> None:
        self.reference, self.beta, self.loss = reference, beta, loss
        self.loss_sum = torch.zeros(num_sources, device=device)
        self.tokens = torch.zeros(num_sources, device=device)
        self.stats = torch.zeros(STATS, device=device)
        self._next = 0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        reference = self.reference[self._next]
        self._next += 1
        policy, counts = sequence_logps(logits, targets[..., 0])
        per_pair, chosen, rejected = pair_loss(policy, reference, counts, beta=self.beta, loss=self.loss)
        sources = targets[: len(per_pair), 0, 1]  # a pair's source: its chosen row's
        self.loss_sum.index_add_(0, sources, per_pair.detach())
        self.tokens.index_add_(0, sources, torch.ones_like(per_pair))
        self.stats += torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                                   (chosen > rejected).float().sum(), torch.ones_like(chosen).sum()])
        return per_pair.mean()


class DpoObjective:
    """Builds each step's DpoLoss: the reference pass over the step's micro-batches (module docstring)."""

    def __init__(self, spec: JobSpec, *, policy: Any, reference: Any | None, autocast: Any,
                 num_sources: int) -> None:
        self.beta, self.loss = spec.finetune.dpo.beta, spec.finetune.dpo.loss
        self.policy, self.reference, self.autocast = policy, reference, autocast
        self.num_sources = num_sources

    @torch.no_grad()
    def reference_logps(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device = self.policy.device
        if self.reference is not None:
            model, context = self.reference.model, contextlib.nullcontext()
        else:
            model, context = self.policy.model, adapters_off(self.policy.parts)
        with context, self.autocast():
            logits = model(inputs.to(device))  # (rows, seq, vocab)
        return sequence_logps(logits, targets[..., 0].to(device))[0]

    def loss_fn(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> DpoLoss:
        reference: list[torch.Tensor | None] = [None] * len(micro_batches)  # ORPO needs no reference model
        if self.loss != "orpo":
            reference = [self.reference_logps(inputs, targets) for inputs, targets in micro_batches]
        return DpoLoss(reference, beta=self.beta, loss=self.loss, num_sources=self.num_sources,
                       device=self.policy.device)

    @staticmethod
    def metrics(stats: torch.Tensor) -> dict[str, float]:
        """The log record's reward means from the window's summed stats (already summed over ranks)."""
        chosen, rejected, margin, correct, pairs = stats.tolist()
        pairs = max(pairs, 1.0)
        return dict(zip(METRICS, (chosen / pairs, rejected / pairs, margin / pairs, correct / pairs), strict=True))


def build_objective(trainer: Any) -> DpoObjective | None:
    """The trainer's DPO objective (None unless finetune.method is dpo); full DPO builds the frozen reference."""
    spec = trainer.spec
    if not enabled(spec):
        return None
    reference = None
    if spec.finetune.dpo.weights == "full" and spec.finetune.dpo.loss != "orpo":
        from leantrain.train.build import build_parallel_model
        from leantrain.train.finetune import weights_loader

        reference = build_parallel_model(spec, dims=trainer.dims, precision=trainer.precision,
                                         runtime=trainer.runtime, num_microbatches=trainer.accum_steps,
                                         load=weights_loader(spec)).parallel
        for param in reference.parameters():
            param.requires_grad_(False)
        reference.train(False)
    return DpoObjective(spec, policy=trainer.parallel, reference=reference, autocast=trainer.autocast,
                        num_sources=len(trainer.sampler.source_names))
