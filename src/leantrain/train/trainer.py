"""The training loop: a fixed, numbered setup sequence and a short step function (torchtitan's shape).

Setup (in `Trainer.__init__`, always in this order, with no per-layout branches):
  1. runtime: device, rank/world size, process group, determinism
  2. model on the meta device (no memory), with fp8 swap, recompute and compile applied
  3. parallelize hook (plain data parallel: identity; issue #6 plugs FSDP2/TP/PP in here)
  4. materialise on the device and initialise weights (same seed on every rank), cast to the master dtype
  5. optimizer   6. LR scheduler   7. data (train and held-out samplers)   8. metrics   9. checkpointer hook
The step: k micro-batches (forward, loss, backward / k), gradient sync, clip, non-finite check, optimizer
and scheduler step, MoE balance update. Everything a checkpoint needs is in `state_dict()`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from rich.console import Console

from leantrain.data.sampler import Batch, PackedBatchSampler
from leantrain.errors import LeantrainError, UserInputError
from leantrain.model.transformer import Transformer, model_args_from_spec, num_params
from leantrain.observe.metrics import build_metrics_logger, console_line, mfu, peak_memory_bytes, resolve_peak_flops
from leantrain.observe.sinks import Sink
from leantrain.plan.flops import flops_per_token
from leantrain.spec.schema import JobSpec
from leantrain.train.optim import build_optimizer
from leantrain.train.precision import apply_precision, resolve_precision
from leantrain.train.runtime import ParallelHooks, init_runtime, load_rng_state, rng_state
from leantrain.train.schedule import build_scheduler

TRAIN_INFO_FILE = "train_info.json"


class TrainingDiverged(LeantrainError):
    """Loss or gradients became non-finite and training.on_nonfinite is `stop`."""

    exit_code = 1


class Checkpointer(Protocol):
    """What the checkpoint manager (issue #7) provides; the trainer calls it and knows nothing else."""

    def load_latest(self, trainer: Trainer) -> bool: ...

    def maybe_save(self, trainer: Trainer, *, force: bool = False) -> None: ...

    @property
    def preempt_requested(self) -> bool:
        """True once the ranks agreed to stop (a preemption signal); the loop ends after this step's save."""
        ...

    def close(self) -> None: ...


@dataclass
class StepResult:
    """What one optimizer step produced (loss tensors stay on the device until a log step reads them)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: bool
    data_wait_s: float
    comm_s: float
    aux_loss: torch.Tensor | None = None
    source_loss_sum: torch.Tensor | None = None
    source_tokens: torch.Tensor | None = None
    moe_counts: torch.Tensor | None = None


@dataclass
class LogWindow:
    """Sums between two log steps."""

    start_s: float = field(default_factory=time.perf_counter)
    steps: int = 0
    skipped: int = 0
    loss_sum: float = 0.0
    aux_sum: float = 0.0
    data_wait_s: float = 0.0
    comm_s: float = 0.0
    source_loss: torch.Tensor | None = None
    source_tokens: torch.Tensor | None = None
    moe_counts: torch.Tensor | None = None


def _add(total: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return total
    return value.clone() if total is None else total + value


class Trainer:
    """Owns every component of one training process. See the module docstring for the setup order."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        run_dir: Path,
        max_steps: int | None = None,
        console: Console | None = None,
        extra_sinks: list[Sink] | None = None,
        checkpointer_factory: Callable[[Trainer], Checkpointer] | None = None,
    ) -> None:
        self.spec, self.run_dir = spec, Path(run_dir)
        training = spec.training
        # 1. runtime
        self.runtime = init_runtime(spec)
        self.console = console if self.runtime.is_main else None
        self.device = self.runtime.device
        self.precision = resolve_precision(spec.precision, device=self.device)
        self.parallel = ParallelHooks(self.runtime)
        tokens_per_micro_step = training.micro_batch * spec.data.seq_len * self.runtime.world_size
        if training.global_batch_tokens % tokens_per_micro_step:
            raise UserInputError(
                f"training.global_batch_tokens ({training.global_batch_tokens}) must be a multiple of micro_batch × "
                f"seq_len × ranks ({tokens_per_micro_step}) for {self.runtime.world_size} rank(s)"
            )
        self.accum_steps = training.global_batch_tokens // tokens_per_micro_step
        default_steps = max(1, round(spec.data.tokens_total / training.global_batch_tokens))
        self.max_steps = max_steps or training.max_steps or default_steps
        # 2. model on meta
        self.model_args = model_args_from_spec(spec.model, max_seq_len=spec.data.seq_len)
        with torch.device("meta"):
            model = Transformer(self.model_args)
        apply_precision(model, self.precision, cast=False)
        model.set_recompute(training.activation_checkpointing)
        if training.compile:
            model.compile_blocks()
        # 3. parallelize hook
        model = self.parallel.parallelize(model)
        # 4. materialise + init (same seed everywhere: replicas start equal), then per-rank RNG for the run
        model.to_empty(device=self.device)
        torch.manual_seed(training.seed)
        model.init_weights(buffer_device=self.device)
        apply_precision(model, self.precision, swap=False)
        self.model: Transformer = model
        torch.manual_seed(training.seed + self.runtime.rank)
        # 5. optimizer, 6. scheduler
        self.optimizer = build_optimizer(model, training, spec.precision, device=self.device)
        self.scheduler = build_scheduler(self.optimizer, training, max_steps=self.max_steps)
        # 7. data
        self.sampler = self._sampler(split="train")
        self.eval_sampler = self._eval_sampler()
        if self.sampler.vocab_size > self.model_args.shape.vocab_size:
            raise UserInputError(
                f"model.vocab_size ({self.model_args.shape.vocab_size}) is smaller than the data's vocabulary "
                f"({self.sampler.vocab_size} in {spec.data.dir}/manifest.json)"
            )
        # 8. metrics
        self.metrics = build_metrics_logger(
            self.run_dir, tensorboard=spec.monitoring.tensorboard, enabled=self.runtime.is_main,
            extra_sinks=extra_sinks or [],
        )
        self.flops_per_token = flops_per_token(self.model_args.shape, seq_len=spec.data.seq_len).model
        self.peak_flops, self.peak_source = resolve_peak_flops(
            spec.hardware, device=self.device, dtype=self.precision.peak_dtype
        )
        self.log_every = spec.monitoring.log_every or training.log_every
        self.step, self.tokens_seen, self.skipped_steps = 0, 0, 0
        # 9. checkpointer hook (resumes here when a checkpoint exists)
        self.checkpointer = checkpointer_factory(self) if checkpointer_factory else None
        if self.checkpointer is not None:
            self.checkpointer.load_latest(self)

    # ----- setup helpers -------------------------------------------------------------------------------
    def _sampler(self, *, split: str) -> PackedBatchSampler:
        return PackedBatchSampler(
            self.spec.data.dir, seq_len=self.spec.data.seq_len, micro_batch=self.spec.training.micro_batch,
            dp_rank=self.runtime.rank, dp_size=self.runtime.world_size, seed=self.spec.training.seed, split=split,
        )

    def _eval_sampler(self) -> PackedBatchSampler | None:
        if not self.spec.training.eval_every:
            return None
        try:
            return self._sampler(split="valid")
        except UserInputError:
            return None  # the data dir has no held-out split; train_info.json says evaluation is off

    # ----- the step ------------------------------------------------------------------------------------
    def _forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Mean token loss, per-token losses (detached) and the MoE auxiliary loss of one micro-batch."""
        tokens = batch.tokens.to(self.device, non_blocking=True)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (micro_batch, seq)
        with self.precision.autocast():
            logits = self.model(inputs)  # (micro_batch, seq, vocab)
        token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        return token_loss.mean(), token_loss.detach(), self.model.auxiliary_loss()

    def train_step(self) -> StepResult:
        """One optimizer step over `accum_steps` micro-batches (mean of their losses = one big batch's)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_sources = len(self.sampler.source_names)
        loss_sum = torch.zeros((), device=self.device)
        source_loss = torch.zeros(num_sources, device=self.device)
        source_tokens = torch.zeros(num_sources, device=self.device)
        aux_total: torch.Tensor | None = None
        data_wait_s = 0.0
        for _ in range(self.accum_steps):
            start = time.perf_counter()
            batch = self.sampler.next_batch()
            data_wait_s += time.perf_counter() - start
            loss, token_loss, aux = self._forward_loss(batch)
            total = loss if aux is None else loss + aux
            (total / self.accum_steps).backward()
            loss_sum += loss.detach()
            aux_total = _add(aux_total, None if aux is None else aux.detach())
            sources = batch.source_ids[:, 1:].flatten().to(self.device)
            source_loss.index_add_(0, sources, token_loss)
            source_tokens += torch.bincount(sources, minlength=num_sources)
        comm_s = self.parallel.sync_gradients(self.model)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.training.grad_clip)
        mean_loss = loss_sum / self.accum_steps
        finite = bool(torch.isfinite(mean_loss) & torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        else:
            self._on_nonfinite(mean_loss, grad_norm)
        self.scheduler.step()  # the schedule follows the step count, skipped or not
        moe_counts = self.model.update_moe_balance()
        self.step += 1
        self.tokens_seen += self.spec.training.global_batch_tokens
        return StepResult(
            loss=mean_loss, grad_norm=grad_norm, skipped=not finite, data_wait_s=data_wait_s, comm_s=comm_s,
            aux_loss=None if aux_total is None else aux_total / self.accum_steps,
            source_loss_sum=source_loss, source_tokens=source_tokens, moe_counts=moe_counts,
        )

    def _on_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        what = f"step {self.step + 1}: loss {loss.item()}, grad norm {grad_norm.item()}"
        if self.spec.training.on_nonfinite == "stop":
            raise TrainingDiverged(
                f"non-finite values at {what}; the optimizer step was not taken. Lower training.lr, check the "
                "data, or set training.on_nonfinite: skip"
            )
        self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.console is not None:
            self.console.print(f"[yellow]skipped the optimizer step: non-finite values at {what}")

    # ----- the loop ------------------------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        """Run to max_steps; returns the metrics records this process logged (rank 0) or built."""
        self._write_train_info()
        records: list[dict[str, Any]] = []
        window = LogWindow()
        eval_every = self.spec.training.eval_every
        while self.step < self.max_steps:
            result = self.train_step()
            self._accumulate(window, result)
            last = self.step == self.max_steps
            if self.step % self.log_every == 0 or last:
                records.append(self._log(window, result))
                window = LogWindow()
            if self.eval_sampler is not None and (self.step % eval_every == 0 or last):
                records.append(self._log_eval())
            if self.checkpointer is not None:
                self.checkpointer.maybe_save(self, force=last)
                if self.checkpointer.preempt_requested:
                    break
        return records

    def _accumulate(self, window: LogWindow, result: StepResult) -> None:
        window.steps += 1
        window.skipped += int(result.skipped)
        window.data_wait_s += result.data_wait_s
        window.comm_s += result.comm_s
        if not result.skipped:
            window.loss_sum += float(result.loss)
            window.aux_sum += 0.0 if result.aux_loss is None else float(result.aux_loss)
            window.source_loss = _add(window.source_loss, result.source_loss_sum)
            window.source_tokens = _add(window.source_tokens, result.source_tokens)
        window.moe_counts = _add(window.moe_counts, result.moe_counts)

    def _log(self, window: LogWindow, result: StepResult) -> dict[str, Any]:
        elapsed_s = time.perf_counter() - window.start_s
        counted = max(1, window.steps - window.skipped)
        loss = torch.tensor([window.loss_sum / counted, window.aux_sum / counted], device=self.device)
        loss = self.parallel.sum_over_ranks(loss) / self.runtime.world_size
        tokens_per_s = window.steps * self.spec.training.global_batch_tokens / elapsed_s
        record: dict[str, Any] = {
            "step": self.step,
            "loss": float(loss[0]) if window.steps > window.skipped else math.nan,
            "grad_norm": float(result.grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
                       tokens_per_s_per_device=tokens_per_s / self.runtime.world_size),
            "step_time_s": elapsed_s / window.steps,
            "data_wait_s": window.data_wait_s / window.steps,
            "comm_s": window.comm_s / window.steps,
            "mem_bytes": peak_memory_bytes(self.device),
            "tokens_seen": self.tokens_seen,
            "skipped_steps": window.skipped,
        }
        if window.source_loss is not None and window.source_tokens is not None:
            sums = self.parallel.sum_over_ranks(torch.stack([window.source_loss, window.source_tokens]))
            record["loss_by_source"] = {
                name: float(sums[0, i] / sums[1, i])
                for i, name in enumerate(self.sampler.source_names) if sums[1, i] > 0
            }
        if window.moe_counts is not None:
            record.update(moe_balance(window.moe_counts, aux_loss=float(loss[1]), balance=self.model_args.balance))
        self.metrics.log(record)
        if self.console is not None:
            self.console.print(console_line(record), highlight=False, markup=False, soft_wrap=True)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first `eval_batches` held-out micro-batches per rank (the same ones every time)."""
        assert self.eval_sampler is not None
        self.model.eval()
        self.eval_sampler.load_state_dict({"global_sample_index": 0})
        total = torch.zeros(2, device=self.device)
        for _ in range(self.spec.training.eval_batches):
            _, token_loss, _ = self._forward_loss(self.eval_sampler.next_batch())
            total += torch.stack([token_loss.sum(), torch.tensor(float(token_loss.numel()), device=self.device)])
        self.model.train()
        total = self.parallel.sum_over_ranks(total)
        eval_loss = float(total[0] / total[1])
        return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0))}

    def _log_eval(self) -> dict[str, Any]:
        record = {"step": self.step, **self.evaluate()}
        self.metrics.log(record)
        if self.console is not None:
            self.console.print(
                f"eval   step {self.step:>6}  loss {record['eval_loss']:8.4f}  ppl {record['eval_perplexity']:9.2f}",
                highlight=False, markup=False,
            )
        return record

    def _write_train_info(self) -> None:
        if not self.runtime.is_main:
            return
        shape = self.model_args.shape
        info = {
            "num_params": num_params(self.model), "planner_total_params": shape.total_params(),
            "active_params": shape.active_params(), "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source, "device": str(self.device),
            "world_size": self.runtime.world_size, "accum_steps": self.accum_steps, "max_steps": self.max_steps,
            "micro_batch": self.spec.training.micro_batch, "seq_len": self.spec.data.seq_len,
            "global_batch_tokens": self.spec.training.global_batch_tokens, "compute_dtype": self.precision.compute,
            "optimizer": type(self.optimizer).__name__, "evaluation": self.eval_sampler is not None,
            "sources": self.sampler.source_names, "torch": torch.__version__,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / TRAIN_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    # ----- state for checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every piece a resume needs; RNG under a per-rank key so ranks do not overwrite each other."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train": {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps},
            "sampler": self.sampler.state_dict(),
            f"rng_rank{self.runtime.rank}": rng_state(self.device),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["train"]["step"])
        self.tokens_seen = int(state["train"]["tokens_seen"])
        self.skipped_steps = int(state["train"]["skipped_steps"])
        self.sampler.load_state_dict(state["sampler"])
        rng = state.get(f"rng_rank{self.runtime.rank}")
        if rng is not None:
            load_rng_state(rng, self.device)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.close()
        self.parallel.close()


def moe_balance(counts: torch.Tensor, *, aux_loss: float, balance: str) -> dict[str, Any]:
    """Per-expert load over the log window: shares per layer and the worst layer's max/min ratio."""
    counts = counts.double()  # (moe_layers, experts)
    ratio = counts.max(dim=1).values / counts.min(dim=1).values.clamp(min=1.0)
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
    record: dict[str, Any] = {
        "moe_load_max_over_min": float(ratio.max()),
        "moe_load_max_over_mean": float((share.max(dim=1).values * counts.shape[1]).max()),
        "moe_expert_load": [[round(float(x), 5) for x in row] for row in share],
    }
    if balance == "aux_loss":
        record["moe_aux_loss"] = aux_loss
    return record
