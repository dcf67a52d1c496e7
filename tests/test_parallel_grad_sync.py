"""Gradient memory between micro-batches under FSDP2 (`parallelism.grad_sync`), measured on 2 ranks.

every_micro_batch (the default) reduce-scatters after each micro-batch, so between micro-batches a rank holds
only its gradient shard (about 1/dp of the fp32 gradients); last_micro_batch holds every parameter's unsharded
gradient until the last micro-batch (the full size). Both give the same step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from leantrain.model.transformer import Transformer, model_args_from_spec
from leantrain.parallel import ParallelDims, parallelize
from leantrain.parallel.fsdp import held_gradient_bytes
from parallel_harness import MICRO_BATCH, SEED, SEQ_LEN, _loss, batches, make_spec, spawn_gloo


def _measure(grad_sync: str) -> dict[str, Any]:
    spec = make_spec(n_layers=4, grad_sync=grad_sync)
    args = model_args_from_spec(spec.model, max_seq_len=SEQ_LEN)
    dims = ParallelDims.from_spec(spec.parallelism, world_size=dist.get_world_size(), shape=args.shape)
    with torch.device("meta"):
        model = Transformer(args)
    micro = batches(0, vocab=64)[dist.get_rank()::2]  # 2 micro-batches per rank
    pm = parallelize(model, dims, spec, mesh=dims.build_mesh("cpu"), device=torch.device("cpu"),
                     num_microbatches=len(micro))
    pm.initialize(seed=SEED)
    held: list[int] = []
    loss = pm.forward_backward(micro, loss_fn=_loss,
                               after_micro_batch=lambda _index: held.append(held_gradient_bytes(pm.parts)))
    full_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())  # DTensor numel: the global size
    return {"held": held, "full_bytes": full_bytes, "loss": float(loss), "grad_norm": float(pm.grad_norm()),
            "micro_batch": MICRO_BATCH}


def _both_modes() -> dict[str, Any]:
    return {mode: _measure(mode) for mode in ("every_micro_batch", "last_micro_batch")}


@pytest.mark.slow
def test_every_micro_batch_holds_only_sharded_gradients(tmp_path: Path) -> None:
    results = spawn_gloo(_both_modes, world_size=2, out_dir=tmp_path)
    every, last = results["every_micro_batch"], results["last_micro_batch"]
    full = every["full_bytes"]
    # Between micro-batches (after the first): the shard only, against every parameter's unsharded gradient.
    assert every["held"][0] == pytest.approx(full / 2, rel=0.1)
    assert last["held"][0] == pytest.approx(full, rel=0.05)
    # After the last micro-batch both hold sharded gradients only, and the step is the same.
    for mode in (every, last):
        assert mode["held"][-1] == pytest.approx(full / 2, rel=0.1)
    assert every["loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert every["grad_norm"] == pytest.approx(last["grad_norm"], rel=1e-5)
