"""The training loop: a fixed, numbered setup sequence and a short step function (torchtitan's shape).

Setup (in `Trainer.__init__`, always in this order, with no per-layout branches):
  1. runtime: device, rank/world size, process group, determinism
  2. model on the meta device (no memory), with fp8 swap, recompute and compile applied
  3. parallelize: the layout from the spec and the world size (leantrain.parallel: FSDP2/HSDP, TP+SP, PP
     schedules, EP and their compositions; one process is the plain model) → `self.parallel` (ParallelModel)
  4. materialise on the device and initialise weights (the same weights as one process, whatever the
     layout), in the master dtype
  5. optimizer   6. LR scheduler   7. data (train and held-out samplers)   8. metrics   9. checkpointer hook
The step: k micro-batches (k = global batch / (micro_batch × seq_len × data-parallel ranks)) through
`ParallelModel.forward_backward` (a pipeline schedule under PP), expert gradients, global-norm clip,
non-finite check, optimizer and scheduler step, MoE balance update. The same code runs every layout; only
`leantrain.parallel` knows which one it is. Everything a checkpoint needs is in `state_dict()`.
"""

from __future__ import annotations

import contextlib
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
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from leantrain.data.sampler import Batch, PackedBatchSampler
from leantrain.errors import LeantrainError, UserInputError
from leantrain.model.transformer import Transformer, build_model, model_args_from_spec, num_params
from leantrain.observe.metrics import build_metrics_logger, console_line, mfu, peak_memory_bytes, resolve_peak_flops
from leantrain.observe.sinks import Sink
from leantrain.parallel import CommTimer, parallelize
from leantrain.parallel.dims import layout_for_run
from leantrain.plan.flops import flops_per_token
from leantrain.spec.schema import JobSpec
from leantrain.train.optim import build_optimizer
from leantrain.train.precision import apply_precision, resolve_precision
from leantrain.train.run_setup import record_oom, record_ranks_joined
from leantrain.train.runtime import close_runtime, init_runtime, load_rng_state, rng_state
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
    comm_s: float | None  # measured on log steps of a multi-rank run, else None
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


