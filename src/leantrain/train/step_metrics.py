"""What one optimizer step produced, the sums of a log window, and the numbers a logged record derives from them.

The throughput of a window counts training steps only: held-out evaluation, checkpoint saves and the one
profiled step (the collective timing of a logged step) happen inside the window's wall time but are measured
on their own and taken out, each reported under its own key (`eval_s`, `ckpt_save_s`, `profile_step_s`).
So `step_time_s × steps_timed + eval_s + ckpt_save_s + profile_step_s = window_s` (up to the loop's own
few microseconds), and `tokens_per_s`/`mfu` do not move when evaluation or saving is switched on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from leantrain.observe.report_data import PER_RANK_KEYS  # world-size-long lists: in metrics.jsonl, not kept here


@dataclass
class StepResult:
    """What one optimizer step produced (loss tensors stay on the device until a log step reads them)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor  # 0-dim bool on the device: the optimizer step was skipped (non-finite gradients)
    data_wait_s: float
    comm_s: float | None  # measured on log steps of a multi-rank run (the profiled step), else None
    aux_loss: torch.Tensor | None = None
    source_loss_sum: torch.Tensor | None = None
    source_tokens: torch.Tensor | None = None
    moe_counts: torch.Tensor | None = None
    step_s: float = 0.0  # this step's wall time (with the device synchronised around it when profiled)
    objective_stats: torch.Tensor | None = None  # sums an objective logs (DPO's rewards: train/dpo.py)


def _add(total: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return total
    return value.clone() if total is None else total + value


@dataclass
class LogWindow:
    """Sums between two log steps; `excluded_s()` is the time that is not training.

    Losses and the skipped count stay on the device (tensors) until the log step reads them once: adding a
    step never waits for the device.
    """

    start_s: float = field(default_factory=time.perf_counter)
    steps: int = 0
    skipped: torch.Tensor | int = 0
    loss_sum: torch.Tensor | float = 0.0
    aux_sum: torch.Tensor | float = 0.0
    data_wait_s: float = 0.0
    comm_s: float = 0.0
    eval_s: float = 0.0
    ckpt_save_s: float = 0.0
    profile_step_s: float = 0.0
    profiled_steps: int = 0
    source_loss: torch.Tensor | None = None
    source_tokens: torch.Tensor | None = None
    moe_counts: torch.Tensor | None = None
    objective_stats: torch.Tensor | None = None

    def add(self, result: StepResult) -> None:
        self.steps += 1
        skipped = torch.as_tensor(result.skipped, device=result.loss.device)
        kept = (~skipped).float()
        self.skipped = self.skipped + skipped.long()
        self.data_wait_s += result.data_wait_s
        if result.comm_s is not None:  # one profiled step per window (the logged one)
            self.comm_s = result.comm_s
            self.profile_step_s += result.step_s
            self.profiled_steps += 1
        # A skipped step's (non-finite) loss is masked out, not branched on.
        self.loss_sum = self.loss_sum + torch.nan_to_num(result.loss.detach().float() * kept, nan=0.0)
        if result.aux_loss is not None:
            self.aux_sum = self.aux_sum + torch.nan_to_num(result.aux_loss.detach().float() * kept, nan=0.0)
        if result.source_loss_sum is not None:
            self.source_loss = _add(self.source_loss, torch.nan_to_num(result.source_loss_sum * kept, nan=0.0))
        if result.source_tokens is not None:
            self.source_tokens = _add(self.source_tokens, result.source_tokens * kept)
        self.moe_counts = _add(self.moe_counts, result.moe_counts)
        if result.objective_stats is not None:
            self.objective_stats = _add(self.objective_stats, torch.nan_to_num(result.objective_stats * kept, nan=0.0))

    def timing(self, *, now_s: float | None = None) -> dict[str, float | int]:
        """The window's time split: `window_s`, the excluded parts, and the training steps' mean `step_time_s`.

        When every step of the window was profiled (a window of one step) the profiled step is all there is:
        it is then the step time (and still reported as `profile_step_s`).
        """
        window_s = (time.perf_counter() if now_s is None else now_s) - self.start_s
        steps_timed = self.steps - self.profiled_steps
        train_s = window_s - self.eval_s - self.ckpt_save_s - self.profile_step_s
        if steps_timed <= 0:
            steps_timed, train_s = self.steps, self.profile_step_s
        return {
            "window_s": window_s, "steps_timed": steps_timed, "step_time_s": max(train_s, 1e-9) / max(1, steps_timed),
            "eval_s": self.eval_s, "ckpt_save_s": self.ckpt_save_s, "profile_step_s": self.profile_step_s,
        }


IGNORE_INDEX = -100  # cross_entropy's default: a target outside the loss mask


class SourceLoss:
    """The loss function the parallel model calls on each micro-batch's logits (on every rank, or on the last
    pipeline stage): returns the mean token loss and adds per-source loss sums and token counts on the side.

    Targets carry each token's source id in a last channel, `(batch, seq, 2)` = (next token, source), so the
    pipeline schedule cuts them into micro-batches together with the tokens.

    Masked (chat) data in a training step: `token_scale` = dp × micro-batches / (valid tokens of the whole step,
    summed over the data-parallel ranks), a device scalar. The micro-batch loss returned is its token-loss sum
    times it, so after the 1/micro-batches of accumulation and FSDP's 1/dp the gradient is that of the sum over
    the step's valid tokens divided by their global count: a token weighs the same whatever the micro-batch
    size and the data-parallel layout (torchtitan's `global_valid_tokens`). Unmasked data has the same count in
    every micro-batch, where the plain mean is already that.
    """

    def __init__(self, num_sources: int, *, device: torch.device, masked: bool = False,
                 token_scale: torch.Tensor | None = None) -> None:
        self.num_sources, self.masked, self.token_scale = num_sources, masked, token_scale
        self.loss_sum = torch.zeros(num_sources, device=device)
        self.tokens = torch.zeros(num_sources, device=device)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets[..., 0].flatten(), reduction="none")
        detached = token_loss.detach()
        if isinstance(detached, DTensor):  # loss parallel: the per-token losses of the vocabulary-split logits
            detached = detached.full_tensor()
        sources = targets[..., 1].flatten()
        self.loss_sum.index_add_(0, sources, detached)
        # Token counts by scatter-add, not bincount or a boolean mask: both read sizes on the host (a sync).
        if not self.masked:
            self.tokens.index_add_(0, sources, torch.ones_like(detached))
            return token_loss.mean()
        # Chat data: targets outside the loss mask are IGNORE_INDEX (their loss is 0); the mean is over the rest.
        valid = (targets[..., 0].flatten() != IGNORE_INDEX).to(detached.dtype)
        self.tokens.index_add_(0, sources, valid)
        if self.token_scale is not None:
            return token_loss.sum() * self.token_scale
        return token_loss.sum() / valid.sum().clamp(min=1)


