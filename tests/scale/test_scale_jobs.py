"""The scale lane: the real jobs rehearsed at their real world sizes (docs/rehearse.md), and what they must show.

Llama 3.1 8B on 128 ranks (FSDP128), 70B on 256 (FSDP32 × TP8), 405B on 16,384 (ZeRO-2 FSDP128 × TP8 × PP16, as
Meta ran it), DeepSeek-V3 on 2,048 (EP64 × PP16: multi-head latent attention, 256 experts of 2,048, d 7,168,
vocabulary 129,280). Layers are cut to a few
(one per pipeline stage) so each rehearsal takes seconds; widths, vocabulary, experts and world size are real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pins import (
    EXAMPLES,
    collectives_bounded_by_layers,
    few_control_collectives,
    memory_fits,
    no_host_syncs,
    same_collectives_at_both_sizes,
    startup_files_do_not_grow,
)

LLAMA_8B = ("llama3-8b-h100.yaml", ("model.n_layers=2", "fault.max_nodes=32", "parallelism.data_parallel=128",
                                    "hardware.num_nodes=16", "budget.num_gpus=128"))
LLAMA_70B = ("llama3-8b-h100.yaml", (
    "model.n_layers=2", "fault.max_nodes=32", "model.d_model=8192", "model.n_heads=64", "model.n_kv_heads=8",
    "model.ffn_hidden=28672",
    "parallelism.data_parallel=32", "parallelism.tensor_parallel=8", "hardware.num_nodes=32", "budget.num_gpus=256",
    "training.global_batch_tokens=1048576"))  # 4 micro-batches per step keep the lane quick
LLAMA_405B = ("llama3-405b.yaml", (
    "model.n_layers=16", "parallelism.pipeline_schedule=1f1b", "parallelism.virtual_stages=1"))
DEEPSEEK_V3 = ("deepseek-v3.yaml", (
    "parallelism.pipeline_schedule=1f1b", "precision.compute=bf16", "model.n_layers=16",
    "model.moe.first_dense_layers=0", "training.global_batch_tokens=8388608"))


def _job(rehearse_job: Any, job: tuple[str, tuple[str, ...]], *, ranks: tuple[int, ...] = (0,),
         extra: tuple[str, ...] = ()) -> dict[str, Any]:
    example, sets = job
    return rehearse_job(example, ranks=ranks, sets=(*sets, *extra))


@pytest.fixture(scope="module")
def jobs(rehearse_job: Any) -> dict[str, dict[str, Any]]:
    return {
        "8B/128": _job(rehearse_job, LLAMA_8B),
        "70B/256": _job(rehearse_job, LLAMA_70B),
        "405B/16384": _job(rehearse_job, LLAMA_405B, ranks=(0, 16383)),
        "DeepSeek-V3/2048": _job(rehearse_job, DEEPSEEK_V3),
    }


def test_the_jobs_run_at_their_world_sizes(jobs: dict[str, dict[str, Any]]) -> None:
    assert {name: r["world_size"] for name, r in jobs.items()} == {
        "8B/128": 128, "70B/256": 256, "405B/16384": 16384, "DeepSeek-V3/2048": 2048}
    assert jobs["405B/16384"]["layout"].startswith("pp 16") and "tp 8" in jobs["405B/16384"]["layout"]
    assert "(ep 64)" in jobs["DeepSeek-V3/2048"]["layout"]
    stages = {r["rank"]: r["pipeline_stage"] for r in jobs["405B/16384"]["ranks"]}
    assert stages == {0: 0, 16383: 15}


def test_every_rank_fits_its_accelerator(jobs: dict[str, dict[str, Any]]) -> None:
    for name, report in jobs.items():
        assert not memory_fits(report), name
        for rank in report["ranks"]:
            memory = rank["memory_bytes"]
            assert memory["peak"] >= memory["params"] + memory["grads"] + memory["optimizer"] > 0, (name, memory)


def test_no_host_sync_in_a_step_outside_logging(jobs: dict[str, dict[str, Any]]) -> None:
    for name, report in jobs.items():
        if name != "DeepSeek-V3/2048":
            assert not no_host_syncs(report), name


def test_an_moe_step_syncs_only_for_the_all_to_all_sizes(jobs: dict[str, dict[str, Any]]) -> None:
    # Dropless expert parallelism needs its all-to-all split sizes on the host: one read per MoE layer and
    # micro-batch (as torchtitan's dispatch), nothing else. The example recomputes in full (it does not fit 80 GB
    # under 1F1B otherwise); the recomputed forward takes the first forward's splits (parallel/expert.py), so it
    # reads none (before that: 32 a step with full recompute, 16 with selective, 16 micro-batches).
    report = jobs["DeepSeek-V3/2048"]
    counts = report["ranks"][0]["host_sync_counts"]["step"]
    assert len(counts) == 1 and "leantrain/parallel/expert.py:" in next(iter(counts)) and next(iter(counts)).endswith(
        "expert split sizes (.tolist)"), counts
    assert sum(counts.values()) == report["num_microbatches"]  # one MoE layer on this stage, full recompute


def test_control_collectives_at_most_one_per_50_steps(jobs: dict[str, dict[str, Any]]) -> None:
    for name, report in jobs.items():
        assert not few_control_collectives(report), name


def test_collectives_per_step_grow_with_layers_not_ranks(jobs: dict[str, dict[str, Any]]) -> None:
    for name, units in (("8B/128", 4), ("70B/256", 4), ("405B/16384", 3), ("DeepSeek-V3/2048", 3)):
        assert not collectives_bounded_by_layers(jobs[name], units_per_rank=units), name


def test_collectives_and_startup_files_do_not_change_with_the_world(rehearse_job: Any) -> None:
    # 64 and 128 ranks with the same micro-batches per step (the global batch scales with the world)
    small = _job(rehearse_job, LLAMA_8B, extra=("parallelism.data_parallel=64", "hardware.num_nodes=8",
                                                 "budget.num_gpus=64", "training.global_batch_tokens=2097152"))
    large = _job(rehearse_job, LLAMA_8B)  # 128 ranks, the example's 4M-token batch: the jobs' own rehearsal
    assert (small["world_size"], large["world_size"]) == (64, 128)
    assert small["num_microbatches"] == large["num_microbatches"]
    assert not same_collectives_at_both_sizes(small, large)
    assert not startup_files_do_not_grow(small, large)
    bytes_small = {(c["op"], c["group"]): c["bytes"] for c in small["ranks"][0]["collectives_per_step"]}
    bytes_large = {(c["op"], c["group"]): c["bytes"] for c in large["ranks"][0]["collectives_per_step"]}
    # FSDP moves 1/dp of each weight per rank: twice the ranks, about half the all-gathered bytes
    ratio = bytes_large["all_gather", "dp_shard"] / bytes_small["all_gather", "dp_shard"]
    assert 0.45 < ratio < 0.55, ratio


def test_the_moe_rank_holds_its_experts_only(jobs: dict[str, dict[str, Any]]) -> None:
    report = jobs["DeepSeek-V3/2048"]
    rank = report["ranks"][0]
    groups = {c["group"] for c in rank["collectives_per_step"]}
    assert "ep" in groups or "dp_mod_ep" in groups, groups  # the experts' traffic is on the expert mesh
    # one MoE layer on this stage: 256 experts / EP64 = 4 experts of 3 × 7168 × 2048 fp32 weights, which their
    # own FSDP shards over the 2 ranks holding them (dp_mod_ep = 128 / 64): about half of that per rank
    expert_bytes = 4 * 3 * 7168 * 2048 * 4
    assert rank["memory_bytes"]["params"] < 0.6 * expert_bytes
    expert_ops = {(c["op"], c["group"]) for c in rank["collectives_per_step"] if c["group"] == "dp_mod_ep"}
    assert expert_ops == {("all_gather", "dp_mod_ep"), ("reduce_scatter", "dp_mod_ep")}, expert_ops  # no all-reduce


def test_startup_opens_the_files_a_rank_reads(tmp_path: Path) -> None:
    from leantrain.data.layout import write_token_data_dir
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    rng = np.random.default_rng(0)
    docs = {"web": [rng.integers(1, 128000, 600).tolist() for _ in range(256)]}
    write_token_data_dir(tmp_path / "data", docs, vocab_size=128256, eos_id=0, weights={"web": 1.0},
                         valid_docs_by_source=None, shard_size_tokens=5000)  # 32 shards
    example, sets = LLAMA_8B
    spec = load_spec(EXAMPLES / example, overrides=list(sets))
    report = rehearse(spec, ranks=[0, 127], data_dir=tmp_path / "data")
    for rank in report["ranks"]:
        files = rank["startup"]["files"]
        data_files = [f for f in files if f.endswith((".bin", ".idx"))]
        # a step of 4 micro-batches of one 8K sequence reads a few shards, not all 32, and no shard index:
        # where documents lie comes from the data dir's one memory-mapped sample index
        assert len(data_files) <= 8, (rank["rank"], data_files)
        assert not [f for f in data_files if f.endswith(".idx")], data_files
        # the manifest is read by rank 0 alone and broadcast, with the sampler index's bucket totals (data.shuffle)
        assert any(f.endswith("manifest.json") for f in files) == (rank["rank"] == 0), files
        assert any(f.endswith(".buckets.npy") for f in files) == (rank["rank"] == 0), files
