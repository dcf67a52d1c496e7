"""The tensor-parallel embedding looks up and differentiates this rank's vocabulary rows only.

torch's RowwiseParallel computes the same forward, but its weight gradient was the whole vocabulary's on every TP
rank (a Replicate DTensor: DTensor has no row-wise rule for the embedding's backward), which FSDP kept in fp32
through a pipeline step: `leantrain rehearse` found it as 1 GiB of temp unexplained by the plan (TP2 × PP2 grid
row, bench/plan_vs_rehearsal.py). One process per rank under a fake process group: its collectives return their
input, so the output is this rank's partial sum, which is what is checked against a plain nn.Embedding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from leantrain.parallel.dryrun import fake_process_group
from leantrain.parallel.tensor import _VocabParallel

VOCAB, DIM, TP = 11, 4, 2  # 11 rows over 2 ranks: 6 and 5, torch.chunk's split


@pytest.mark.parametrize("rank", range(TP))
def test_each_rank_looks_up_and_differentiates_only_its_rows(rank: int) -> None:
    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, DIM)
    ids = torch.tensor([[0, 5, 6, 10, 3, 6]])
    with fake_process_group(rank=rank, world_size=TP):
        mesh = init_device_mesh("cpu", (TP,))
        split = nn.Embedding(VOCAB, DIM)
        split.load_state_dict(reference.state_dict())
        # each rank keeps its own rows of the same weights (a fake group's scatter from rank 0 moves no data)
        parallelize_module(split, mesh, _VocabParallel(output_layout=Replicate()), src_data_rank=None)
        out = split(ids)
        out.pow(2).sum().backward()
        grad = split.weight.grad
    start, rows = (0, 6) if rank == 0 else (6, 5)
    mine = (ids >= start) & (ids < start + rows)
    expected = reference(ids) * mine.unsqueeze(-1)
    torch.testing.assert_close(out, expected)
    assert grad.placements == (Shard(0),)
    assert grad.to_local().shape == (rows, DIM)  # this rank's rows, not the whole vocabulary
    expected.pow(2).sum().backward()
    torch.testing.assert_close(grad.to_local(), reference.weight.grad[start:start + rows])


def test_sequence_parallel_output_is_this_ranks_sequence_chunk() -> None:
    with fake_process_group(rank=1, world_size=TP):
        mesh = init_device_mesh("cpu", (TP,))
        split = nn.Embedding(VOCAB, DIM)
        parallelize_module(split, mesh, _VocabParallel(output_layout=Shard(1)))
        out = split(torch.randint(0, VOCAB, (3, 8)))
        out.sum().backward()
        assert out.shape == (3, 4, DIM)
        assert split.weight.grad.to_local().shape == (5, DIM)