def valid_target_count(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, device: torch.device) -> torch.Tensor:
    """Targets inside the loss mask over a step's micro-batches (fp32 device scalar; no host read)."""
    counts = [(targets.to(device)[..., 0] != IGNORE_INDEX).sum() for _, targets in micro_batches]
    return torch.stack(counts).sum().float()


def moe_balance(counts: torch.Tensor, *, aux_loss: float, balance: str) -> dict[str, Any]:
    """Per-expert load over the log window: shares per layer and the worst layer's max/min ratio."""
    counts = counts.double()  # (moe_layers, experts)
    ratio = counts.max(dim=1).values / counts.min(dim=1).values.clamp(min=1.0)
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
    worst_over_mean = (share.max(dim=1).values * counts.shape[1]).max()
    # one transfer for the whole record (a logging step's single host read of the expert loads)
    shares, (max_over_min, max_over_mean) = share.tolist(), torch.stack([ratio.max(), worst_over_mean]).tolist()
    record: dict[str, Any] = {
        "moe_load_max_over_min": max_over_min,
        "moe_load_max_over_mean": max_over_mean,
        "moe_expert_load": [[round(x, 5) for x in row] for row in shares],
    }
    if balance == "aux_loss":
        record["moe_aux_loss"] = aux_loss
    return record


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock interval measures what ran in it (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


KEPT_RECORDS = 1000  # Trainer.train() returns at most the first and the newest 999 records; metrics.jsonl has all


def keep_record(records: list[dict[str, Any]], record: dict[str, Any]) -> None:
    """Keep a logged record for `Trainer.train()`'s return value: without its per-rank lists, and at most
    KEPT_RECORDS of them (the first, for the summary's starting loss, and the newest). Every rank keeps them: at
    16,384 ranks the lists alone grew by 256 KB a record, GBs per rank over a long run."""
    records.append({key: value for key, value in record.items() if key not in PER_RANK_KEYS})
    if len(records) > KEPT_RECORDS:
        del records[1]
