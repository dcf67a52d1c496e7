"""One rank of preflight, run under torchrun: `torchrun ... -m leantrain.launch.preflight_worker SPEC --run-dir DIR`.

Joining is done through the rendezvous key-value store, not a collective, so a rank that never arrives is
named instead of hanging everyone: each rank publishes its facts under `joined/<rank>`; rank 0 waits for
all `--expected-world-size` ranks until the join deadline, then decides. Only when every rank joined does
each rank run one real all-reduce on the job's backend (gloo on CPU, NCCL on GPUs). Rank 0 compares the
facts (versions by majority, naming the odd ranks), writes `RUN_DIR/preflight.json`, records failing hosts
in node_health.json, and publishes the verdict; every rank exits 0 on pass and 1 on fail.

For tests, `LEANTRAIN_PREFLIGHT_FAKE_RANK=R[,R...]` selects ranks on which `LEANTRAIN_PREFLIGHT_FAKE_<FIELD>`
(e.g. `..._TORCH_VERSION=2.0.0`) replaces a fact and `LEANTRAIN_PREFLIGHT_FAKE_ABSENT=1` makes the rank leave
without joining.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from leantrain.launch.health import node_name
from leantrain.launch.preflight_report import COMPARED_FIELDS

FAKE_PREFIX = "LEANTRAIN_PREFLIGHT_FAKE_"
POLL_S = 0.1


def _fakes(rank: int) -> dict[str, str]:
    ranks = {int(r) for r in os.environ.get(f"{FAKE_PREFIX}RANK", "").split(",") if r.strip().isdigit()}
    if rank not in ranks:
        return {}
    return {k[len(FAKE_PREFIX):].lower().removesuffix("_version"): v for k, v in os.environ.items()
            if k.startswith(FAKE_PREFIX) and k != f"{FAKE_PREFIX}RANK"}


def required_disk_bytes(spec: Any, plan: dict[str, Any] | None = None) -> int:
    """Room for the checkpoints the run keeps (keep_last + the one being written) when stored locally,
    or one staging copy for an object store. From plan.json's `storage.checkpoint_bytes`."""
    from leantrain.plan.planner import make_plan

    one = float((plan or make_plan(spec))["storage"]["checkpoint_bytes"])
    copies = spec.checkpoint.keep_last + 1 if spec.checkpoint.storage == "local" else 1
    return int(one * copies)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _disk_check(spec: Any, run_dir: Path, plan: dict[str, Any] | Exception) -> dict[str, Any]:
    target = Path(spec.checkpoint.url) if spec.checkpoint.storage == "local" and spec.checkpoint.url else run_dir
    free = shutil.disk_usage(_existing(target)).free
    if isinstance(plan, Exception):  # the planner is another stage: report its failure with the disk numbers
        # An unverified disk is not a passed check: a full disk is found hours later, at the first save.
        return {"path": str(target), "free_bytes": free, "need_bytes": None, "ok": False,
                "note": f"cannot size the planned checkpoints ({plan}); free space unverified"}
    need = required_disk_bytes(spec, plan)
    return {"path": str(target), "free_bytes": free, "need_bytes": need, "ok": free >= need}


def fast_tier_check(spec: Any, plan: dict[str, Any] | Exception, *, local_ranks: int) -> dict[str, Any] | None:
    """With `checkpoint.memory_interval_steps`: this node's `checkpoint.memory_dir` (tmpfs, /dev/shm by default)
    takes a file (created, written, removed) and has room for the fast tier: plan.json's state per rank ×
    FAST_TIER_COPIES × the ranks on this node (ckpt/memory_tier.py, which sizes it again at start and turns
    the tier off when it does not fit). None when the tier is off."""
    if spec.checkpoint.memory_interval_steps is None:
        return None
    from leantrain.plan.budget import FAST_TIER_COPIES

    folder = Path(spec.checkpoint.memory_dir)
    out: dict[str, Any] = {"path": str(folder), "local_ranks": local_ranks}
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = folder / f".leantrain-preflight-{os.getpid()}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
        out["free_bytes"] = shutil.disk_usage(folder).free
    except OSError as err:
        return {**out, "free_bytes": None, "need_bytes": None, "ok": False,
                "note": f"cannot write there: {err.strerror or err}"}
    if isinstance(plan, Exception):
        return {**out, "need_bytes": None, "ok": False, "note": f"cannot size the fast tier ({plan})"}
    shard = float(plan["fast_tier"]["shard_bytes_per_rank"])
    out.update(shard_bytes=shard, need_bytes=int(FAST_TIER_COPIES * shard * local_ranks))
    out["ok"] = out["free_bytes"] >= out["need_bytes"]
    return out


