"""Preflight: the analysis names odd and missing ranks; two real 2-rank torchrun runs on gloo show it end to end
(a rank with a faked torch version, and a rank that never joins)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from leantrain.cli import main
from leantrain.errors import UserInputError
from leantrain.launch.health import excluded_hosts, read_health
from leantrain.launch.preflight import preflight_command, run_local_preflight
from leantrain.launch.preflight_report import analyze
from leantrain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-cpu.yaml"


def facts(host: str, *, torch: str = "2.13.0", data_ok: bool = True) -> dict[str, Any]:
    return {"host": host, "python": "3.11.7", "torch": torch, "cuda": "13.0", "cudnn": None, "nccl": "2.29.7",
            "driver": "580.1", "leantrain": "0.1.0", "packages_sha256": "p", "resolves": True,
            "disk": {"ok": True, "free_bytes": 10, "need_bytes": 1, "path": "/x"},
            "data": {"ok": data_ok, "error": "" if data_ok else "manifest.json is missing"}}


def ok_results(ranks: list[int], world: int) -> tuple[dict[int, Any], dict[int, Any]]:
    probes = {r: {"target": (r + 1) % world, "ok": True} for r in ranks}
    return probes, {r: {"ok": True} for r in ranks}


def test_analysis_names_the_odd_rank_by_majority() -> None:
    joined = {0: facts("a"), 1: facts("b", torch="2.12.0"), 2: facts("c"), 3: facts("d")}
    probes, coll = ok_results(list(joined), 4)
    report = analyze(joined=joined, expected_world_size=4, world_size=4, probes=probes, collectives=coll)
    assert not report["ok"]
    (mismatch,) = report["mismatches"]
    assert mismatch["field"] == "torch" and mismatch["odd_ranks"] == [1] and mismatch["reference"] == "2.13.0"
    assert report["problems"] == ["torch differs: rank 1 on b has 2.12.0; the other ranks have 2.13.0"]
    assert list(report["bad_hosts"]) == ["b"]


def test_a_pods_failure_is_recorded_under_its_nodes_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """In a Kubernetes pod the hostname is the pod's name; node affinity excludes nodes by their name, so preflight
    blamed names no rule could match. The node's name ($LEANTRAIN_NODE_NAME, from spec.nodeName) is recorded."""
    from leantrain.launch.preflight_report import record_unhealthy
    from leantrain.launch.preflight_worker import collect_facts

    monkeypatch.setenv("LEANTRAIN_NODE_NAME", "gpu-node-7")
    reported = collect_facts(load_spec(TINY), tmp_path / "run", fakes={})
    assert reported["node"] == "gpu-node-7" and reported["host"] != "gpu-node-7"
    joined = {r: {**facts(f"job-worker-{r}"), "node": f"gpu-node-{r}"} for r in range(4)}
    joined[1]["torch"] = "2.12.0"
    probes, coll = ok_results(list(joined), 4)
    report = analyze(joined=joined, expected_world_size=4, world_size=4, probes=probes, collectives=coll)
    assert record_unhealthy(report, run_dir=tmp_path) == ["gpu-node-1"]
    assert excluded_hosts(tmp_path, crash_threshold=2) == ["gpu-node-1"]


def test_a_failure_on_every_rank_is_the_jobs_problem_not_a_bad_host() -> None:
    joined = {0: facts("a", data_ok=False), 1: facts("b", data_ok=False), 2: facts("c")}
    probes, coll = ok_results([0, 1, 2], 4)
    report = analyze(joined=joined, expected_world_size=4, world_size=4, probes=probes, collectives=coll)
    assert report["missing"] == [3]
    assert report["problems"][0].startswith("rank(s) 3 of 4 did not join")
    assert sorted(report["bad_hosts"]) == ["a", "b"]  # c read the data: a and b are the odd ones
    everywhere = analyze(joined={0: facts("a", data_ok=False), 1: facts("b", data_ok=False)}, expected_world_size=2,
                         world_size=2, probes=ok_results([0, 1], 2)[0], collectives={})
    assert everywhere["bad_hosts"] == {} and len(everywhere["problems"]) == 2


def tiny_data_dir(root: Path) -> Path:
    """A data dir with a manifest and one shard pair: enough for the readability check."""
    (root / "train").mkdir(parents=True)
    (root / "train" / "en_00000.bin").write_bytes(bytes(range(256)) * 8)
    (root / "train" / "en_00000.idx").write_bytes(b"MMIDIDX\x00\x00")
    shard = {"path": "train/en_00000.bin", "sha256": "-", "idx_sha256": "-", "num_bytes": 2048}
    (root / "manifest.json").write_text(json.dumps({"shards": [shard], "tokenizer": {}}))
    return root


