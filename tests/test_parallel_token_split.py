"""`parallel.expert.TokenSplit` on 2 gloo ranks with a row count tp does not divide (5 tokens): each rank takes
torch.chunk's rows of a tensor both hold whole, the rows come back together in order, and the gradients are what
one process computes, the same on both ranks (the input's gradient is all-gathered, the output's is sliced)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from leantrain.parallel.expert import TokenSplit
from parallel_harness import spawn_gloo


def _split_and_gather() -> dict[str, Any]:
    split = TokenSplit(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    torch.manual_seed(0)  # the same tensors on both ranks, as TP peers hold them
    x = torch.randn(5, 3, requires_grad=True)
    weight, upstream = torch.randn(3), torch.randn(5, 3)
    rows = split.local(x)
    y = split.gather(rows * weight, tokens=5)
    (y * upstream).sum().backward()
    mine = {"rows": rows.shape[0], "y": y.tolist(), "grad": x.grad.tolist()}
    every: list[Any] = [None, None]
    dist.all_gather_object(every, mine)
    return {"ranks": every, "y": (x * weight).tolist(), "grad": (upstream * weight).tolist()}


@pytest.mark.slow
def test_uneven_rows_split_gather_and_backward_as_one_process(tmp_path: Path) -> None:
    got = spawn_gloo(_split_and_gather, world_size=2, out_dir=tmp_path)
    assert [r["rows"] for r in got["ranks"]] == [3, 2]  # torch.chunk's split of 5 rows
    for rank in got["ranks"]:
        assert torch.allclose(torch.tensor(rank["y"]), torch.tensor(got["y"]), atol=1e-6)
        assert torch.allclose(torch.tensor(rank["grad"]), torch.tensor(got["grad"]), atol=1e-6)
