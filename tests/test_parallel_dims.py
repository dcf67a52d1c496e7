"""Layout checks (before any rank starts), mesh axes, precision policy, stage split and comm-time arithmetic."""

from __future__ import annotations

import re

import pydantic
import pytest
import torch

from leantrain.errors import UserInputError
from leantrain.parallel.comm import comm_seconds, is_comm_event, union_seconds
from leantrain.parallel.dims import ParallelDims, resolve_parallelism
from leantrain.parallel.fsdp import mixed_precision_policy
from leantrain.parallel.pipeline import split_layers
from leantrain.spec.schema import ParallelismSpec, PrecisionSpec
from leantrain.spec.shapes import resolve_shape
from parallel_harness import make_spec


def dims_for(world_size: int, **par: object) -> ParallelDims:
    return ParallelDims.from_spec(ParallelismSpec(**par), world_size=world_size)


def test_data_parallel_fills_what_tp_and_pp_leave() -> None:
    dims = dims_for(8, tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 2, 2)
    assert dims.mesh_shape == (2, 1, 2, 1, 2) and not dims.notes
    grown = dims_for(16, tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    assert grown.dp == 4 and "data_parallel is 2 in the spec" in grown.notes[0]


def test_expert_parallel_borrows_from_the_shard_axis() -> None:
    dims = dims_for(8, data_parallel=8, expert_parallel=4, data_parallel_replicate=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.dp_shard_mod_ep) == (2, 4, 4, 1)


def test_zero_stage_0_replicates_every_data_parallel_rank() -> None:
    dims = dims_for(4, data_parallel=4, zero_stage=0)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 1)


@pytest.mark.parametrize(
    ("world_size", "par", "axis"),
    [
        (4, {"tensor_parallel": 3}, "parallelism.tensor_parallel (3) does not divide the world size (4"),
        (6, {"pipeline_parallel": 4}, "parallelism.pipeline_parallel (4)"),
        (6, {"tensor_parallel": 2, "pipeline_parallel": 3, "data_parallel": 1}, None),
        (4, {"tensor_parallel": 2, "pipeline_parallel": 4}, "tensor_parallel × pipeline_parallel = 2 × 4 = 8 does not"),
        (6, {"data_parallel": 6, "data_parallel_replicate": 4}, "parallelism.data_parallel_replicate (4)"),
        (4, {"data_parallel": 4, "expert_parallel": 3}, "parallelism.expert_parallel (3)"),
        (4, {"data_parallel": 4, "expert_parallel": 2, "zero_stage": 0}, "zero_stage 0 replicates"),
    ],
)
def test_bad_layouts_name_the_axis(world_size: int, par: dict[str, object], axis: str | None) -> None:
    if axis is None:
        assert dims_for(world_size, **par).world_size == world_size
        return
    with pytest.raises(UserInputError, match=re.escape(axis)):
        dims_for(world_size, **par)


def test_tp_that_does_not_divide_the_heads_is_refused_with_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"tensor_parallel \(3\) must divide model n_heads \(4\)"):
        make_spec(tensor_parallel=3)
    spec = make_spec(tensor_parallel=2)
    shape = resolve_shape(spec.model.model_copy(update={"n_heads": 6, "n_kv_heads": 3, "d_model": 36}))
    with pytest.raises(UserInputError, match=r"tensor_parallel \(2\) must divide model.n_kv_heads \(3\)"):
        ParallelDims.from_spec(spec.parallelism, world_size=2, shape=shape)


def test_shape_rules_for_pipeline_and_experts() -> None:
    tied = make_spec(tie=True)
    with pytest.raises(UserInputError, match="tie_embeddings: false"):
        ParallelDims.from_spec(ParallelismSpec(pipeline_parallel=2), world_size=2, shape=resolve_shape(tied.model))
    dense = make_spec()
    with pytest.raises(UserInputError, match="needs model.architecture: moe"):
        ParallelDims.from_spec(ParallelismSpec(data_parallel=2, expert_parallel=2), world_size=2,
                               shape=resolve_shape(dense.model))


def test_tp_across_nodes_is_a_warning_not_an_error() -> None:
    dims = ParallelDims.from_spec(ParallelismSpec(tensor_parallel=4), world_size=8, gpus_per_node=2)
    assert any("spans nodes" in note for note in dims.notes)


def test_layout_auto_takes_the_planners_layout() -> None:
    spec = make_spec()
    auto = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"layout": "auto"})})
    from leantrain.plan.planner import make_plan

    planned = make_plan(auto)["layout"]
    world = planned["dp"] * planned["tp"] * planned["pp"]
    par = resolve_parallelism(auto, world_size=world)
    assert (par.data_parallel, par.tensor_parallel, par.pipeline_parallel) == (planned["dp"], planned["tp"],
                                                                               planned["pp"])
    with pytest.raises(UserInputError, match="layout: auto"):
        resolve_parallelism(auto, world_size=world + 1)
    assert resolve_parallelism(spec, world_size=3) is spec.parallelism  # layout: spec is used as written


def test_mixed_precision_policy_follows_the_precision_section() -> None:
    bf16 = mixed_precision_policy(PrecisionSpec(compute="bf16", master_weights="fp32", grad_reduce="fp32"))
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = mixed_precision_policy(PrecisionSpec(compute="fp32"))
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)


def test_split_layers_is_balanced_and_ordered() -> None:
    """Consecutive layers, the first and the last chunk shorter when the chunks do not divide them (they hold the
    embedding and the loss), and per pipeline rank the counts the planner prices."""
    from leantrain.plan.activations import stage_layers

    assert split_layers(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert split_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for n_layers, pp, v in ((61, 16, 1), (126, 16, 7), (126, 8, 1), (30, 4, 3), (17, 4, 2)):
        chunks = split_layers(n_layers, pp * v)
        assert [i for chunk in chunks for i in chunk] == list(range(n_layers))
        per_rank = [sum(len(chunk) for chunk in chunks[rank::pp]) for rank in range(pp)]
        assert per_rank == stage_layers(n_layers, pp, v)
    assert [len(c) for c in split_layers(61, 16)] == [3, 3] + [4] * 13 + [3]  # DeepSeek-V3's 61 on PP16
    with pytest.raises(UserInputError):
        split_layers(2, 3)


def test_union_of_overlapping_intervals_counts_time_once() -> None:
    assert union_seconds([(0, 1_000_000), (500_000, 1_500_000), (3_000_000, 3_500_000)]) == pytest.approx(2.0)
    assert union_seconds([]) == 0.0
    assert is_comm_event("c10d::allreduce_") and is_comm_event("gloo:all_gather") and not is_comm_event("aten::mm")


def test_comm_seconds_reads_profiler_events() -> None:
    class Event:
        def __init__(self, name: str, start: float, end: float) -> None:
            self.name, self.device_type = name, type("D", (), {"name": "CPU"})()
            self.time_range = type("R", (), {"start": start, "end": end})()

    events = [Event("aten::mm", 0, 10), Event("c10d::allreduce_", 10, 30), Event("gloo:all_reduce", 12, 28)]
    assert comm_seconds(events, device_type="cpu") == (pytest.approx(20e-6), 2)  # type: ignore[arg-type]