@pytest.mark.slow
def test_real_two_rank_preflight_names_the_rank_with_a_mismatched_torch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {"LEANTRAIN_PREFLIGHT_FAKE_RANK": "1", "LEANTRAIN_PREFLIGHT_FAKE_TORCH_VERSION": "2.0.0",
           "OMP_NUM_THREADS": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        code = main(["launch", str(TINY), "--set", f"data.dir={tiny_data_dir(tmp_path / 'data')}",
                     "--set", "checkpoint.memory_interval_steps=5",
                     "--set", f"checkpoint.memory_dir={tmp_path / 'shm'}",
                     "--run-dir", str(run_dir), "--preflight", "--nproc", "2"])
    assert code == 1  # a check failed
    assert '"outcome": "failed"' in (run_dir / "audit.log").read_text()
    report = json.loads((run_dir / "preflight.json").read_text())
    assert report["joined"] == [0, 1] and report["missing"] == []
    assert [m["odd_ranks"] for m in report["mismatches"]] == [[1]]
    assert report["problems"] == [f"torch differs: rank 1 on {report['ranks']['1']['host']} has 2.0.0; "
                                  f"the other ranks have {report['ranks']['0']['torch']}"]
    # every other check ran for real and passed on both ranks
    assert all(c["ok"] and c["backend"] == "gloo" for c in report["collectives"].values())
    assert all(p["ok"] for p in report["probes"].values())
    assert all(f["data"]["ok"] and f["disk"]["ok"] for f in report["ranks"].values())
    # the fast tier was sized on the node: two copies of a rank's state for each of its 2 local ranks
    from leantrain.plan.planner import make_plan

    plan = make_plan(load_spec(TINY, overrides=["checkpoint.memory_interval_steps=5"]))
    for f in report["ranks"].values():
        tier = f["fast_tier"]
        assert tier["ok"] and tier["local_ranks"] == 2 and tier["path"] == str(tmp_path / "shm")
        assert tier["shard_bytes"] == pytest.approx(plan["storage"]["checkpoint_bytes"])  # ZeRO-0: all of it
        assert tier["need_bytes"] == int(2 * 2 * tier["shard_bytes"])
    host = report["ranks"]["1"]["host"]
    assert excluded_hosts(run_dir) == [host]
    assert read_health(run_dir)[host].ranks == [1]


@pytest.mark.slow
def test_real_preflight_names_a_rank_that_never_joins(tmp_path: Path) -> None:
    overrides = [f"data.dir={tiny_data_dir(tmp_path / 'data')}"]
    spec = load_spec(TINY, overrides=overrides)
    report = run_local_preflight(
        spec, spec_path=TINY, overrides=overrides, profile=None, run_dir=tmp_path / "run", nproc=2, timeout_s=40,
        join_timeout_s=3, env={"LEANTRAIN_PREFLIGHT_FAKE_RANK": "1", "LEANTRAIN_PREFLIGHT_FAKE_ABSENT": "1",
                               "OMP_NUM_THREADS": "1"},
    )
    assert not report["ok"] and report["joined"] == [0] and report["missing"] == [1]
    assert report["problems"] == ["rank(s) 1 of 2 did not join before the join deadline"]
    assert report["collectives"] == {}  # no collective is attempted with a rank missing: nothing hangs


def test_local_preflight_refuses_multi_node(tmp_path: Path) -> None:
    spec = load_spec(TINY)
    with pytest.raises(UserInputError, match="job files"):
        preflight_command(spec, console=Console(), spec_path=TINY, overrides=[], profile=None, run_dir=tmp_path,
                          nproc=2, nnodes="2")


def test_the_fast_tier_is_sized_on_the_node(tmp_path: Path) -> None:
    """checkpoint.memory_interval_steps: the node's memory_dir takes a file and holds 2 × local ranks × the plan's
    state per rank, or the check fails naming the folder, both sizes and what would help."""
    from leantrain.launch.preflight_worker import collect_facts, fast_tier_check
    from leantrain.plan.planner import make_plan

    spec = load_spec(TINY, overrides=["checkpoint.memory_interval_steps=5",
                                      f"checkpoint.memory_dir={tmp_path / 'shm' / 'leantrain'}"])
    assert fast_tier_check(load_spec(TINY), {}, local_ranks=2) is None  # the tier is off
    plan = make_plan(spec)
    tier = fast_tier_check(spec, plan, local_ranks=8)
    assert tier is not None and tier["ok"] and (tmp_path / "shm" / "leantrain").is_dir()
    assert tier["need_bytes"] == int(2 * 8 * plan["fast_tier"]["shard_bytes_per_rank"])
    assert list((tmp_path / "shm" / "leantrain").iterdir()) == []  # the probe file is gone
    huge = {**plan, "fast_tier": {**plan["fast_tier"], "shard_bytes_per_rank": 2.0**60}}
    too_small = fast_tier_check(spec, huge, local_ranks=8)
    assert too_small is not None and not too_small["ok"]
    (tmp_path / "file").write_text("")
    blocked = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"memory_dir": tmp_path / "file" / "shm"})})
    unwritable = fast_tier_check(blocked, plan, local_ranks=2)
    assert unwritable is not None and not unwritable["ok"] and "cannot write there" in unwritable["note"]

    joined = {0: {**facts("a"), "fast_tier": tier}, 1: {**facts("b"), "fast_tier": too_small}}
    probes, coll = ok_results([0, 1], 2)
    report = analyze(joined=joined, expected_world_size=2, world_size=2, probes=probes, collectives=coll)
    (problem,) = report["problems"]
    assert problem.startswith(f"fast tier memory failed on rank 1 (b): checkpoint.memory_dir {tmp_path / 'shm'}")
    assert "the fast tier needs" in problem and "× 8 local ranks" in problem and "cluster.k8s_shm_gb" in problem
    assert list(report["bad_hosts"]) == ["b"]

    with pytest.MonkeyPatch.context() as mp:  # what a rank reports, with its plan and its node's rank count
        mp.setenv("LOCAL_WORLD_SIZE", "2")
        reported = collect_facts(spec, tmp_path / "run", fakes={})
    assert reported["fast_tier"]["ok"] and reported["fast_tier"]["local_ranks"] == 2
    assert "fast_tier" not in collect_facts(load_spec(TINY), tmp_path / "run", fakes={})