def available_host_bytes(*, meminfo: Path = Path("/proc/meminfo"),
                         cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Host memory a new process can still get here: MemAvailable, or less when this process's cgroup (v2: a
    pod's or a Slurm job's memory limit) has less left (memory.max − memory.current). None when unreadable."""
    found = None
    try:
        for line in meminfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                found = float(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        found = None
    try:
        limit = (cgroup / "memory.max").read_text(encoding="utf-8").strip()
        if limit != "max":
            left = float(limit) - float((cgroup / "memory.current").read_text(encoding="utf-8").strip())
            found = left if found is None else min(found, left)
    except (OSError, ValueError):
        pass
    return found


def host_memory_check(plan: dict[str, Any] | Exception, *, local_ranks: int,
                      available: float | None) -> dict[str, Any] | None:
    """This node's free host memory against what its ranks will hold (plan.json host_memory, plan/budget.py):
    local ranks × the plan's host memory per process, plus the fast tier's files when they are on tmpfs
    (FAST_TIER_COPIES × the state per rank × local ranks). None when the plan failed (the disk check says so)
    or the memory cannot be read."""
    if isinstance(plan, Exception) or available is None or "host_memory" not in plan:
        return None
    from leantrain.plan.budget import FAST_TIER_COPIES

    per_process = float(plan["host_memory"]["per_process"]["total"])
    tier = plan.get("fast_tier") or {}
    files = FAST_TIER_COPIES * float(tier["shard_bytes_per_rank"]) * local_ranks if tier.get("kind") == "tmpfs" else 0.0
    need = local_ranks * per_process + files
    return {"available_bytes": available, "need_bytes": need, "per_process_bytes": per_process,
            "fast_tier_bytes": files, "local_ranks": local_ranks, "ok": available >= need}


def _plan_or_error(spec: Any) -> dict[str, Any] | Exception:
    from leantrain.plan.planner import make_plan

    try:
        return make_plan(spec)
    except Exception as err:  # noqa: BLE001 - a planner failure is a finding of the checks that need it
        return err


def _data_check(spec: Any) -> dict[str, Any]:
    """The manifest parses and every shard it lists exists at its size and can be read."""
    data_dir = Path(spec.data.dir)
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.is_file():
        return {"ok": False, "dir": str(data_dir), "error": f"{manifest_path} is missing (run `leantrain prepare`)"}
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        shards = manifest.get("shards", [])
        for shard in shards:
            path = data_dir / shard["path"]
            for part in (path, path.with_suffix(".idx")):
                with open(part, "rb") as fh:
                    fh.read(4096)
            if "num_bytes" in shard and path.stat().st_size != shard["num_bytes"]:
                return {"ok": False, "dir": str(data_dir), "error": f"{path}: {path.stat().st_size} bytes, "
                        f"manifest says {shard['num_bytes']}"}
    except (OSError, ValueError, KeyError) as err:
        return {"ok": False, "dir": str(data_dir), "error": f"{type(err).__name__}: {err}"}
    return {"ok": True, "dir": str(data_dir), "num_shards": len(shards)}


def collect_facts(spec: Any, run_dir: Path, *, fakes: dict[str, str]) -> dict[str, Any]:
    """What this rank reports: versions, host, name resolution, disk and data checks."""
    from leantrain.provenance.lineage import code_info, packages_info, software_versions

    host = fakes.get("hostname") or socket.gethostname()
    # `node`: the name a failure is recorded under (node_health.json), the pod's node in Kubernetes
    facts: dict[str, Any] = {**software_versions(), "host": host, "node": fakes.get("hostname") or node_name(),
                             "pid": os.getpid()}
    facts["leantrain"] = code_info()["package_version"]
    facts["packages_sha256"] = packages_info()["sha256"]
    try:
        facts["addr"] = socket.gethostbyname(host)
        facts["resolves"] = True
    except OSError as err:
        facts["addr"], facts["resolves"] = None, False
        facts["resolve_error"] = str(err)
    plan = _plan_or_error(spec)
    facts["disk"] = _disk_check(spec, run_dir, plan)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if (tier := fast_tier_check(spec, plan, local_ranks=local_ranks)) is not None:
        facts["fast_tier"] = tier
    if (memory := host_memory_check(plan, local_ranks=local_ranks, available=available_host_bytes())) is not None:
        facts["host_memory"] = memory
    facts["data"] = _data_check(spec)
    for key, value in fakes.items():
        if key in COMPARED_FIELDS:
            facts[key] = value
    return facts


def _open_store(timeout_s: float) -> Any:
    """The rendezvous store torchrun gave us (the agent's, or rank 0's when sharing is off)."""
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank = int(os.environ["RANK"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, is_master=(rank == 0 and not agent_store), wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"leantrain-preflight/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}", store)


def _wait_key(store: Any, key: str, deadline: float) -> str | None:
    """The key's value once it is set, or None at the deadline (a key already set is returned even after it)."""
    while True:
        if store.check([key]):
            return store.get(key).decode()
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def _probe_next(store: Any, *, rank: int, world: int, deadline: float) -> dict[str, Any]:
    """Connect to the next rank's listening port: the ports between ranks are open."""
    target = (rank + 1) % world
    raw = _wait_key(store, f"joined/{target}", deadline)
    if raw is None:
        return {"target": target, "ok": False, "error": "target never joined"}
    facts = json.loads(raw)
    try:
        with socket.create_connection((facts["addr"] or facts["host"], facts["probe_port"]), timeout=5):
            return {"target": target, "ok": True}
    except OSError as err:
        return {"target": target, "ok": False, "error": f"{facts['host']}:{facts['probe_port']}: {err}"}


