"""The plan counts the fast checkpoint tier (checkpoint.memory_interval_steps): 2 × local ranks × the state a
rank checkpoints, per node, against the node's tmpfs and the Kubernetes /dev/shm volume; and a node's host
memory: the tier's files plus each training process's own host memory (plan.json host_memory)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from leantrain.hardware import GiB
from leantrain.plan.command import run
from leantrain.plan.planner import make_plan
from leantrain.spec import load_spec, spec_from_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def spec_70b(**checkpoint: Any) -> Any:
    """70B on 64 H100s (8 nodes) with ZeRO-3 over all 64 (the layout is the spec's, so the shard is known)."""
    return spec_from_dict({
        "model": {"size_billion": 70}, "data": {"tokens_total": 2e12, "seq_len": 4096},
        "training": {"global_batch_tokens": 4 * 2**20, "micro_batch": 1, "activation_checkpointing": "full"},
        "parallelism": {"data_parallel": 64, "zero_stage": 3},
        "hardware": {"accelerator": "H100-SXM", "num_nodes": 8, "gpus_per_node": 8},
        "budget": {"target_days": None, "num_gpus": 64},
        "checkpoint": {"memory_interval_steps": 50, **checkpoint}})


def test_off_by_default_and_no_warning() -> None:
    plan = make_plan(load_spec(EXAMPLES / "tiny-cpu.yaml"))
    assert plan["fast_tier"] == {"enabled": False}
    assert not any("fast tier" in w for w in plan["warnings"])


def test_replicated_ranks_each_keep_the_whole_checkpoint() -> None:
    """ZeRO-0 data parallel: every rank's shard is the whole state, which plan.json's checkpoint size counts
    another way (every parameter × (master + two moments))."""
    plan = make_plan(load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=["checkpoint.memory_interval_steps=5"]))
    tier = plan["fast_tier"]
    assert tier["shard_bytes_per_rank"] == pytest.approx(plan["storage"]["checkpoint_bytes"], rel=1e-6)
    assert tier["local_ranks"] == 2
    assert tier["bytes_per_node"] == pytest.approx(2 * 2 * plan["storage"]["checkpoint_bytes"], rel=1e-6)
    assert tier["kind"] == "tmpfs" and tier["fits"] and tier["problems"] == []


def test_70b_on_64_gpus_fits_the_node_but_not_the_default_kubernetes_shm() -> None:
    plan = make_plan(spec_70b())
    assert plan["layout"]["source"] == "spec" and plan["layout"]["dp"] == 64
    tier = plan["fast_tier"]
    # ZeRO-3 over 64 ranks: each keeps 1/64 of the checkpoint; 8 ranks per node, two copies each
    assert tier["shard_bytes_per_rank"] == pytest.approx(plan["storage"]["checkpoint_bytes"] / 64, rel=0.01)
    assert tier["bytes_per_node"] == pytest.approx(16 * tier["shard_bytes_per_rank"])
    assert 150 * GiB < tier["bytes_per_node"] < 256 * GiB  # ~196 GiB: the order of the ~280 GB expected
    assert tier["fits_tmpfs"] and not tier["fits_k8s_shm"] and not tier["fits"]
    (problem,) = tier["problems"]
    assert "cluster.k8s_shm_gb: 64" in problem and f"at least {int(tier['bytes_per_node'] / GiB) + 1}" in problem
    assert problem in plan["warnings"]


def test_a_small_node_is_named_with_what_would_help() -> None:
    spec = spec_70b()
    spec.cluster.memory_gib_per_node = 256
    spec.cluster.k8s_shm_gb = 512
    tier = make_plan(spec)["fast_tier"]
    assert not tier["fits_tmpfs"] and tier["fits_k8s_shm"]
    (problem,) = tier["problems"]
    assert "node with 256 GiB" in problem and "cluster.memory_gib_per_node" in problem
    assert "checkpoint.memory_dir on a node-local disk" in problem


def test_a_memory_dir_on_disk_is_left_to_the_preflight() -> None:
    tier = make_plan(spec_70b(memory_dir="/local/nvme/leantrain"))["fast_tier"]
    assert tier["kind"] == "disk" and tier["fits"] is None and tier["problems"] == []


def test_lora_keeps_only_the_adapters() -> None:
    full = make_plan(spec_70b())["fast_tier"]["shard_bytes_per_rank"]
    lora = spec_70b()
    lora.task = "finetune"
    lora.finetune.method = "lora"
    tier = make_plan(lora)["fast_tier"]
    assert 0 < tier["shard_bytes_per_rank"] < full / 50  # rank-16 adapters are well under 2 % of 70B