def test_the_nodes_host_memory_is_checked_against_the_plan(tmp_path: Path) -> None:
    """Every rank compares its node's available host memory (MemAvailable, or a cgroup limit's room when lower)
    with local ranks × plan.json's host memory per process + the fast tier's tmpfs files."""
    from leantrain.launch.preflight_worker import available_host_bytes, collect_facts, host_memory_check
    from leantrain.plan.planner import make_plan

    (tmp_path / "meminfo").write_text("MemTotal: 32000000 kB\nMemAvailable: 20000000 kB\n")
    (tmp_path / "cg").mkdir()
    assert available_host_bytes(meminfo=tmp_path / "meminfo", cgroup=tmp_path / "cg") == 20000000 * 1024
    (tmp_path / "cg" / "memory.max").write_text("8589934592\n")  # an 8 GiB pod limit with 2 GiB used
    (tmp_path / "cg" / "memory.current").write_text("2147483648\n")
    assert available_host_bytes(meminfo=tmp_path / "meminfo", cgroup=tmp_path / "cg") == 6 * 2**30
    (tmp_path / "cg" / "memory.max").write_text("max\n")
    assert available_host_bytes(meminfo=tmp_path / "meminfo", cgroup=tmp_path / "cg") == 20000000 * 1024

    spec = load_spec(TINY, overrides=["checkpoint.memory_interval_steps=5"])
    plan = make_plan(spec)
    per_process = plan["host_memory"]["per_process"]["total"]
    shard = plan["fast_tier"]["shard_bytes_per_rank"]
    fits = host_memory_check(plan, local_ranks=8, available=64 * 2**30)
    assert fits is not None and fits["ok"]
    assert fits["need_bytes"] == pytest.approx(8 * per_process + 2 * 8 * shard)
    short = host_memory_check(plan, local_ranks=8, available=3 * 2**30)  # 8 × 0.5 GiB do not fit in 3 GiB
    assert short is not None and not short["ok"]
    assert host_memory_check(ValueError("no plan"), local_ranks=8, available=1.0) is None
    assert host_memory_check(plan, local_ranks=8, available=None) is None

    joined = {0: {**facts("a"), "host_memory": fits}, 1: {**facts("b"), "host_memory": short}}
    probes, coll = ok_results([0, 1], 2)
    report = analyze(joined=joined, expected_world_size=2, world_size=2, probes=probes, collectives=coll)
    (problem,) = report["problems"]
    assert problem.startswith("host memory failed on rank 1 (b): 3.0 GiB of host memory available")
    assert "8 local ranks × 0.5 GiB per process + " in problem and "plan.json host_memory" in problem
    assert list(report["bad_hosts"]) == ["b"]
    reported = collect_facts(spec, tmp_path / "run", fakes={})  # this machine: a few GiB for 1 tiny rank
    assert reported["host_memory"]["ok"] and reported["host_memory"]["local_ranks"] == 1
