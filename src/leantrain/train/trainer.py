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
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from leantrain.data.layout import Manifest
from leantrain.data.preference import PairBatchSampler
from leantrain.data.prefetch import PrefetchingSampler
from leantrain.data.sampler import Batch, PackedBatchSampler, check_token_ids
from leantrain.dtypes import DTYPES
from leantrain.errors import LeantrainError, UserInputError
from leantrain.model.transformer import num_params
from leantrain.observe.metrics import (
    build_metrics_logger,
    console_line,
    host_rss_bytes,
    mfu,
    peak_memory_bytes,
    resolve_peak_flops,
)
from leantrain.observe.sinks import Sink
from leantrain.parallel import CommTimer
from leantrain.parallel.dims import layout_for_run
from leantrain.plan.flops import flops_per_token
from leantrain.spec.schema import JobSpec
from leantrain.train import dpo, finetune
from leantrain.train.build import WeightsLoader, build_parallel_model
from leantrain.train.model_ready import rank_memory, record_model_ready
from leantrain.train.optim import build_optimizer, step_if_finite
from leantrain.train.precision import enable_tf32, float8_post_step, resolve_precision
from leantrain.train.run_setup import record_oom, record_ranks_joined
from leantrain.train.runtime import close_runtime, init_runtime, load_rng_state, rng_state
from leantrain.train.schedule import build_scheduler
from leantrain.train.shared_reads import shared_manifest
from leantrain.train.step_metrics import (
    IGNORE_INDEX,
    LogWindow,
    SourceLoss,
    StepResult,
    keep_record,
    moe_balance,
    synchronize,
    valid_target_count,
)

__all__ = ["TRAIN_INFO_FILE", "Checkpointer", "LogWindow", "SourceLoss", "StepResult", "Trainer", "TrainingDiverged",
           "moe_balance"]

TRAIN_INFO_FILE = "train_info.json"


class TrainingDiverged(LeantrainError):
    """Loss or gradients became non-finite and training.on_nonfinite is `stop`."""

    exit_code = 1


