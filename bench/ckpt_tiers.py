"""Checkpoint tiers: the in-memory tier (every step, peer copy) against the durable tier, measured by the drill.

    python bench/ckpt_tiers.py [--kill-at 7] [--no-append]

Runs `leantrain drill` (golive/drill.py) on examples/tiny-cpu.yaml with `checkpoint.memory_interval_steps: 1`
and the peer on the other rank: a reference run, a run where rank 1 is SIGKILLed after step k and resumes from
the durable tier (every 4 steps), and the same kill with the node's memory lost too, resuming from the fast
tier through the peer copy. Baseline: the durable tier. Also the planner's expected goodput (Daly 2006) of both
tiers for the 10B job of examples/seed-10b.yaml on its planned GPUs: durable at plan.json's interval and save
stall, fast at the host-copy stall and its own Daly interval. Prints `name: value unit (ratio vs baseline)` lines
and appends them to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "RESULTS.md"
SPEC = REPO / "examples" / "tiny-cpu.yaml"
SEED = REPO / "examples" / "seed-10b.yaml"


def _events(run_dir: Path, kind: str) -> list[dict]:
    import json

    path = run_dir / "events.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind] if path.exists() else []


def drill_numbers(work: Path, kill_at: int) -> tuple[dict, dict]:
    from leantrain.golive.drill import MEMORY_RUN, run_drill
    from leantrain.spec import load_spec

    overrides = [f"data.dir={work / 'data'}", "training.max_steps=12", "training.log_every=1",
                 "checkpoint.interval_steps=4", "checkpoint.memory_interval_steps=1",
                 "checkpoint.memory_peer_offset=1", "security.audit_log=false", f"run.registry={work / 'runs.db'}"]
    spec = load_spec(SPEC, overrides=overrides)
    result = run_drill(spec, spec_path=SPEC, overrides=overrides, profile=None, run_dir=work / "run",
                       kill_at=kill_at, during_save=False, corrupt_latest=False, console=Console(file=io.StringIO()))
    drill_dir = Path(result["drill_dir"])
    saves = {"durable": [e["duration_s"] for e in _events(drill_dir / "faulted", "checkpoint_saved")],
             "memory": [e["duration_s"] for e in _events(drill_dir / MEMORY_RUN, "memory_checkpoint_saved")]}
    return result, {k: statistics.median(v) if v else None for k, v in saves.items()}


def planned_goodput() -> dict[str, float]:
    """Expected goodput of both tiers for the seed example (the planner's formulas and inputs)."""
    from leantrain.plan.budget import checkpoint_bytes, checkpoint_interval, daly_interval_s, expected_goodput
    from leantrain.plan.inputs import HOST_COPY_BYTES_S, plan_inputs
    from leantrain.plan.planner import make_plan
    from leantrain.spec import load_spec

    spec = load_spec(SEED)
    plan = make_plan(spec)
    num_gpus = int(plan["resources"]["layout_gpus"])  # the GPUs the planned layout trains on
    inputs = plan_inputs(spec)
    durable = checkpoint_interval(spec, inputs, num_gpus=num_gpus, step_s=1.0)
    fast_blocking_s = checkpoint_bytes(inputs) / num_gpus / HOST_COPY_BYTES_S * 2  # copy out + peer send
    fast_interval_s = daly_interval_s(blocking_s=fast_blocking_s, mtbf_s=durable["mtbf_s"])
    restart_s = spec.fault.restart_s
    return {
        "num_gpus": num_gpus, "mtbf_s": durable["mtbf_s"],
        "durable_interval_s": durable["recommended_interval_s"], "durable_blocking_s": durable["blocking_s"],
        "durable": expected_goodput(interval_s=durable["recommended_interval_s"], blocking_s=durable["blocking_s"],
                                    mtbf_s=durable["mtbf_s"], restart_s=restart_s),
        "fast_interval_s": fast_interval_s, "fast_blocking_s": fast_blocking_s,
        "memory": expected_goodput(interval_s=fast_interval_s, blocking_s=fast_blocking_s,
                                   mtbf_s=durable["mtbf_s"], restart_s=restart_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", type=int, default=7)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lt-tiers-") as tmp:
        result, saves = drill_numbers(Path(tmp), args.kill_at)
    durable, memory = result["tiers"]["durable"], result["tiers"]["memory"]
    plan = planned_goodput()
    lines = [
        f"tiers_drill_passed: {result['passed']} (losses bit for bit in both: {durable['max_loss_diff']}, "
        f"{memory['max_loss_diff']})",
        f"durable_steps_lost: {durable['steps_lost']} steps (baseline; resumed from {durable['resumed_from']})",
        f"memory_steps_lost: {memory['steps_lost']} steps (resumed from {memory['resumed_from']}, the lost rank's "
        "shard from its peer)",
        f"durable_recovery: {durable['recovery_s']:.2f} s (baseline)",
        f"memory_recovery: {memory['recovery_s']:.2f} s ({memory['recovery_s'] / durable['recovery_s']:.2f}x vs "
        "durable)",
        f"durable_goodput: {durable['goodput']:.3f} (baseline)",
        f"memory_goodput: {memory['goodput']:.3f} ({memory['goodput'] / durable['goodput']:.2f}x vs durable)",
        f"durable_save: {saves['durable']:.3f} s (baseline, median)",
        f"memory_save: {saves['memory']:.3f} s ({saves['memory'] / saves['durable']:.2f}x vs durable, median, with "
        "the peer exchange)",
        f"plan_durable_goodput: {plan['durable']:.4f} (baseline; seed-10b on {plan['num_gpus']} GPUs, MTBF "
        f"{plan['mtbf_s']:.0f} s, every {plan['durable_interval_s']:.0f} s, stall {plan['durable_blocking_s']:.1f} s)",
        f"plan_memory_goodput: {plan['memory']:.4f} ({plan['memory'] / plan['durable']:.3f}x vs durable; every "
        f"{plan['fast_interval_s']:.0f} s, stall {plan['fast_blocking_s']:.2f} s)",
    ]
    print("\n".join(lines))
    if not args.no_append:
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        header = (f"\n## bench/ckpt_tiers.py — {when}\n\nMachine: {platform.machine()}, 2 CPUs, {platform.system()}, "
                  f"torch {torch.__version__}, shared with other jobs. Command: `python bench/ckpt_tiers.py "
                  f"--kill-at {args.kill_at}`: examples/tiny-cpu.yaml, 12 steps, 2 ranks (gloo), durable every 4 "
                  "steps, fast tier every step with the copy on the other rank, rank 1 SIGKILLed after step "
                  f"{args.kill_at} (and, for the fast tier, its node's memory deleted).\n\n```\n")
        with open(RESULTS, "a", encoding="utf-8") as out:
            out.write(header + "\n".join(lines) + "\n```\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
