"""Where this process runs: device, rank, world size, process group, determinism and per-rank RNG.

One process is rank 0 of 1. Under torchrun (RANK/WORLD_SIZE set) the process group is initialised here
(gloo on CPU, nccl on CUDA; also for one rank with `parallelism.fsdp_single_rank`, from torchrun's rendezvous
or, without one, an in-process store) with `fault.collective_timeout_s` as every group's timeout; the layout (FSDP2,
TP, PP, EP on one device mesh) is `leantrain.parallel`'s, which the trainer drives through `ParallelModel`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from leantrain.errors import UserInputError
from leantrain.spec.schema import JobSpec


@dataclass(frozen=True)
class Runtime:
    """The process's place in the job."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    single_rank_group: bool = False  # one rank that started a 1-rank process group (parallelism.fsdp_single_rank)

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
    single_rank_group = world_size == 1 and spec.parallelism.fsdp_single_rank and not dist.is_initialized()
    if world_size > 1 or single_rank_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            timeout = set_collective_timeout(spec.fault.collective_timeout_s, cuda=device.type == "cuda")
            # One rank outside torchrun (no MASTER_ADDR): an in-process store is its whole rendezvous.
            alone = {} if "MASTER_ADDR" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
            # device_id on CUDA: NCCL initialises its communicator eagerly and lets the device mesh split it
            # (ncclCommSplit) instead of a fresh rendezvous per sub-group (torchtitan passes it too).
            bound = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                    **bound, **alone)
    if spec.training.deterministic:
        set_deterministic(device)
    return Runtime(device=device, rank=rank, world_size=world_size, local_rank=local_rank,
                   single_rank_group=single_rank_group)


def set_collective_timeout(timeout_s: float, *, cuda: bool) -> timedelta:
    """`fault.collective_timeout_s` for the default group and every group created after it.

    torch gives groups made without an explicit timeout (the device mesh's, the checkpoint manager's) its
    module default of 30 minutes (10 for NCCL), not the default group's, so that default is set too. On CUDA,
    NCCL's async error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING=1: the watchdog aborts the communicator and
    ends the process on a timeout) turns a hung collective into a failed worker the elastic agent restarts.
    """
    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return timeout


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


def close_runtime(runtime: Runtime) -> None:
    """End the process group this process started (a no-op with one process)."""
    if (runtime.distributed or runtime.single_rank_group) and dist.is_initialized():
        dist.destroy_process_group()
