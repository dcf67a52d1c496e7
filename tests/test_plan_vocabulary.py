"""One vocabulary with the trainer: every layout the search returns is a spec the rules accept, every recompute
mode it prices can be written in `training.activation_checkpointing`, and memory units are explicit."""

from __future__ import annotations

import typing
from dataclasses import replace
from pathlib import Path

import pytest

from leantrain.errors import SpecError
from leantrain.plan.inputs import plan_inputs, sequences_per_step
from leantrain.plan.layout import Layout
from leantrain.plan.memory import memory_per_gpu
from leantrain.plan.planner import build_plan
from leantrain.plan.search import recompute_ladder, search_layouts
from leantrain.plan.timing import step_time
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


def test_every_recompute_mode_the_planner_prices_is_written_in_the_spec_and_run_by_the_model() -> None:
    """The planner's modes (the search's and `op`, torchtitan's op-level policy, which the torchtitan memory rows are
    planned with) are the spec's and the model's: until 2026-12-06 `op` was priced but refused by the spec."""
    from leantrain.model.transformer import Recompute as ModelRecompute
    from leantrain.plan.flops import Recompute as PlanRecompute

    allowed = set(typing.get_args(TrainingSpec.model_fields["activation_checkpointing"].annotation))
    dense = plan_inputs(load_spec(EXAMPLES / "llama3-8b-h100.yaml"))
    assert {mode for tier in recompute_ladder(dense) for mode in tier} == allowed
    assert set(typing.get_args(PlanRecompute)) == allowed == set(typing.get_args(ModelRecompute))
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=["training.activation_checkpointing=op"])
    assert build_plan(spec).chosen.layout.recompute == "op"
    with pytest.raises(SpecError, match="op is for dense SwiGLU models .* not an MoE model"):
        load_spec(EXAMPLES / "moe-small-cpu.yaml", overrides=["training.activation_checkpointing=op"])
    for other, kind in (("model.mlp=gelu", "a gelu MLP"), ("model.mlp=squared_relu", "a squared_relu MLP")):
        with pytest.raises(SpecError, match=f"not {kind}"):  # six matmuls a block: the policy keeps other tensors
            load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=["training.activation_checkpointing=op", other])
    with pytest.raises(SpecError, match="not finetune.method qlora"):  # adapter matmuls shift the count
        load_spec(EXAMPLES / "qlora-70b.yaml", overrides=["training.activation_checkpointing=op"])
    with pytest.raises(SpecError, match="not finetune.dpo.weights lora"):  # DPO's weights are set there
        load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=[
            "task=finetune", "finetune.method=dpo", "finetune.dpo.weights=lora",
            "training.activation_checkpointing=op"])


# Each example at GPU counts whose factors differ from its batch's and its shape's (120 = 8 × 15 against batches of
# 2^k sequences), seed-10b.yaml at the count its own plan chooses (120: until 2026-12-06 it chose dp120 for a batch of
# 1,024 sequences, which the trainer refuses), shapes whose KV heads or FFN do not divide every tp (the search
# replicated the one and padded the other), and QLoRA (the search pipelined it, then spread it over data-parallel
# ranks, which the trainer refuses: its NF4 base is not sharded).
WALKS = [("llama3-8b-h100.yaml", 64, ()), ("moe-small-cpu.yaml", 4, ()), ("llama3-405b.yaml", 512, ()),
         ("seed-10b.yaml", 120, ()), ("llama3-8b-h100.yaml", 120, ()), ("gpu-1b-bench.yaml", 120, ()),
         ("deepseek-v3.yaml", 2048, ()), ("qlora-70b.yaml", 1, ()),
         ("llama3-8b-h100.yaml", 64, ("model.n_kv_heads=2",)), ("llama3-8b-h100.yaml", 64, ("model.ffn_hidden=14340",))]