def test_the_plan_shows_the_fast_tier_and_the_warning() -> None:
    buf = io.StringIO()
    run(console=Console(file=buf, width=200), spec=spec_70b(), json_out=None, top=1, what_if=None)
    text = buf.getvalue()
    assert "fast tier" in text and "per node in /dev/shm/leantrain" in text and "DOES NOT FIT" in text
    assert "warning:" in text and "cluster.k8s_shm_gb" in text
    assert "host memory" in text and "8 × " in text and "per process" in text


def test_host_memory_counts_each_process_besides_the_fast_tier() -> None:
    """Per process: the runtime (a CUDA process: 3 GiB), the loader's pinned read-ahead, a fast-tier save in
    flight (a device shard's CPU copy + the peer's copy received) and, with async_save, the staged copy."""
    plan = make_plan(spec_70b())
    host, tier = plan["host_memory"], plan["fast_tier"]
    part = host["per_process"]
    shard = tier["shard_bytes_per_rank"]
    assert part["runtime"] == 3 * GiB and part["async_staging"] == 0 and part["cpu_offload"] == 0
    assert part["fast_tier_in_flight"] == pytest.approx(2 * shard)
    # 1 sequence of 4,096 per micro-batch, 64-way dp of 1,024 sequences: 16 micro-batches, 2 × 16 + 1 read
    # ahead, int64 ids + a mask byte per token + an int64 source id, pinned blocks rounded up (worst case 2×)
    assert part["loader"] == (2 * 16 + 1) * (4097 * 9 + 8) * 2
    assert part["total"] == pytest.approx(sum(v for k, v in part.items() if k != "total"))
    assert host["local_ranks"] == 8 and host["fast_tier_bytes_per_node"] == tier["bytes_per_node"]
    assert host["bytes_per_node"] == pytest.approx(8 * part["total"] + tier["bytes_per_node"])
    assert host["host_memory_bytes_per_node"] == 512 * GiB and host["fits"] and host["problems"] == []
    staged = make_plan(spec_70b(async_save=True))["host_memory"]["per_process"]
    assert staged["async_staging"] == pytest.approx(shard)
    assert staged["total"] == pytest.approx(part["total"] + shard)


def test_a_node_whose_tmpfs_holds_the_tier_but_not_the_processes_is_named() -> None:
    """400 GiB: the tier's 196 GiB fits the default tmpfs (200 GiB), but with 8 ranks × ~27.5 GiB the node needs
    ~416 GiB; the warning names cluster.memory_gib_per_node and the size that would do."""
    spec = spec_70b()
    spec.cluster.memory_gib_per_node = 400
    spec.cluster.k8s_shm_gb = 512
    plan = make_plan(spec)
    assert plan["fast_tier"]["fits"] and plan["fast_tier"]["problems"] == []
    host = plan["host_memory"]
    assert host["fast_tier_bytes_per_node"] < 400 * GiB < host["bytes_per_node"] and not host["fits"]
    (problem,) = host["problems"]
    assert "host memory 400 GiB" in problem and "cluster.memory_gib_per_node to at least" in problem
    assert "8 ranks" in problem and "fast tier" in problem
    assert f"at least {math.ceil(host['bytes_per_node'] / GiB)}" in problem and problem in plan["warnings"]


def test_host_memory_without_the_fast_tier_counts_cpu_offload() -> None:
    spec = spec_70b()
    spec.checkpoint.memory_interval_steps = None
    base = make_plan(spec)["host_memory"]
    assert base["fast_tier_bytes_per_node"] == 0 and base["per_process"]["fast_tier_in_flight"] == 0
    spec.parallelism.cpu_offload = True
    offload = make_plan(spec)["host_memory"]["per_process"]
    # weights at master precision + two moments (the checkpointed state, fp32: 12 B/param) + fp32 gradients
    assert offload["cpu_offload"] == pytest.approx(make_plan(spec_70b())["fast_tier"]["shard_bytes_per_rank"] * 16 / 12)


def test_a_tiny_cpu_job_counts_its_processes() -> None:
    host = make_plan(load_spec(EXAMPLES / "tiny-cpu.yaml"))["host_memory"]
    assert host["per_process"]["runtime"] == GiB / 2 and host["local_ranks"] == 2
    assert host["bytes_per_node"] == pytest.approx(2 * host["per_process"]["total"]) and host["fits"]
