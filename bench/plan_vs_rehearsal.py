"""The planner's per-GPU memory against `leantrain rehearse` on a grid of layouts (the plan held to the rehearsal).

Each layout is a Llama-3-8B-wide model (d 4096, GQA 32/8, SwiGLU 14,336, vocabulary 128,256, 8K context) cut
to a few layers, rehearsed as rank 0 of its real world size with the trainer itself under a fake process group
and fake tensors (docs/rehearse.md), and planned by `plan.memory.stage_memory` for the same stage. The grid
covers ZeRO 1-3, TP 1-8, PP 1-4 with 1F1B and interleaved 1F1B, recompute none/selective/op/full, and an MoE.
The rehearsal is the independent measurement: it counts the bytes the trainer's tensors hold, while the plan
is arithmetic. Prints, per layout and category, `plan / rehearsal` and the median |error| per category.

    python bench/plan_vs_rehearsal.py [--quick] [--rows NAME,NAME] [--rehearsed FILE]

`--rehearsed FILE` keeps each row's rehearsal (rank 0's memory_bytes, stage and micro-batch count) in a JSON
file and plans again from it without rehearsing: the rehearsal takes minutes per row, the plan milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from leantrain.golive.rehearse import rehearse
from leantrain.plan.inputs import plan_inputs
from leantrain.plan.layout import layout_from_spec
from leantrain.plan.memory import stage_memory
from leantrain.spec import load_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama3-8b-h100.yaml"
BASE = ("fault.max_nodes=64", "model.n_layers=4", "training.global_batch_tokens=262144")
MOE = ("model.architecture=moe", "model.moe.num_experts=16", "model.moe.top_k=2", "model.moe.expert_hidden=2048")
# name → (dp, tp, pp, zero, schedule, virtual stages, recompute, extra)
GRID: dict[str, tuple[int, int, int, int, str, int, str, tuple[str, ...]]] = {
    "fsdp8 zero3 selective": (8, 1, 1, 3, "1f1b", 1, "selective", ()),
    "fsdp8 zero2 selective": (8, 1, 1, 2, "1f1b", 1, "selective", ()),
    "fsdp8 zero1 selective": (8, 1, 1, 1, "1f1b", 1, "selective", ()),
    "fsdp8 zero3 none": (8, 1, 1, 3, "1f1b", 1, "none", ()),
    "fsdp8 zero3 full": (8, 1, 1, 3, "1f1b", 1, "full", ()),
    "fsdp8 zero3 op": (8, 1, 1, 3, "1f1b", 1, "op", ()),
    "fsdp2 tp4 op": (2, 4, 1, 3, "1f1b", 1, "op", ()),
    # fp8 (torchao's float8 Linear layers): the op policy sees their matmuls as aten.mm, the kept outputs are bf16
    "fsdp8 zero3 op fp8": (8, 1, 1, 3, "1f1b", 1, "op", ("precision.compute=fp8",)),
    # short sequences: the root unit's gradient reduce-scatter (the tables, in bf16 and fp32), not the loss, is the peak
    "fsdp8 zero3 seq2k": (8, 1, 1, 3, "1f1b", 1, "none", ("data.seq_len=2048",)),
    "fsdp8 zero3 seq2k full": (8, 1, 1, 3, "1f1b", 1, "full", ("data.seq_len=2048",)),
    "fsdp4 tp2 seq2k full": (4, 2, 1, 3, "1f1b", 1, "full", ("data.seq_len=2048",)),
    "fsdp4 tp2": (4, 2, 1, 3, "1f1b", 1, "selective", ()),
    # fp8 × TP: torchao's float8 TP styles keep float8 copies of the split Linears' inputs (plan/activations.py
    # `float8_tp_saved_bytes`); without recompute the attention kernel also keeps its bf16 output
    "fsdp4 tp2 fp8 none": (4, 2, 1, 3, "1f1b", 1, "none", ("precision.compute=fp8",)),
    "fsdp2 tp4": (2, 4, 1, 3, "1f1b", 1, "selective", ()),
    "fsdp2 tp8": (2, 8, 1, 3, "1f1b", 1, "selective", ()),
    "fsdp4 pp2 1f1b": (4, 1, 2, 3, "1f1b", 1, "selective", ()),
    "fsdp2 pp4 1f1b": (2, 1, 4, 3, "1f1b", 1, "selective", ()),
    "fsdp2 pp2 interleaved": (2, 1, 2, 3, "interleaved_1f1b", 2, "selective", ()),
    # 2 micro-batches: every chunk forward runs before the first backward (the 405B example's regime)
    "fsdp2 pp2 interleaved m2": (2, 1, 2, 3, "interleaved_1f1b", 2, "selective",
                                 ("training.global_batch_tokens=32768",)),
    # ZeRO-2 keeps each chunk gathered after its forward: the chunks not yet in their backward hold more
    "fsdp2 pp2 interleaved m2 zero2": (2, 1, 2, 2, "interleaved_1f1b", 2, "selective",
                                       ("training.global_batch_tokens=32768",)),
    "fsdp2 tp2 pp2": (2, 2, 2, 3, "1f1b", 1, "selective", ()),
    "moe fsdp8 ep4": (8, 1, 1, 3, "1f1b", 1, "selective", (*MOE, "parallelism.expert_parallel=4")),
    # TP without EP: each expert's hidden dim split over TP, every TP rank routing all of the layer's tokens
    "moe fsdp4 tp2": (4, 2, 1, 3, "1f1b", 1, "selective", MOE),
    # EP × TP: each TP rank sends the experts its share of the tokens; their FSDP spans dp_mod_ep × tp
    "moe fsdp4 tp2 ep2": (4, 2, 1, 3, "1f1b", 1, "selective", (*MOE, "parallelism.expert_parallel=2")),
}
CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "peak")


def spec_for(dp: int, tp: int, pp: int, zero: int, schedule: str, virtual: int, recompute: str,
             extra: tuple[str, ...]) -> object:
    world = dp * tp * pp
    sets = [*BASE, f"parallelism.data_parallel={dp}", f"parallelism.tensor_parallel={tp}",
            f"parallelism.pipeline_parallel={pp}", f"parallelism.zero_stage={zero}",
            f"parallelism.pipeline_schedule={schedule}", f"parallelism.virtual_stages={virtual}",
            f"training.activation_checkpointing={recompute}", f"hardware.num_nodes={max(1, world // 8)}",
            f"hardware.gpus_per_node={min(8, world)}", f"budget.num_gpus={world}", "fault.min_nodes=1", *extra]
    return load_spec(EXAMPLE, overrides=sets)


def planned(spec, rank: dict) -> dict[str, float]:
    """The plan for the rehearsed rank's stage by rehearsal.json's categories. The framework reserve (CUDA
    context, NCCL, allocator slack) is left out of temp and peak: a fake-tensor rehearsal cannot hold it."""
    layout = layout_from_spec(spec.parallelism, spec.training)
    mem = stage_memory(plan_inputs(spec), layout, stage=int(rank["plan_memory_bytes"].get("stage", 0)),
                       num_microbatches=int(rank["num_microbatches"]))
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "activations": mem.activations,
            "temp": mem.temp, "peak": mem.total - mem.reserve}


def rehearsed_rank(spec) -> dict:
    """Rank 0's rehearsal: memory_bytes, the pipeline stage and the micro-batch count the plan needs."""
    rank = rehearse(spec, ranks=[0])["ranks"][0]  # type: ignore[arg-type]
    return {"memory_bytes": rank["memory_bytes"], "plan_memory_bytes": {"stage": rank["pipeline_stage"]},
            "num_microbatches": rank["num_microbatches"]}


