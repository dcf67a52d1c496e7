"""The process group as `init_runtime` starts it: NCCL bound to this rank's GPU (`device_id`), gloo on the CPU.

No GPU or second process is needed: the CUDA queries and `init_process_group` are replaced by recorders, so the
test reads the arguments a GPU rank under torchrun would pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from leantrain.train.runtime import init_runtime
from parallel_harness import make_spec


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_init_process_group_binds_this_ranks_gpu_on_cuda(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(("init", kwargs)))
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # init_runtime sets them: restored after
        if hasattr(c10d, name):
            monkeypatch.setattr(c10d, name, getattr(c10d, name))
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    spec = make_spec()
    spec.training.device, spec.training.deterministic = "auto", False

    runtime = init_runtime(spec)

    inits = [kwargs for what, kwargs in calls if what == "init"]
    assert len(inits) == 1 and runtime.rank == 3 and runtime.world_size == 4
    if cuda:
        gpu = torch.device("cuda", 1)  # LOCAL_RANK 1 of 2 GPUs
        assert runtime.device == gpu and ("set_device", gpu) in calls
        # eager NCCL init, and the device mesh's sub-groups split from it (ncclCommSplit)
        assert inits[0]["backend"] == "nccl" and inits[0]["device_id"] == gpu
    else:
        assert runtime.device == torch.device("cpu")
        assert inits[0]["backend"] == "gloo" and "device_id" not in inits[0]  # gloo has no device to bind
    assert inits[0]["timeout"].total_seconds() == spec.fault.collective_timeout_s