class Checkpointer(Protocol):
    """What the checkpoint manager (`leantrain.ckpt.manager.CheckpointManager`) provides; the trainer calls it
    and knows nothing else."""

    def load_latest(self, trainer: Trainer) -> bool: ...

    def maybe_save(self, trainer: Trainer, *, force: bool = False) -> None: ...

    @property
    def preempt_requested(self) -> bool:
        """True once the ranks agreed to stop (a preemption signal); the loop ends after this step's save."""
        ...

    def close(self) -> None: ...


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
        weights_loader: WeightsLoader | None = None,
    ) -> None:
        self.spec, self.run_dir = spec, Path(run_dir)
        training = spec.training
        # 1. runtime
        self.runtime = init_runtime(spec)
        self.console = console if self.runtime.is_main else None
        self.device = self.runtime.device
        self.precision = resolve_precision(spec.precision, device=self.device)
        enable_tf32(self.device)
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
        # 0 (`--max-steps 0`) builds everything, reports `model_ready` and trains no step.
        self.max_steps = max_steps if max_steps is not None else training.max_steps or default_steps
        # 2.-4. model on meta → parallelize → this rank's shards allocated → init (or `weights_loader`) in place:
        # the same weights as one process whatever the layout, and no full model on any rank (train/build.py).
        self.rss_base_bytes = host_rss_bytes()
        built = build_parallel_model(spec, dims=self.dims, precision=self.precision, runtime=self.runtime,
                                     num_microbatches=self.accum_steps,
                                     load=weights_loader or finetune.weights_loader(spec))
        self.parallel, self.model_args = built.parallel, built.model_args
        self.param_bytes_total = built.param_bytes_total
        if self.console is not None and self.parallel.fsdp and self.accum_steps > 1 and (
                self.parallel.grad_sync == "last_micro_batch"):
            full_grads_gib = self.param_bytes_total / DTYPES[spec.precision.master_weights].itemsize * 4 / 2**30
            self.console.print(f"[yellow]note: parallelism.grad_sync: last_micro_batch holds every parameter's "
                               f"unsharded gradient between micro-batches (~{full_grads_gib:.1f} GiB per rank)")
        self.comm_timer = CommTimer(device_type=self.device.type)
        self.autocast = self.precision.forward_context(fsdp=self.parallel.fsdp)
        # The model with the single-process names (this rank's stages under PP): checkpoints, optimizer groups.
        self.model: nn.Module = self.parallel.module
        self.param_counts = finetune.param_counts(self.model)  # params, trainable_params (LoRA: adapters only)
        torch.manual_seed(training.seed + self.runtime.rank)  # per-rank RNG for the run (dropout-free, data order)
        # 5. optimizer, 6. scheduler
        self.optimizer = build_optimizer(self.model, training, spec.precision, device=self.device)
        self.after_optimizer_step = float8_post_step(self.parallel.parts, self.precision, fsdp=self.parallel.fsdp)
        self.scheduler = build_scheduler(self.optimizer, training, max_steps=max(1, self.max_steps))
        # 7. data (training batches read ahead on a thread, pinned on CUDA: data.prefetch)
        self._manifest: Manifest | None = None
        self.sampler = PrefetchingSampler(self._sampler(split="train"), depth=2 * self.accum_steps,
                                          pin_memory=self.device.type == "cuda")
        self.eval_sampler = self._eval_sampler()
        self.objective = dpo.build_objective(self)  # finetune.method dpo: the reference and the pairs' loss
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
        self.log_every = spec.log_every
        self.step, self.tokens_seen, self.skipped_steps = 0, 0, 0
        # 9. checkpointer hook (resumes here when a checkpoint exists)
        self.checkpointer = checkpointer_factory(self) if checkpointer_factory else None
        if self.checkpointer is not None:
            self.checkpointer.load_latest(self)

    # ----- setup helpers -------------------------------------------------------------------------------
    def _sampler(self, *, split: str) -> PackedBatchSampler:
        if self._manifest is None:  # rank 0 reads the data dir's metadata; the others get it from rank 0
            self._manifest = shared_manifest(self.spec.data.dir)
            check_token_ids(self._manifest, self.spec.data.dir, model_vocab_size=self.model_args.shape.vocab_size)
        sampler_class = PairBatchSampler if dpo.enabled(self.spec) else PackedBatchSampler  # DPO: whole pairs
        return sampler_class(
            self.spec.data.dir, seq_len=self.spec.data.seq_len, micro_batch=self.spec.training.micro_batch,
            dp_rank=self.parallel.dp_rank, dp_size=self.parallel.dp_size, seed=self.spec.training.seed, split=split,
            manifest=self._manifest,
        )

    def _eval_sampler(self) -> PackedBatchSampler | None:
        # Decided from the manifest every rank shares (a rank-local read error must fail that rank, not turn its
        # evaluation off while the others evaluate and wait for it); train_info.json says when it is off.
        if not self.spec.training.eval_every or not self._manifest.has_tokens("valid"):
            return None
        return self._sampler(split="valid")

    # ----- the step ------------------------------------------------------------------------------------
    def _micro_batch(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (micro_batch, seq), targets (micro_batch, seq, 2) = next token and its source id)."""
        tokens = batch.tokens.to(self.device, non_blocking=True)
        sources = batch.source_ids[:, 1:].to(self.device, non_blocking=True)
        targets = tokens[:, 1:]
        if batch.loss_mask is not None:  # chat data: only assistant tokens are targets
            targets = targets.masked_fill(~batch.loss_mask[:, 1:].to(self.device), IGNORE_INDEX)
        return tokens[:, :-1], torch.stack([targets, sources], dim=-1)

    def _comm_measured(self) -> bool:
        """Profile the collectives of this step? Only logged steps of one window in `comm_profile_every`, only
        with several ranks, and only on the first rank of each node (the profiler's cost is paid where `comm_s`
        is read: rank 0 logs it, one rank per node keeps a per-node view for a future straggler report)."""
        next_step = self.step + 1
        logged = next_step % self.log_every == 0 or next_step == self.max_steps
        window = (next_step - 1) // self.log_every  # one logging window in monitoring.comm_profile_every
        return (self.runtime.distributed and self.runtime.local_rank == 0 and logged
                and window % self.spec.monitoring.comm_profile_every == 0)

    def train_step(self) -> StepResult:
        """One optimizer step over `accum_steps` micro-batches (mean of their losses = one big batch's)."""
        measure = self._comm_measured()
        if measure:  # the profiled step is timed on its own, from an idle device to an idle device
            synchronize(self.device)
        step_start_s = time.perf_counter()
        self.parallel.train()
        self.optimizer.zero_grad(set_to_none=True)
        data_wait_s = 0.0
        micro_batches = []
        for _ in range(self.accum_steps):
            start = time.perf_counter()
            batch = self.sampler.next_batch()
            data_wait_s += time.perf_counter() - start
            micro_batches.append(self._micro_batch(batch))
        token_scale = None
        # masked loss: normalised by the step's global count of valid tokens (DPO: a mean over pairs, no count)
        if self.sampler.has_loss_mask and self.objective is None:
            valid = self.parallel.sum_over_dp(valid_target_count(micro_batches, device=self.device))
            token_scale = self.parallel.dims.dp * len(micro_batches) / valid.clamp(min=1.0)
        source_loss = SourceLoss(len(self.sampler.source_names), device=self.device,
                                 masked=self.sampler.has_loss_mask, token_scale=token_scale)
        if self.objective is not None:  # DPO: the reference pass, then the pairs' loss (train/dpo.py)
            source_loss = self.objective.loss_fn(micro_batches)
        with self.comm_timer.measure() if measure else contextlib.nullcontext() as measured:
            mean_loss = self.parallel.forward_backward(micro_batches, loss_fn=source_loss, autocast=self.autocast)
            self.parallel.finish_gradients()
            grad_norm = self.parallel.clip_grad_norm_(self.spec.training.grad_clip)
            # The global gradient norm is the agreed flag: it is reduced over every rank that holds gradients
            # (FSDP, TP, PP, EP), so a non-finite loss on any rank makes it non-finite on all of them, and every
            # rank skips the same step. Skipping happens on the device (the optimizer takes `found_inf`, as under
            # GradScaler): no host sync on the default path (torchtitan, too, keeps the check off the host).
            finite = torch.isfinite(grad_norm)
            if self.spec.training.on_nonfinite == "stop" and not bool(finite):  # opt-in: one host read per step
                self._on_nonfinite(mean_loss, grad_norm)
            step_if_finite(self.optimizer, finite)
            self.after_optimizer_step()
        skipped = ~finite
        self._skipped_total += skipped
        self.scheduler.step()  # the schedule follows the step count, skipped or not
        moe_counts = self.parallel.update_moe_balance(bias_update_rate=self.model_args.bias_update_rate)
        self.step += 1
        self.tokens_seen += self.spec.training.global_batch_tokens
        if measure:
            synchronize(self.device)
        return StepResult(
            loss=mean_loss, grad_norm=grad_norm, skipped=skipped, data_wait_s=data_wait_s,
            comm_s=measured.comm_s if measured is not None else None, aux_loss=self.parallel.last_aux_loss,
            source_loss_sum=source_loss.loss_sum, source_tokens=source_loss.tokens, moe_counts=moe_counts,
            step_s=time.perf_counter() - step_start_s, objective_stats=getattr(source_loss, "stats", None),
        )

    def _on_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        what = f"step {self.step + 1}: loss {loss.item()}, grad norm {grad_norm.item()}"
        raise TrainingDiverged(
            f"non-finite values at {what}; the optimizer step was not taken. Lower training.lr, check the "
            "data, or set training.on_nonfinite: skip"
        )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite values so far (read from the device: a checkpoint or a log)."""
        return self._skipped_base + int(self._skipped_total)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_base = int(value)
        self._skipped_total = torch.zeros((), dtype=torch.int64, device=self.device)

    # ----- the loop ------------------------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        """Run to max_steps; returns the records this process logged (rank 0) or built (`keep_record`: bounded).

        Evaluation and checkpoint saves are timed on their own and kept out of the window's throughput
        (train/step_metrics.py); with `max_steps` 0 only `model_ready` is recorded.
        """
        self._write_train_info()
        runtime = self.runtime
        record_ranks_joined(self.run_dir, rank=runtime.rank, world_size=runtime.world_size,
                            distributed=runtime.distributed, spec=self.spec)  # and base_model.json
        self.record_model_ready()
        records: list[dict[str, Any]] = []
        window = LogWindow()
        eval_every = self.spec.training.eval_every
        while self.step < self.max_steps:
            try:
                result = self.train_step()
            except torch.OutOfMemoryError as err:
                record_oom(self.run_dir, rank=runtime.rank, mem_bytes=peak_memory_bytes(self.device), error=err,
                           attempt=getattr(self.checkpointer, "attempt", None))
                raise
            window.add(result)
            last = self.step == self.max_steps
            if self.step % self.log_every == 0 or last:
                keep_record(records, self._log(window, result))
                window = LogWindow()
            if self.eval_sampler is not None and (self.step % eval_every == 0 or last):
                eval_record = self._log_eval()
                window.eval_s += eval_record["eval_s"]
                keep_record(records, eval_record)
            if self.checkpointer is not None:
                start_s = time.perf_counter()
                self.checkpointer.maybe_save(self, force=last)
                window.ckpt_save_s += time.perf_counter() - start_s
                if self.checkpointer.preempt_requested:
                    break
        return records

    def record_model_ready(self) -> dict[str, Any] | None:
        """The `model_ready` event (train/model_ready.py): every rank's memory after the build, gathered on rank 0."""
        entry = rank_memory(rank=self.runtime.rank, modules=self.parallel.parts, device=self.device,
                            base_rss_bytes=self.rss_base_bytes)
        return record_model_ready(
            self.run_dir, entry=entry, world_size=self.runtime.world_size, distributed=self.runtime.distributed,
            param_bytes_total=self.param_bytes_total, layout=self.dims.describe(), resumed_step=self.step,
        )

    def _log(self, window: LogWindow, result: StepResult) -> dict[str, Any]:
        timing = window.timing()
        # Everything the record needs from the device in one transfer (one host sync per logging step).
        skipped = torch.as_tensor(window.skipped, device=self.device).float()
        counted = (window.steps - skipped).clamp(min=1)
        zero = torch.zeros((), device=self.device)
        loss = torch.stack([torch.as_tensor(window.loss_sum, device=self.device).float() / counted,
                            torch.as_tensor(window.aux_sum, device=self.device).float() / counted])
        loss = self.parallel.mean_over_dp(loss)  # every pipeline stage has the loss (broadcast from the last)
        loss_value, aux_value, skipped_value, grad_norm = torch.stack(
            [loss[0], loss[1], skipped + zero, result.grad_norm.float().to(self.device)]).tolist()
        num_skipped = int(skipped_value)
        tokens_per_s = self.spec.training.global_batch_tokens / timing["step_time_s"]
        record: dict[str, Any] = {
            "step": self.step,
            "loss": loss_value if window.steps > num_skipped else math.nan,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
                       tokens_per_s_per_device=tokens_per_s / self.runtime.world_size),
            **timing,
            "data_wait_s": window.data_wait_s / window.steps,
            "comm_s": window.comm_s if window.profiled_steps or not self.runtime.distributed else None,
            "mem_bytes": peak_memory_bytes(self.device),
            "tokens_seen": self.tokens_seen,
            "skipped_steps": num_skipped,
            **self.param_counts,
        }
        if self.runtime.world_size > 1:  # each rank's own step time (straggler alerts) and peak memory
            per_rank = torch.zeros(2, self.runtime.world_size, device=self.device, dtype=torch.float64)
            per_rank[:, self.runtime.rank] = torch.tensor([record["step_time_s"], record["mem_bytes"]],
                                                          dtype=torch.float64)
            per_rank = self.parallel.sum_over_ranks(per_rank).tolist()
            record["rank_step_time_s"] = per_rank[0]
            record["rank_mem_bytes"] = [int(m) for m in per_rank[1]]
            record["mem_bytes"] = max(record["rank_mem_bytes"])
        if window.source_loss is not None and window.source_tokens is not None:
            loss_sums, token_sums = self.parallel.sum_over_ranks(
                torch.stack([window.source_loss, window.source_tokens])).tolist()
            record["loss_by_source"] = {
                name: loss_sums[i] / token_sums[i]
                for i, name in enumerate(self.sampler.source_names) if token_sums[i] > 0
            }
        if window.objective_stats is not None and self.objective is not None:  # DPO rewards over all ranks' pairs
            record.update(self.objective.metrics(self.parallel.sum_over_ranks(window.objective_stats.clone())))
        if window.moe_counts is not None:
            record.update(moe_balance(window.moe_counts, aux_loss=aux_value, balance=self.model_args.balance))
        self.metrics.log(record)
        if self.console is not None:
            self.console.print(console_line(record), highlight=False, markup=False, soft_wrap=True)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Mean loss over the first `eval_batches` held-out micro-batches per rank (the same ones every time)."""
        assert self.eval_sampler is not None
        self.parallel.train(False)
        self.eval_sampler.load_state_dict({"global_sample_index": 0})
        multiple = self.parallel.eval_batch_multiple  # under PP whole schedules: eval_batches rounded up
        num_batches = -(-self.spec.training.eval_batches // multiple) * multiple
        recorder = SourceLoss(len(self.eval_sampler.source_names), device=self.device,
                              masked=self.eval_sampler.has_loss_mask)
        micro_batches = [self._micro_batch(self.eval_sampler.next_batch()) for _ in range(num_batches)]
        if self.objective is not None:  # DPO: the held-out pairs' DPO loss
            recorder = self.objective.loss_fn(micro_batches)  # type: ignore[assignment]
        self.parallel.evaluate(micro_batches, loss_fn=recorder, autocast=self.autocast)
        self.parallel.train()
        # Summed over every rank: TP peers add the same numbers to both sums, other PP stages add zeros.
        by_source = isinstance(recorder, SourceLoss) and recorder.num_sources > 1  # and each source's, one reduce
        sums = torch.stack([recorder.loss_sum.sum(), recorder.tokens.sum()])
        total = self.parallel.sum_over_ranks(torch.cat([sums, recorder.loss_sum, recorder.tokens]) if by_source
                                             else sums).tolist()
        eval_loss = total[0] / total[1]
        out: dict[str, Any] = {"eval_loss": eval_loss}  # a DPO loss has no perplexity
        if self.objective is None:
            out["eval_perplexity"] = math.exp(min(eval_loss, 50.0))
        if by_source:
            n, names = recorder.num_sources, self.eval_sampler.source_names
            out["eval_loss_by_source"] = {name: total[2 + i] / total[2 + n + i] for i, name in enumerate(names)
                                          if total[2 + n + i] > 0}
        return out

    def _log_eval(self) -> dict[str, Any]:
        synchronize(self.device)
        start_s = time.perf_counter()
        record: dict[str, Any] = {"step": self.step, **self.evaluate()}
        synchronize(self.device)
        record["eval_s"] = time.perf_counter() - start_s
        self.metrics.log(record)
        if self.console is not None:
            ppl = f"  ppl {record['eval_perplexity']:9.2f}" if "eval_perplexity" in record else ""
            self.console.print(f"eval   step {self.step:>6}  loss {record['eval_loss']:8.4f}{ppl}", markup=False,
                               highlight=False)
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
            "data_parallel": self.dims.dp, "task": self.spec.task, **self.param_counts,
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
        """Close the checkpointer, then always the loader, the metrics and the runtime (a failed save re-raises)."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            getattr(getattr(self, "sampler", None), "close", lambda: None)()  # none when setup failed early
            try:
                self.metrics.close()
            finally:
                close_runtime(self.runtime)