class SourceLoss:
    """The loss function the parallel model calls on each micro-batch's logits (on every rank, or on the last
    pipeline stage): returns the mean token loss and adds per-source loss sums and token counts on the side.

    Targets carry each token's source id in a last channel, `(batch, seq, 2)` = (next token, source), so the
    pipeline schedule cuts them into micro-batches together with the tokens.
    """

    def __init__(self, num_sources: int, *, device: torch.device) -> None:
        self.num_sources = num_sources
        self.loss_sum = torch.zeros(num_sources, device=device)
        self.tokens = torch.zeros(num_sources, device=device)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets[..., 0].flatten(), reduction="none")
        detached = token_loss.detach()
        if isinstance(detached, DTensor):  # loss parallel: the per-token losses of the vocabulary-split logits
            detached = detached.full_tensor()
        sources = targets[..., 1].flatten()
        self.loss_sum.index_add_(0, sources, detached)
        self.tokens += torch.bincount(sources, minlength=self.num_sources)
        return token_loss.mean()


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
        par, self.dims = layout_for_run(spec, world_size=self.runtime.world_size)
        self.spec = spec = spec.model_copy(update={"parallelism": par})
        if self.console is not None:
            for note in self.dims.notes:
                self.console.print(f"[yellow]note: {note}")
        tokens_per_micro_step = training.micro_batch * spec.data.seq_len * self.dims.dp
        if training.global_batch_tokens % tokens_per_micro_step:
            raise UserInputError(
                f"training.global_batch_tokens ({training.global_batch_tokens}) must be a multiple of micro_batch × "
                f"seq_len × data-parallel ranks ({tokens_per_micro_step}) for {self.dims.describe()}"
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
        # 3. parallelize (one process: the model as it is)
        mesh = self.dims.build_mesh(self.device.type) if self.runtime.distributed else None
        self.parallel = parallelize(model, self.dims, spec, mesh=mesh, device=self.device,
                                    num_microbatches=self.accum_steps)
        self.comm_timer = CommTimer(device_type=self.device.type)
        # Under FSDP mixed precision the weights are gathered in bf16 already: autocast would only add casts.
        self.autocast = contextlib.nullcontext if self.parallel.fsdp_mixed_precision else self.precision.autocast
        # 4. materialise + init (same weights as one process with this seed), then per-rank RNG for the run
        self.parallel.initialize(seed=training.seed, full_model=lambda: build_model(
            self.model_args, device=torch.device("cpu"), seed=training.seed))
        # The model with the single-process names (this rank's stages under PP): checkpoints, optimizer groups.
        self.model: nn.Module = self.parallel.module
        torch.manual_seed(training.seed + self.runtime.rank)
        # 5. optimizer, 6. scheduler
        self.optimizer = build_optimizer(self.model, training, spec.precision, device=self.device)
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
        self.flops_per_token = flops_per_token(  # the planner's convention, so plan and run MFU agree
            self.model_args.shape, seq_len=spec.data.seq_len, causal_halving=spec.plan.causal_halving
        ).model
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
            dp_rank=self.parallel.dp_rank, dp_size=self.parallel.dp_size, seed=self.spec.training.seed, split=split,
        )

    def _eval_sampler(self) -> PackedBatchSampler | None:
        if not self.spec.training.eval_every:
            return None
        try:
            return self._sampler(split="valid")
        except UserInputError:
            return None  # the data dir has no held-out split; train_info.json says evaluation is off

    # ----- the step ------------------------------------------------------------------------------------
    def _micro_batch(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (micro_batch, seq), targets (micro_batch, seq, 2) = next token and its source id)."""
        tokens = batch.tokens.to(self.device, non_blocking=True)
        sources = batch.source_ids[:, 1:].to(self.device, non_blocking=True)
        return tokens[:, :-1], torch.stack([tokens[:, 1:], sources], dim=-1)

    def _comm_measured(self) -> bool:
        """Profile the collectives of this step? Only steps that get logged, and only with several ranks."""
        next_step = self.step + 1
        return self.runtime.distributed and (next_step % self.log_every == 0 or next_step == self.max_steps)

    def train_step(self) -> StepResult:
        """One optimizer step over `accum_steps` micro-batches (mean of their losses = one big batch's)."""
        self.parallel.train()
        self.optimizer.zero_grad(set_to_none=True)
        source_loss = SourceLoss(len(self.sampler.source_names), device=self.device)
        data_wait_s = 0.0
        micro_batches = []
        for _ in range(self.accum_steps):
            start = time.perf_counter()
            batch = self.sampler.next_batch()
            data_wait_s += time.perf_counter() - start
            micro_batches.append(self._micro_batch(batch))
        measure = self._comm_measured()
        with self.comm_timer.measure() if measure else contextlib.nullcontext() as measured:
            mean_loss = self.parallel.forward_backward(micro_batches, loss_fn=source_loss, autocast=self.autocast)
            self.parallel.finish_gradients()
            grad_norm = self.parallel.clip_grad_norm_(self.spec.training.grad_clip)
            finite = bool(torch.isfinite(mean_loss) & torch.isfinite(grad_norm))
            if finite:
                self.optimizer.step()
        if not finite:
            self._on_nonfinite(mean_loss, grad_norm)
        self.scheduler.step()  # the schedule follows the step count, skipped or not
        moe_counts = self.parallel.update_moe_balance(bias_update_rate=self.model_args.bias_update_rate)
        self.step += 1
        self.tokens_seen += self.spec.training.global_batch_tokens
        return StepResult(
            loss=mean_loss, grad_norm=grad_norm, skipped=not finite, data_wait_s=data_wait_s,
            comm_s=measured.comm_s if measured is not None else None, aux_loss=self.parallel.last_aux_loss,
            source_loss_sum=source_loss.loss_sum, source_tokens=source_loss.tokens, moe_counts=moe_counts,
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
        runtime = self.runtime
        record_ranks_joined(self.run_dir, rank=runtime.rank, world_size=runtime.world_size,
                            distributed=runtime.distributed)
        records: list[dict[str, Any]] = []
        window = LogWindow()
        eval_every = self.spec.training.eval_every
        while self.step < self.max_steps:
            try:
                result = self.train_step()
            except torch.OutOfMemoryError as err:
                record_oom(self.run_dir, rank=runtime.rank, mem_bytes=peak_memory_bytes(self.device), error=err)
                raise
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
        if result.comm_s is not None:  # one profiled step per window (the logged one)
            window.comm_s = result.comm_s
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
        loss = self.parallel.mean_over_dp(loss)  # every pipeline stage has the loss (broadcast from the last)
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
            "comm_s": window.comm_s,
            "mem_bytes": peak_memory_bytes(self.device),
            "tokens_seen": self.tokens_seen,
            "skipped_steps": window.skipped,
        }
        if self.runtime.world_size > 1:  # each rank's own step time, for straggler alerts
            per_rank = torch.zeros(self.runtime.world_size, device=self.device)
            per_rank[self.runtime.rank] = record["step_time_s"]
            record["rank_step_time_s"] = self.parallel.sum_over_ranks(per_rank).tolist()
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
        self.parallel.train(False)
        self.eval_sampler.load_state_dict({"global_sample_index": 0})
        multiple = self.parallel.eval_batch_multiple  # under PP whole schedules: eval_batches rounded up
        num_batches = -(-self.spec.training.eval_batches // multiple) * multiple
        recorder = SourceLoss(len(self.eval_sampler.source_names), device=self.device)
        micro_batches = [self._micro_batch(self.eval_sampler.next_batch()) for _ in range(num_batches)]
        self.parallel.evaluate(micro_batches, loss_fn=recorder, autocast=self.autocast)
        self.parallel.train()
        # Summed over every rank: TP peers add the same numbers to both sums, other PP stages add zeros.
        total = self.parallel.sum_over_ranks(torch.stack([recorder.loss_sum.sum(), recorder.tokens.sum()]))
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
            "sources": self.sampler.source_names, "torch": torch.__version__, "layout": self.dims.describe(),
            "data_parallel": self.dims.dp,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / TRAIN_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    # ----- state for checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every piece a resume needs; RNG under a per-rank key so ranks do not overwrite each other.

        Model and optimizer go through torch.distributed.checkpoint's get_state_dict: the single-process names
        (`layers.0.attention.wq.weight`) with sharded weights as DTensors, whatever the layout.
        """
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "train": {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps},
            "sampler": self.sampler.state_dict(),
            f"rng_rank{self.runtime.rank}": rng_state(self.device),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
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
        close_runtime(self.runtime)


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
