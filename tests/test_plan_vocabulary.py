"""One vocabulary with the trainer: every layout the search returns is a spec the rules accept, every recompute
mode it prices can be written in `training.activation_checkpointing`, and memory units are explicit."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from leantrain.errors import SpecError
from leantrain.plan.inputs import plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.search import RECOMPUTE, search_layouts
from leantrain.spec import load_spec
from leantrain.spec.schema import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def layout_overrides(layout: Layout, *, gpus_per_node: int) -> list[str]:
    """The spec fields that say a layout, as `--set` overrides."""
    gpus = layout.num_gpus
    return [f"parallelism.data_parallel={layout.dp}", f"parallelism.tensor_parallel={layout.tp}",
            f"parallelism.pipeline_parallel={layout.pp}", f"parallelism.expert_parallel={layout.ep}",
            f"parallelism.data_parallel_replicate={layout.dp_replicate}", f"parallelism.zero_stage={layout.zero}",
            f"parallelism.pipeline_schedule={layout.schedule}", f"parallelism.virtual_stages={layout.virtual_stages}",
            f"parallelism.sequence_parallel={str(layout.sequence_parallel).lower()}",
            f"training.micro_batch={layout.micro_batch}", f"training.activation_checkpointing={layout.recompute}",
            f"hardware.num_nodes={max(1, gpus // gpus_per_node)}", f"hardware.gpus_per_node={min(gpus, gpus_per_node)}",
            f"budget.num_gpus={gpus}", "fault.min_nodes=null", "fault.max_nodes=null"]


def test_search_prices_only_recompute_modes_the_spec_can_write() -> None:
    allowed = set(typing.get_args(TrainingSpec.model_fields["activation_checkpointing"].annotation))
    assert set(RECOMPUTE) <= allowed


@pytest.mark.parametrize(("example", "gpus"), [("llama3-8b-h100.yaml", 64), ("moe-small-cpu.yaml", 4),
                                               ("llama3-405b.yaml", 512)])
def test_every_search_result_passes_the_spec_rules(example: str, gpus: int) -> None:
    spec = load_spec(EXAMPLES / example)
    found = search_layouts(plan_inputs(spec), gpus, top_k=25, suggest=False)
    assert found.ranked, example
    for cand in found.ranked:
        overrides = layout_overrides(cand.layout, gpus_per_node=spec.hardware.gpus_per_node)
        try:
            load_spec(EXAMPLES / example, overrides=overrides)
        except SpecError as err:
            pytest.fail(f"{example}: searched layout {cand.layout.describe()} is refused by the spec rules: {err}")


def test_bare_memory_number_is_refused_with_both_readings() -> None:
    with pytest.raises(SpecError) as err:
        load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=["hardware.memory_gb=96"])
    text = str(err.value)
    assert "hardware.memory_gb" in text and "89.4 GiB" in text and "103.1 GB" in text


@pytest.mark.parametrize(("override", "gib"), [("hardware.memory_gb=96 GiB", 96.0), ("hardware.memory_gib=96", 96.0),
                                               ("hardware.memory_gb=96GB", 96e9 / 2**30),
                                               ("hardware.memory_gb=89.4", 89.4e9 / 2**30)])
def test_memory_with_its_unit(override: str, gib: float) -> None:
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=[override])
    assert spec.hardware.memory_bytes / 2**30 == pytest.approx(gib)
    assert plan_inputs(spec).memory_bytes == pytest.approx(spec.hardware.memory_bytes)


def test_both_memory_fields_are_refused() -> None:
    with pytest.raises(SpecError, match="memory_gb or memory_gib"):
        load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=["hardware.memory_gb=96 GiB", "hardware.memory_gib=96"])