def compare(spec, rank: dict | None = None) -> tuple[dict[str, int], dict[str, float]]:
    """(rehearsed bytes, planned bytes) by category for rank 0 of `spec` (rehearsed unless `rank` is given)."""
    rank = rank if rank is not None else rehearsed_rank(spec)
    return rank["memory_bytes"], planned(spec, rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first three layouts only")
    parser.add_argument("--rows", help="comma-separated layout names (default: the whole grid)")
    parser.add_argument("--rehearsed", type=Path, help="JSON file of rehearsals: read where present, else written")
    args = parser.parse_args()
    names = args.rows.split(",") if args.rows else list(GRID)[:3] if args.quick else list(GRID)
    unknown = [n for n in names if n not in GRID]
    if unknown:
        parser.error(f"--rows: unknown layouts {unknown}; known: {list(GRID)}")
    cache = json.loads(args.rehearsed.read_text()) if args.rehearsed and args.rehearsed.is_file() else {}
    errors: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    start = time.perf_counter()
    for name in names:
        spec = spec_for(*GRID[name])
        if name not in cache:
            cache[name] = rehearsed_rank(spec)
            if args.rehearsed:
                args.rehearsed.write_text(json.dumps(cache, indent=1))
        measured, plan = compare(spec, cache[name])
        ratios = {c: plan[c] / measured[c] if measured[c] else None for c in CATEGORIES}
        for category in CATEGORIES:
            if ratios[category] is not None:
                errors[category].append(abs(ratios[category] - 1))
        shown = ", ".join(f"{c} {ratios[c]:.2f}" for c in CATEGORIES if ratios[c] is not None)
        print(f"{name}: peak {measured['peak'] / 2**30:.2f} GiB rehearsed, {plan['peak'] / 2**30:.2f} GiB planned "
              f"(plan/rehearsal: {shown})", flush=True)
    for category in CATEGORIES:
        if errors[category]:
            within = sum(e <= 0.10 for e in errors[category])
            print(f"plan vs rehearsal {category}: median |error| {statistics.median(errors[category]):.1%} "
                  f"({within}/{len(errors[category])} layouts within ±10%)")
    print(f"rehearsal time: {time.perf_counter() - start:.0f} s for {len(names)} layouts")


if __name__ == "__main__":
    main()
