"""The preflight verdict: from what every rank reported to `preflight.json` and node-health records.

Both sides import it: the worker (rank 0 writes the report) and the driver (renders it, records bad hosts),
so neither imports the other.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from leantrain.launch.health import record_failure
from leantrain.plan.budget import FAST_TIER_COPIES
from leantrain.security import write_private_text

COMPARED_FIELDS = ("python", "torch", "cuda", "cudnn", "nccl", "driver", "leantrain", "packages_sha256")
REPORT_NAME = "preflight.json"
RANK_CHECKS = (  # (name, how to read pass/fail from a rank's facts or results)
    ("hostname resolves", lambda f, p, c: (f.get("resolves", False), f.get("resolve_error", ""))),
    ("disk free", lambda f, p, c: (f["disk"]["ok"], f"{f['disk']['free_bytes']} bytes free at {f['disk']['path']}, "
                                                     f"need {f['disk']['need_bytes']}"
                                                     + (f" ({f['disk']['note']})" if f["disk"].get("note") else ""))),
    ("fast tier memory", lambda f, p, c: _fast_tier(f.get("fast_tier"))),
    ("host memory", lambda f, p, c: _host_memory(f.get("host_memory"))),
    ("data readable", lambda f, p, c: (f["data"]["ok"], f["data"].get("error", ""))),
    ("port to next rank", lambda f, p, c: (p.get("ok", False), p.get("error", ""))),
    ("all-reduce", lambda f, p, c: (True, "") if c is None else (c.get("ok", False), c.get("error", ""))),
)


def _fast_tier(tier: dict[str, Any] | None) -> tuple[bool, str]:
    """The node's checkpoint.memory_dir holds the fast tier (passes when the tier is off)."""
    if tier is None:
        return True, ""
    if tier.get("need_bytes") is None or tier.get("free_bytes") is None:
        return bool(tier["ok"]), f"checkpoint.memory_dir {tier['path']}: {tier.get('note', 'unchecked')}"
    gib = 2**30
    return bool(tier["ok"]), (f"checkpoint.memory_dir {tier['path']} has {tier['free_bytes'] / gib:.1f} GiB free, "
                              f"the fast tier needs {tier['need_bytes'] / gib:.1f} GiB on this node "
                              f"({FAST_TIER_COPIES} × {tier['shard_bytes'] / gib:.2f} GiB per rank × "
                              f"{tier['local_ranks']} local ranks); raise /dev/shm (cluster.k8s_shm_gb on "
                              "Kubernetes) or point it at a larger node-local disk")


def _host_memory(memory: dict[str, Any] | None) -> tuple[bool, str]:
    """The node's free host memory holds its ranks and the fast tier's tmpfs files (passes when not measured)."""
    if memory is None:
        return True, ""
    gib = 2**30
    files = f" + {memory['fast_tier_bytes'] / gib:.1f} GiB fast tier" if memory["fast_tier_bytes"] else ""
    return bool(memory["ok"]), (f"{memory['available_bytes'] / gib:.1f} GiB of host memory available, the ranks "
                                f"need {memory['need_bytes'] / gib:.1f} GiB ({memory['local_ranks']} local ranks × "
                                f"{memory['per_process_bytes'] / gib:.1f} GiB per process{files}, plan.json "
                                "host_memory): free memory on the node, run fewer ranks per node, or put "
                                "checkpoint.memory_dir on a node-local disk")


def _mismatches(joined: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    first = min(joined)
    for field in COMPARED_FIELDS:
        values = {r: facts.get(field) for r, facts in joined.items()}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        leaders = [v for v, c in counts.items() if c == top]
        reference = values[first] if values[first] in leaders else leaders[0]
        odd = sorted(r for r, v in values.items() if v != reference)
        found.append({"field": field, "reference": reference, "odd_ranks": odd,
                      "odd_values": {str(r): values[r] for r in odd},
                      "odd_hosts": sorted({joined[r]["host"] for r in odd})})
    return found


def analyze(
    *, joined: dict[int, dict[str, Any]], expected_world_size: int, world_size: int,
    probes: dict[int, dict[str, Any]], collectives: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """Turn what the ranks reported into a verdict with one problem line per finding, naming ranks and hosts."""
    problems: list[str] = []
    bad_hosts: dict[str, dict[str, list[Any]]] = {}

    def blame(rank: int, reason: str) -> None:
        entry = bad_hosts.setdefault(joined[rank].get("node") or joined[rank]["host"], {"ranks": [], "reasons": []})
        entry["ranks"] = sorted({*entry["ranks"], rank})
        entry["reasons"].append(f"rank {rank}: {reason}")

    missing = [r for r in range(expected_world_size) if r not in joined]
    if missing:
        started = "" if world_size >= expected_world_size else f"; only {world_size} ranks were started"
        problems.append(f"rank(s) {', '.join(map(str, missing))} of {expected_world_size} did not join before the "
                        f"join deadline{started}")
    # A probe towards a rank that never joined says nothing new about the prober.
    probes = {r: {"ok": True, "skipped": f"rank {p['target']} missing"} if p.get("target") in missing else p
              for r, p in probes.items()}
    mismatches = _mismatches(joined) if joined else []
    for m in mismatches:
        odd = ", ".join(f"rank {r} on {joined[r]['host']} has {joined[r].get(m['field'])}" for r in m["odd_ranks"])
        problems.append(f"{m['field']} differs: {odd}; the other ranks have {m['reference']}")
        for r in m["odd_ranks"]:
            blame(r, f"{m['field']} {joined[r].get(m['field'])} (others {m['reference']})")
    for name, read in RANK_CHECKS:
        failed = {}
        for r, facts in joined.items():
            ok, detail = read(facts, probes.get(r, {}), collectives.get(r) if collectives else None)
            if not ok:
                failed[r] = detail
        for r, detail in sorted(failed.items()):
            problems.append(f"{name} failed on rank {r} ({joined[r]['host']}): {detail}")
        if failed and len(failed) < len(joined):  # only some hosts fail: those hosts are the problem
            for r, detail in failed.items():
                blame(r, f"{name}: {detail}")
    return {
        "ok": not problems,
        "checked_at": time.time(),
        "expected_world_size": expected_world_size,
        "world_size": world_size,
        "joined": sorted(joined),
        "missing": missing,
        "mismatches": mismatches,
        "problems": problems,
        "bad_hosts": bad_hosts,
        "ranks": {str(r): facts for r, facts in sorted(joined.items())},
        "probes": {str(r): p for r, p in probes.items()},
        "collectives": {str(r): c for r, c in collectives.items()},
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_private_text(Path(path), json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")


def record_unhealthy(report: dict[str, Any], *, run_dir: Path) -> list[str]:
    """Add the hosts that failed to node_health.json; returns them."""
    for host, entry in report.get("bad_hosts", {}).items():
        record_failure(run_dir, host=host, kind="preflight", reason="; ".join(entry["reasons"]), ranks=entry["ranks"])
    return sorted(report.get("bad_hosts", {}))