def _all_reduce(store: Any, *, rank: int, world: int, backend: str, timeout_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    started = time.monotonic()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else "cpu"
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        ok = int(value.item()) == world
        dist.destroy_process_group()
        return {"ok": ok, "backend": backend, "s": round(time.monotonic() - started, 3),
                **({} if ok else {"error": f"sum {value.item()} != {world}"})}
    except Exception as err:  # any backend failure is the finding, not a crash of the preflight
        return {"ok": False, "backend": backend, "error": f"{type(err).__name__}: {err}"}


def _backend(spec: Any) -> str:
    import torch

    device = spec.training.device
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if use_cuda else "gloo"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="leantrain preflight (one rank)")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--expected-world-size", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--join-timeout-s", type=float, default=None, help="default: half of --timeout-s")
    parser.add_argument("--report", type=Path, default=None, help="default: RUN_DIR/preflight.json")
    return parser.parse_args(argv)


def _gather_joined(store: Any, *, expected: int, deadline: float) -> dict[int, dict[str, Any]]:
    """Rank 0: the facts of every rank that joined by the deadline."""
    joined = {}
    for r in range(expected):
        raw = _wait_key(store, f"joined/{r}", deadline)
        if raw is not None:
            joined[r] = json.loads(raw)
    return joined


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from leantrain.spec import load_spec

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fakes = _fakes(rank)
    if fakes.get("absent"):
        return 0  # simulate a rank that never arrives
    start = time.monotonic()
    spec = load_spec(args.spec, profile=args.profile, overrides=args.sets)
    store = _open_store(args.timeout_s)
    listener = socket.create_server(("", 0))  # kept open until the verdict, so the previous rank can probe it
    try:
        facts = collect_facts(spec, args.run_dir, fakes=fakes)
        facts["probe_port"] = listener.getsockname()[1]
        store.set(f"joined/{rank}", json.dumps(facts))
        ok = _run_rank(store, spec=spec, args=args, rank=rank, world=world, start=start)
    finally:
        listener.close()
    return 0 if ok else 1


def _run_rank(store: Any, *, spec: Any, args: argparse.Namespace, rank: int, world: int, start: float) -> bool:
    """Probe, join check (rank 0), all-reduce when everyone joined, verdict (rank 0); True when it passed."""
    from leantrain.launch.preflight_report import analyze, record_unhealthy, write_report

    join_deadline = start + (args.join_timeout_s or args.timeout_s / 2)
    deadline = start + args.timeout_s
    store.set(f"probe/{rank}", json.dumps(_probe_next(store, rank=rank, world=world, deadline=join_deadline)))
    expected = max(args.expected_world_size, world)
    joined: dict[int, dict[str, Any]] = {}
    if rank == 0:
        joined = _gather_joined(store, expected=expected, deadline=join_deadline)
        store.set("collective_go", "1" if len(joined) == expected == world else "0")
    go = _wait_key(store, "collective_go", deadline) == "1"
    if go:
        collective = _all_reduce(store, rank=rank, world=world, backend=_backend(spec),
                                 timeout_s=max(5.0, deadline - time.monotonic()))
        store.set(f"collective/{rank}", json.dumps(collective))
    if rank == 0:
        report = _rank0_report(store, joined=joined, expected=expected, world=world, go=go, deadline=deadline,
                               analyze=analyze)
        write_report(report, args.report or args.run_dir / "preflight.json")
        record_unhealthy(report, run_dir=args.run_dir)
        store.set("verdict", json.dumps({"ok": report["ok"]}))
    verdict = _wait_key(store, "verdict", deadline)
    store.set(f"done/{rank}", "1")
    if rank == 0:  # rank 0 may host the store: leave only after the others have read the verdict
        for r in joined:
            _wait_key(store, f"done/{r}", time.monotonic() + 10)
    return verdict is not None and bool(json.loads(verdict)["ok"])


def _rank0_report(store: Any, *, joined: dict[int, dict[str, Any]], expected: int, world: int, go: bool,
                  deadline: float, analyze: Any) -> dict[str, Any]:
    probes, collectives = {}, {}
    for r in joined:
        raw = _wait_key(store, f"probe/{r}", deadline)
        probes[r] = json.loads(raw) if raw else {"ok": False, "error": "no probe result"}
        if go:
            raw = _wait_key(store, f"collective/{r}", deadline)
            collectives[r] = json.loads(raw) if raw else {"ok": False, "error": "no all-reduce result"}
    return analyze(joined=joined, expected_world_size=expected, world_size=world, probes=probes,
                   collectives=collectives)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: avoids the rare gloo crash at exit (docs/parallel.md)
