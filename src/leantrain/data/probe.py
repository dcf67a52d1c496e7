"""Trial read (`prepare --probe`): the real sampler reads the data dir by memory map; is it fast enough?

Measured: tokens/s of one loader process (one data-parallel rank: `PackedBatchSampler.next_batch` at the
spec's micro_batch and seq_len, dp_size 1), after one warm-up batch, for about `duration_s`.

Needed, per data-parallel rank (each rank's loader feeds tp × pp GPUs):
- from the planner when it can plan the spec: plan.json `throughput.tokens_per_s` (global tokens per step
  / predicted step time) divided by the layout's dp;
- else from the spec alone: peak FLOP/s (catalog, or hardware.peak_flops) × budget.assumed_mfu /
  model FLOPs per token (plan.flops) = tokens/s one GPU consumes, × tensor_parallel × pipeline_parallel.
Verdict: PASS when measured ≥ needed; the margin (measured / needed) is printed with both numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from leantrain.spec.schema import JobSpec


@dataclass(frozen=True)
class ProbeResult:
    """Loader speed against what the GPUs will consume."""

    measured_tokens_per_s: float
    needed_tokens_per_s: float
    needed_source: str
    num_batches: int
    first_batch_s: float

    @property
    def margin(self) -> float:
        return self.measured_tokens_per_s / self.needed_tokens_per_s

    @property
    def passed(self) -> bool:
        return self.margin >= 1.0

    def to_json(self) -> dict[str, object]:
        return {**self.__dict__, "margin": self.margin, "passed": self.passed}


def needed_tokens_per_s(spec: JobSpec) -> tuple[float, str]:
    """Tokens/s one data-parallel rank's loader must deliver, and where the number came from."""
    try:
        from leantrain.plan.planner import make_plan

        plan = make_plan(spec)
        dp = max(int(plan["layout"]["dp"]), 1)
        return float(plan["throughput"]["tokens_per_s"]) / dp, f"planner: {plan['throughput']['tokens_per_s']:.4g} " \
            f"tokens/s over dp={dp}"
    except Exception as err:  # the planner is optional here: fall back to the spec's own numbers
        fallback_reason = f"{type(err).__name__}"
    from leantrain.hardware import get_accelerator
    from leantrain.plan.flops import flops_per_token
    from leantrain.spec.shapes import resolve_shape

    shape = resolve_shape(spec.model)
    peak = spec.hardware.peak_flops or get_accelerator(spec.hardware.accelerator).peak_for(spec.precision.compute)
    per_gpu = peak * spec.budget.assumed_mfu / flops_per_token(shape, seq_len=spec.data.seq_len).model
    gpus_per_rank = spec.parallelism.tensor_parallel * spec.parallelism.pipeline_parallel
    return per_gpu * gpus_per_rank, (f"peak {peak:.3g} FLOP/s × MFU {spec.budget.assumed_mfu} / FLOPs per token "
                                     f"× tp·pp {gpus_per_rank} (planner unavailable: {fallback_reason})")


def probe(spec: JobSpec, *, data_dir: Path, duration_s: float = 1.0, max_batches: int = 100_000) -> ProbeResult:
    """Read batches through the real sampler for about `duration_s` and compare with the needed rate."""
    from leantrain.data.sampler import PackedBatchSampler  # torch: only the trial read needs it

    start = time.perf_counter()
    sampler = PackedBatchSampler(data_dir, seq_len=spec.data.seq_len, micro_batch=spec.training.micro_batch,
                                 dp_rank=0, dp_size=1, seed=spec.training.seed)
    sampler.next_batch()
    first_batch_s = time.perf_counter() - start
    tokens_per_batch = spec.training.micro_batch * spec.data.seq_len
    num_batches = 0
    start = time.perf_counter()
    deadline = start + duration_s
    while num_batches < max_batches and time.perf_counter() < deadline:
        sampler.next_batch()
        num_batches += 1
    elapsed = time.perf_counter() - start
    needed, source = needed_tokens_per_s(spec)
    return ProbeResult(measured_tokens_per_s=num_batches * tokens_per_batch / elapsed, needed_tokens_per_s=needed,
                       needed_source=source, num_batches=num_batches, first_batch_s=first_batch_s)
