"""Where this process runs: device, rank, world size, process group, determinism and per-rank RNG.

One process is rank 0 of 1. Under torchrun (RANK/WORLD_SIZE set) the process group is initialised here
(gloo on CPU, nccl on CUDA) and the trainer runs plain data parallel: the same model on every rank,
gradients averaged by all-reduce after the last micro-batch (`ParallelHooks.sync_gradients`). The full
layouts (FSDP2, TP, PP, EP) belong to `leantrain.parallel` and plug in through the same hooks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.errors import UserInputError
from leantrain.spec.schema import JobSpec


@dataclass(frozen=True)
class Runtime:
    """The process's place in the job."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, *, local_rank: int) -> torch.device:
    """training.device → a torch device; `auto` takes this rank's GPU when there is one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserInputError("training.device: cuda, but torch sees no CUDA device here; use cpu or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_runtime(spec: JobSpec) -> Runtime:
    """Read the launcher's environment, pick the device, start the process group when there are several ranks."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(spec.training.device, local_rank=local_rank)
    if world_size > 1:
        par = spec.parallelism
        if par.tensor_parallel * par.pipeline_parallel * par.expert_parallel > 1:
            raise UserInputError(
                "parallelism: tensor/pipeline/expert parallel layouts are not built into `train` yet (issue #6); "
                "under torchrun this version runs plain data parallel only (set them to 1)"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if spec.training.deterministic:
        set_deterministic(device)
    return Runtime(device=device, rank=rank, world_size=world_size, local_rank=local_rank)


def set_deterministic(device: torch.device) -> None:
    """Same inputs, same bits: deterministic kernels where they exist (cuBLAS needs its workspace pinned first).

    warn_only: an op without a deterministic CUDA kernel warns instead of stopping the run ("where possible").
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generator states (CPU, and CUDA on a GPU run)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def load_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class ParallelHooks:
    """The trainer's only contact with parallelism: wrap the model, average gradients, reduce metrics.

    This class is plain data parallel (identity on one rank); issue #6 replaces it with FSDP2/TP/PP.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply the parallel layout to the (meta-device) model; plain data parallel needs nothing."""
        return model

    def sync_gradients(self, model: nn.Module) -> float:
        """Average gradients over ranks; returns the seconds spent communicating."""
        if not self.runtime.distributed:
            return 0.0
        start = time.perf_counter()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for grad in grads:
            dist.all_reduce(grad, op=dist.ReduceOp.AVG if self.runtime.device.type == "cuda" else dist.ReduceOp.SUM)
            if self.runtime.device.type != "cuda":  # gloo has no AVG
                grad.div_(self.runtime.world_size)
        return time.perf_counter() - start

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a metric tensor over ranks (in place and returned)."""
        if self.runtime.distributed:
            dist.all_reduce(tensor)
        return tensor

    def close(self) -> None:
        if self.runtime.distributed and dist.is_initialized():
            dist.destroy_process_group()
