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
