"""One parallel layout: the degrees of each axis plus the per-rank choices that change memory and time."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from leantrain.plan.flops import Recompute
from leantrain.spec.schema import ParallelismSpec, TrainingSpec


@dataclass(frozen=True)
class Layout:
    """dp × tp × pp GPUs; ep splits the experts inside dp; dp_replicate > 1 is HSDP (shards copied)."""

    dp: int
    tp: int
    pp: int
    ep: int = 1
    dp_replicate: int = 1
    zero: int = 3
    micro_batch: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = True
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # Are routed experts split over TP (Megatron's expert_tensor_parallel_size = TP)? None: as this trainer runs
    # them, split when ep is 1, else whole on each TP rank, which routes its share of the tokens (parallel/expert.py)
    experts_tp_split: bool | None = None

    @property
    def experts_split_over_tp(self) -> bool:
        return self.ep == 1 if self.experts_tp_split is None else self.experts_tp_split

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_shard(self) -> int:
        """Ranks a ZeRO/FSDP shard is spread over (dp / dp_replicate)."""
        return max(1, self.dp // self.dp_replicate)

    @property
    def state_shard(self) -> int:
        """Ranks a parameter's master copy, gradient and optimizer states are split over: the shard group at
        every ZeRO level ≥ 1 (the trainer's FSDP2 shards all three alike), 1 at ZeRO-0 (replicated)."""
        return self.dp_shard if self.zero >= 1 else 1

    @property
    def sp(self) -> bool:
        """Sequence parallelism only means something with tp > 1."""
        return self.sequence_parallel and self.tp > 1

    def sequences_per_replica(self, sequences_per_step: int) -> int:
        """Sequences one data-parallel replica processes per step (the global batch rounded up to dp)."""
        return math.ceil(sequences_per_step / self.dp)

    def num_microbatches(self, sequences_per_step: int) -> int:
        return max(1, math.ceil(self.sequences_per_replica(sequences_per_step) / self.micro_batch))

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.dp_replicate > 1:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}")
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.schedule == "dualpipe" and self.pp > 1:
            parts.append("dualpipe")
        return " × ".join(parts[:3]) + (" " + " ".join(parts[3:]) if parts[3:] else "") + (
            f", mb {self.micro_batch}, ZeRO-{self.zero}, recompute {self.recompute}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layout_from_spec(par: ParallelismSpec, training: TrainingSpec, *, num_gpus: int | None = None) -> Layout:
    """The spec's own layout; with `num_gpus`, dp is rescaled so tp and pp stay as written."""
    dp = par.data_parallel
    if num_gpus is not None and par.world_size != num_gpus:
        dp = max(1, num_gpus // (par.tensor_parallel * par.pipeline_parallel))
    replicate = par.data_parallel_replicate if dp % par.data_parallel_replicate == 0 else 1
    return Layout(
        dp=dp,
        tp=par.tensor_parallel,
        pp=par.pipeline_parallel,
        ep=par.expert_parallel if dp % par.expert_parallel == 0 else 1,
        dp_replicate=replicate,
        zero=par.zero_stage,
        micro_batch=training.micro_batch,
        recompute=training.activation_checkpointing,
        sequence_parallel=par.sequence_parallel,
        schedule=par.pipeline_schedule if par.pipeline_parallel > 1 else "1f1b",
        virtual_stages=par.virtual_stages,
    )
