"""Expert parallelism under full activation checkpointing: the recomputed forward reuses the first forward's
all-to-all split sizes (no second exchange of the counts, no second host read), and trains exactly as without
recompute. 2 gloo ranks (FSDP over both, experts split over both), 2 micro-batches a step, 2 MoE layers; and 4
ranks with two pipeline stages (1F1B, interleaved 1F1B), where a layer has two forwards awaiting their recompute."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from leantrain.model.transformer import Transformer, model_args_from_spec
from leantrain.parallel import ParallelDims, parallelize
from leantrain.parallel import expert as expert_mod
from leantrain.parallel.expert import expert_modules, kept_splits
from leantrain.parallel.parallelize import ParallelModel
from parallel_harness import GRAD_CLIP, SEED, SEQ_LEN, _loss, batches, make_optimizer, make_spec, spawn_gloo

STEPS = 2
NUM_MOE_LAYERS = 2
MICRO_PER_RANK = 2  # 8 sequences a step, micro-batches of 2, 2 data-parallel ranks
FSDP_EP = {"data_parallel": 2, "expert_parallel": 2}
# 4 ranks: 2 stages × (FSDP 2 × EP 2). Stage 0 runs both micro-batches' forwards before their backwards.
PIPELINED = {
    "1f1b": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", **FSDP_EP},  # 1 MoE layer a stage
    "interleaved": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2,
                    "n_layers": 4, **FSDP_EP},  # 2 stage modules of 1 MoE layer each a rank
}


def _build(recompute: str, *, n_layers: int = NUM_MOE_LAYERS, **parallelism: Any) -> ParallelModel:
    spec = make_spec(moe=True, n_layers=n_layers, **parallelism)
    args = model_args_from_spec(spec.model, max_seq_len=SEQ_LEN)
    dims = ParallelDims.from_spec(spec.parallelism, world_size=dist.get_world_size(), shape=args.shape)
    with torch.device("meta"):
        model = Transformer(args)
    model.set_recompute(recompute)  # type: ignore[arg-type]
    pm = parallelize(model, dims, spec, mesh=dims.build_mesh("cpu"), device=torch.device("cpu"),
                     num_microbatches=MICRO_PER_RANK)
    pm.initialize(seed=SEED)
    return pm


@contextmanager
def _counting(counts: Counter[str]) -> Iterator[None]:
    """Count the host reads of the split sizes and the all-to-alls of the counts (the only c10d all_to_all_single
    in a step: FSDP all-gathers and reduce-scatters, the rows travel by the functional all-to-all)."""
    reads, exchange, keep = expert_mod.host_splits, dist.all_to_all_single, expert_mod._keep_splits

    def read(*args: Any, **kwargs: Any) -> Any:
        counts["host_reads"] += 1
        return reads(*args, **kwargs)

    def exchange_counts(*args: Any, **kwargs: Any) -> Any:
        counts["count_exchanges"] += 1
        return exchange(*args, **kwargs)

    def keep_splits(module: Any, kept: Any) -> None:  # how many forwards of one layer await their recompute
        keep(module, kept)
        counts["most_kept_by_a_layer"] = max(counts["most_kept_by_a_layer"], len(module._ep_kept))

    with mock.patch.object(expert_mod, "host_splits", read), mock.patch.object(dist, "all_to_all_single",
                                                                                exchange_counts), \
            mock.patch.object(expert_mod, "_keep_splits", keep_splits):
        yield


def _grads(pm: ParallelModel) -> list[torch.Tensor]:
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for p in pm.parameters()
            if p.grad is not None]


def _kept(pm: ParallelModel) -> int:
    return sum(kept_splits(part) for part in pm.parts)


def _train(recompute: str, *, layout: dict[str, Any] = FSDP_EP, eval_forwards: bool = True) -> dict[str, Any]:
    pm = _build(recompute, **layout)
    optimizer = make_optimizer(make_spec(moe=True), list(pm.parameters()))
    out: dict[str, Any] = {"loss": [], "grads": [], "per_step": [], "kept_after_step": []}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        counts: Counter[str] = Counter()
        with _counting(counts):
            loss = pm.forward_backward(batches(step, vocab=64)[pm.dp_rank::pm.dp_size], loss_fn=_loss)
        pm.finish_gradients()
        out["per_step"].append(dict(counts))
        out["kept_after_step"].append(_kept(pm))
        out["grads"].append(_grads(pm))
        pm.clip_grad_norm_(GRAD_CLIP)
        optimizer.step()
        out["loss"].append(float(loss))
    if not eval_forwards:  # a pipeline stage is run by its schedule, not called on tokens
        return out
    inputs = batches(STEPS, vocab=64)[pm.dp_rank][0]
    with torch.no_grad():
        pm.model(inputs)
    out["kept_after_no_grad_eval"] = _kept(pm)
    logits = pm.model(inputs)  # under grad, never backwarded: what it kept goes with its graph
    out["kept_while_graph_alive"] = _kept(pm)
    del logits
    with torch.no_grad():  # the model holds its last aux loss (and through it the graph) until its next forward
        pm.model(inputs)
    out["kept_after_graph_dropped"] = _kept(pm)
    return out


def _backward_after(tamper: Callable[[ParallelModel], None]) -> str:
    """One micro-batch's forward under full recompute, `tamper` with what it kept, then its backward's error."""
    pm = _build("full", data_parallel=2, expert_parallel=2)
    inputs, targets = batches(0, vocab=64)[pm.dp_rank]
    loss = _loss(pm.model(inputs), targets)
    tamper(pm)  # the same on both ranks, so both fail at the same layer before any collective of its recompute
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _drop_kept(pm: ParallelModel) -> None:
    for experts in expert_modules(pm.model):
        experts._ep_kept.clear()


def _other_counts(pm: ParallelModel) -> None:
    for experts in expert_modules(pm.model):
        kept = experts._ep_kept[0]()
        kept.counts = kept.counts + 1


def _against_no_recompute(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each run without its gradients, plus how they compare with the run without recompute on every rank."""
    result: dict[str, Any] = {}
    for mode, run in runs.items():
        pairs = [(mine, ref) for step_mine, step_ref in zip(run["grads"], runs["none"]["grads"], strict=True)
                 for mine, ref in zip(step_mine, step_ref, strict=True)]
        # (all equal, count, largest difference) over the ranks: each pipeline stage holds its own parameters
        flags = torch.tensor([float(not all(torch.equal(mine, ref) for mine, ref in pairs)), -float(len(pairs)),
                              max(float((mine - ref).abs().max()) for mine, ref in pairs)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        result[mode] = {k: v for k, v in run.items() if k != "grads"} | {
            "grads_equal": flags[0].item() == 0.0, "min_num_grads": -int(flags[1]), "grad_max_diff": float(flags[2]),
        }
    return result


def _all_runs() -> dict[str, Any]:
    result = _against_no_recompute({mode: _train(mode) for mode in ("none", "selective", "full")})
    result["no_kept_splits"] = _backward_after(_drop_kept)
    result["other_counts"] = _backward_after(_other_counts)
    return result


def _pipelined_runs() -> dict[str, Any]:
    return {name: _against_no_recompute({mode: _train(mode, layout=layout, eval_forwards=False)
                                         for mode in ("none", "full")})
            for name, layout in PIPELINED.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return spawn_gloo(_all_runs, world_size=2, out_dir=tmp_path_factory.mktemp("ep_recompute"))


@pytest.mark.slow
def test_full_recompute_trains_exactly_as_no_recompute(runs: dict[str, Any]) -> None:
    for mode in ("selective", "full"):
        assert runs[mode]["loss"] == runs["none"]["loss"], mode
        assert runs[mode]["min_num_grads"] > 0 and runs[mode]["grads_equal"], (mode, runs[mode]["grad_max_diff"])
    assert runs["none"]["loss"][1] < runs["none"]["loss"][0]  # it trains: equal runs mean something


@pytest.mark.slow
def test_recompute_reads_the_split_sizes_once_per_moe_layer_and_micro_batch(runs: dict[str, Any]) -> None:
    once = {"host_reads": NUM_MOE_LAYERS * MICRO_PER_RANK, "count_exchanges": NUM_MOE_LAYERS * MICRO_PER_RANK}
    for mode in ("none", "selective", "full"):
        # only a checkpointed forward keeps its splits; plain accumulation recomputes each before the next forward
        kept = {"most_kept_by_a_layer": 1} if mode == "full" else {}
        assert runs[mode]["per_step"] == [once | kept] * STEPS, mode


@pytest.mark.slow
def test_nothing_is_kept_after_a_step_or_an_eval_forward(runs: dict[str, Any]) -> None:
    for mode in ("none", "selective", "full"):
        run = runs[mode]
        assert run["kept_after_step"] == [0] * STEPS, mode
        assert run["kept_after_no_grad_eval"] == 0, mode
        # kept while a backward may come, by a checkpointed forward only
        assert run["kept_while_graph_alive"] == (NUM_MOE_LAYERS if mode == "full" else 0), mode
        assert run["kept_after_graph_dropped"] == 0, mode


@pytest.mark.slow
def test_a_recompute_without_its_forwards_splits_fails_loudly(runs: dict[str, Any]) -> None:
    assert "found no split sizes kept by its first forward" in runs["no_kept_splits"]
    assert "routed other counts than the oldest kept forward" in runs["other_counts"]


@pytest.mark.slow
def test_pipelined_full_recompute_trains_exactly_and_reads_once(tmp_path: Path) -> None:
    # Under 1F1B and interleaved 1F1B several forwards run before their backwards: each recompute must take its
    # own micro-batch's splits (another's would fail the device check or route rows wrongly, so grads would differ).
    runs = spawn_gloo(_pipelined_runs, world_size=4, out_dir=tmp_path)
    for name, layout in PIPELINED.items():
        none, full = runs[name]["none"], runs[name]["full"]
        assert full["loss"] == none["loss"], name
        assert full["min_num_grads"] > 0 and full["grads_equal"], (name, full["grad_max_diff"])
        moe_layers_per_rank = layout.get("n_layers", NUM_MOE_LAYERS) // layout["pipeline_parallel"]
        once = {"host_reads": moe_layers_per_rank * MICRO_PER_RANK,
                "count_exchanges": moe_layers_per_rank * MICRO_PER_RANK}
        assert none["per_step"] == [once] * STEPS, name  # rank 0's (stage 0)
        # stage 0 runs both micro-batches' forwards before the first backward: two forwards of a layer kept at once
        assert full["per_step"] == [once | {"most_kept_by_a_layer": MICRO_PER_RANK}] * STEPS, name
        assert full["kept_after_step"] == [0] * STEPS, name