@pytest.mark.parametrize(("example", "gpus", "shape"), WALKS)
def test_every_search_result_passes_the_spec_rules(example: str, gpus: int, shape: tuple[str, ...]) -> None:
    spec = load_spec(EXAMPLES / example, overrides=list(shape))
    found = search_layouts(plan_inputs(spec), gpus, top_k=1000, suggest=False)
    assert found.ranked, (example, gpus, shape, found.rejected)
    step = max(1, len(found.ranked) // 40)  # the best, then every step-th: each (tp, pp, dp, mb) family is met
    for cand in found.ranked[::step]:
        overrides = [*shape, *layout_overrides(cand.layout, gpus_per_node=spec.hardware.gpus_per_node)]
        try:
            load_spec(EXAMPLES / example, overrides=overrides)
        except SpecError as err:
            pytest.fail(f"{example} {shape}: searched {cand.layout.describe()} is refused by the spec rules: {err}")


def test_qlora_is_searched_and_checked_as_the_one_process_job_the_trainer_runs() -> None:
    """The trainer runs QLoRA in one process; `check` accepted data_parallel 8 and the search returned dp 8 and
    dp 16 layouts, which train refused only after building the model."""
    for gpus in (8, 16):
        found = search_layouts(plan_inputs(load_spec(EXAMPLES / "qlora-70b.yaml")), gpus, top_k=1000, suggest=False)
        assert not found.ranked and any("qlora runs in one process" in reason for reason in found.rejected), gpus
    with pytest.raises(SpecError, match="qlora runs in one process"):
        load_spec(EXAMPLES / "qlora-70b.yaml", overrides=layout_overrides(
            Layout(dp=8, tp=1, pp=1, micro_batch=1), gpus_per_node=8))


@pytest.mark.parametrize(("example", "overrides", "op"), [
    ("llama3-8b-h100.yaml", (), True), ("moe-small-cpu.yaml", (), False), ("deepseek-v3.yaml", (), False),
    ("llama3-8b-h100.yaml", ("model.mlp=gelu",), False), ("qlora-70b.yaml", (), False)])
def test_the_search_tries_op_recompute_only_where_the_trainer_runs_it(example: str, overrides: tuple[str, ...],
                                                                      op: bool) -> None:
    """`op` is in the search's ladder for dense SwiGLU blocks with full weights and nowhere else (spec/rules.py
    `op_recompute_problem`, the rule `check` applies), beside selective, between none and full."""
    inputs = plan_inputs(load_spec(EXAMPLES / example, overrides=list(overrides)))
    assert recompute_ladder(inputs) == (("none",), ("selective", "op") if op else ("selective",), ("full",))


def test_the_search_ranks_op_where_it_is_the_fastest_policy_that_fits() -> None:
    """Llama 3 8B at 8K on 8 H100s: where no recompute does not fit, op keeps fewer tensors than selective (eager
    blocks with flash attention: selective drops only the log-sum-exp) and the search ranks op layouts; before op
    was in the ladder those fell to full recompute. Each op layout is one where none did not fit and it was the
    faster of selective and op that fit; the best passes the spec rules."""
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml")
    inputs = plan_inputs(spec)
    found = search_layouts(inputs, 8, top_k=1000, suggest=False)
    ops = [c for c in found.ranked if c.layout.recompute == "op"]
    assert ops, sorted({c.layout.recompute for c in found.ranked})
    for cand in ops:
        m = cand.layout.num_microbatches(sequences_per_step(inputs))
        assert not memory_per_gpu(inputs, replace(cand.layout, recompute="none"), num_microbatches=m).fits
        selective = replace(cand.layout, recompute="selective")
        if memory_per_gpu(inputs, selective, num_microbatches=m).fits:
            seqs = sequences_per_step(inputs)
            assert step_time(inputs, selective, sequences_per_step=seqs).tokens_per_s <= cand.time.tokens_per_s
    load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=layout_overrides(ops[0].layout, gpus_per_node=8))


def test_a_batch_that_splits_over_few_replicas_gets_a_note_with_what_divides() -> None:
    """seed-10b.yaml's 1,024-sequence batch on the 120 GPUs its plan chooses: only dp8 layouts divide it, so the plan
    says which global batches (multiples of 120 × 4,096 tokens) or GPU count (128) would; the chosen layout passes
    check."""
    plan = build_plan(load_spec(EXAMPLES / "seed-10b.yaml"))
    assert plan.layout_gpus == 120 and plan.chosen.layout.dp == 8, plan.chosen.layout.describe()
    note = next(n for n in plan.notes if "splits the global batch" in n)
    assert "training.global_batch_tokens to 3932160 or 4423680" in note and "128 GPUs" in note
    layout = plan.chosen.layout
    load_spec(EXAMPLES / "seed-10b.yaml", overrides=layout_overrides(layout, gpus_per_node=8))
    # with a batch that divides, the search is free again and the note is gone
    free = build_plan(load_spec(EXAMPLES / "seed-10b.yaml", overrides=["training.global_batch_tokens=3932160"]))
    assert free.chosen.layout.dp > 8 and not any("splits the global batch" in n for n in free.notes)


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


def test_host_memory_per_node_needs_its_unit_too() -> None:
    """`cluster.memory_gb_per_node: 512` was read as GiB (the job files request 512G / 512Gi) under a GB name: a bare
    whole number is now refused with both readings, as `hardware.memory_gb` is; a unit or memory_gib_per_node says
    which."""
    with pytest.raises(SpecError) as err:
        load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=["cluster.memory_gb_per_node=512"])
    text = str(err.value)
    assert "cluster.memory_gb_per_node" in text and "476.8 GiB" in text and "549.8 GB" in text
    assert "memory_gib_per_node: 512" in text
    for override, gib in (("cluster.memory_gb_per_node=512 GiB", 512.0), ("cluster.memory_gib_per_node=512", 512.0),
                          ("cluster.memory_gb_per_node=550 GB", 550e9 / 2**30)):
        spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml", overrides=[override])
        assert spec.cluster.host_memory_gib == pytest.approx(gib)
        assert build_plan(spec).host_memory["host_memory_bytes_per_node"] == pytest.approx(gib * 2**30)
    with pytest.raises(SpecError, match="memory_gb_per_node or memory_gib_per_node"):
        load_spec(EXAMPLES / "llama3-8b-h100.yaml",
                  overrides=["cluster.memory_gb_per_node=512 GiB", "cluster.memory_gib_per_node=512"])


def test_preference_tuning_layouts_have_no_tp_or_pipeline_dpo_and_orpo_alike() -> None:
    """finetune.method dpo (with its DPO or ORPO loss: ORPO keeps no reference model) runs with data parallelism /
    FSDP only (spec/rules.py `finetune_layout_problems`), so the search offers nothing else; it keyed on the
    reference model until 2026-12-06 and offered ORPO tp and pp layouts the trainer refuses."""
    import dataclasses

    from leantrain.plan.search import candidate_layouts

    inputs = plan_inputs(load_spec(EXAMPLES / "llama3-8b-h100.yaml"))
    for reference in ("copy", "none"):  # DPO's full copy, ORPO's none
        orpo_or_dpo = dataclasses.replace(inputs, preference=True, finetune="full", dpo_reference=reference)
        layouts = candidate_layouts(orpo_or_dpo, 64, max_micro_batch=8)
        assert layouts and {(lay.tp, lay.pp) for lay in layouts} == {(1, 1)}, reference
