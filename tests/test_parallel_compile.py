"""Per-block torch.compile composed with FSDP2 and activation checkpointing, on 2 ranks (the trainer's order:
recompute → compile each block → fully_shard), against the same layout in eager mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from leantrain.parallel import ParallelDims, parallelize
from leantrain.train.build import meta_model
from leantrain.train.precision import resolve_precision
from parallel_harness import GRAD_CLIP, LR, SEED, SEQ_LEN, _loss, batches, make_spec, spawn_gloo


def _losses(*, compile_blocks: bool, steps: int) -> list[float]:
    spec = make_spec(n_layers=2)
    training = spec.training.model_copy(update={"compile": compile_blocks, "activation_checkpointing": "full"})
    spec = spec.model_copy(update={"training": training, "data": spec.data.model_copy(update={"seq_len": SEQ_LEN})})
    model = meta_model(spec, precision=resolve_precision(spec.precision, device=torch.device("cpu")))
    dims = ParallelDims.from_spec(spec.parallelism, world_size=2, shape=model.args.shape)
    micro = batches(0, vocab=64)[dist.get_rank()::2]
    pm = parallelize(model, dims, spec, mesh=dims.build_mesh("cpu"), device=torch.device("cpu"),
                     num_microbatches=len(micro))
    pm.initialize(seed=SEED)
    optimizer = torch.optim.AdamW(list(pm.parameters()), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = pm.forward_backward(batches(step, vocab=64)[dist.get_rank()::2], loss_fn=_loss)
        pm.clip_grad_norm_(GRAD_CLIP)
        optimizer.step()
        losses.append(float(loss))
    return losses


def _eager_and_compiled() -> dict[str, Any]:
    return {"eager": _losses(compile_blocks=False, steps=3), "compiled": _losses(compile_blocks=True, steps=3)}


@pytest.mark.slow
def test_compiled_blocks_with_fsdp2_and_full_recompute_match_eager(tmp_path: Path) -> None:
    result = spawn_gloo(_eager_and_compiled, world_size=2, out_dir=tmp_path)
    assert result["compiled"] == pytest.approx(result["eager"], rel=1e-4)
    assert result["eager"][-1] < result["eager"][0]  # it trains
