"""The planner's memory held to `leantrain rehearse` (the trainer itself under a fake process group and fake
tensors) on a small grid of layouts: a Llama-3-8B-wide model cut to 4 layers, rank 0 of each world.
bench/plan_vs_rehearsal.py runs the whole grid (24 layouts, bench/RESULTS.md); these pin one layout per
mechanism: ZeRO-2's gathered stage, TP with the vocabulary-parallel loss (TP2, and TP8 where the loss's
backward and the sequence-parallel gathered inputs weigh most), a pipeline's first stage (the stage torch's
pipelining keeps gathered with its unsharded gradients), an interleaved pipeline (its peak falls in a forward,
where FSDP's flat all-gather buffer is temp, not an activation), TP with a pipeline (the first stage's
vocabulary-parallel embedding, whose gradient is this rank's rows: a whole-vocabulary one was 1 GiB of temp).
The in-flight micro-batch count of every pipeline schedule is checked against the order torch's own schedule
runs, and the pipeline receive buffers against what torch's PipelineStage keeps on 2 gloo ranks (not heavy)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from leantrain.plan.activations import backward_chunks_at_peak, in_flight_microbatches
from leantrain.plan.layout import Layout

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan_vs_rehearsal.py"
TOLERANCE = 0.10  # the target: ±10 % per category


def _bench():
    spec = importlib.util.spec_from_file_location("plan_vs_rehearsal", BENCH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp8 zero2 selective", "fsdp4 tp2", "fsdp2 tp8", "fsdp4 pp2 1f1b",
                                  "fsdp2 pp2 interleaved", "fsdp2 tp2 pp2", "fsdp8 zero3 op", "fsdp2 tp4 op",
                                  "fsdp8 zero3 op fp8", "fsdp8 zero3 seq2k", "fsdp4 tp2 seq2k full",
                                  "fsdp4 tp2 fp8 none", "moe fsdp4 tp2"])
def test_plan_matches_the_rehearsal_per_category(name: str) -> None:
    bench = _bench()
    dp, tp, pp, zero, schedule, virtual, recompute, extra = bench.GRID[name]
    spec = bench.spec_for(dp, tp, pp, zero, schedule, virtual, recompute, extra)
    measured, plan = bench.compare(spec)
    off = {c: plan[c] / measured[c] for c in bench.CATEGORIES if measured[c] > 2**20}
    bad = {c: round(r, 3) for c, r in off.items() if abs(r - 1) > TOLERANCE}
    assert not bad, (name, bad)



@pytest.mark.heavy
@pytest.mark.slow
def test_a_pipeline_that_fills_before_its_first_backward_peaks_without_the_gradients() -> None:
    """PP2 × v2 with 2 micro-batches: all 4 chunk forwards run before the first backward, so the peak holds
    every micro-batch's activations and (nearly) none of the stage's gathered weights and unsharded gradients
    (plan/activations.py `backward_chunks_at_peak` = 0); summing both, as a pipeline with a steady state needs, planned
    1.37× the rehearsed peak. Its temp is a few hundred MiB either way, so the peak is what is pinned."""
    bench = _bench()
    spec = bench.spec_for(*bench.GRID["fsdp2 pp2 interleaved m2"])
    measured, plan = bench.compare(spec)
    for category in ("params", "grads", "optimizer", "activations", "peak"):
        assert abs(plan[category] / measured[category] - 1) <= TOLERANCE, (category, plan, measured)
    assert plan["temp"] < 0.5 * 2**30 and measured["temp"] < 0.5 * 2**30


@pytest.mark.heavy
@pytest.mark.slow
def test_zero2_keeps_the_chunks_not_yet_in_their_backward_gathered() -> None:
    """The same PP2 × v2 layout with 2 micro-batches at ZeRO-2: without resharding after forward the first chunk,
    whose backward has not started at the peak, still holds its compute-dtype copy where ZeRO-3 has freed all but
    its last block. Rehearsed, ZeRO-2's peak is ZeRO-3's plus exactly that chunk's bf16 embedding (1.05 GB); the
    plan adds what ZeRO-3 reshards of such chunks (plan/memory.py `untouched_resharded_params`; it added nothing,
    temp 0.33× the rehearsal's, until 2026-12-06)."""
    bench = _bench()
    (z3_measured, z3_plan), (z2_measured, z2_plan) = (
        bench.compare(bench.spec_for(*bench.GRID[name]))
        for name in ("fsdp2 pp2 interleaved m2", "fsdp2 pp2 interleaved m2 zero2"))
    rehearsed = z2_measured["peak"] - z3_measured["peak"]
    assert rehearsed > 0.9 * 2**30, rehearsed
    assert z2_plan["peak"] - z3_plan["peak"] == pytest.approx(rehearsed, rel=TOLERANCE)
    for category in ("params", "grads", "optimizer", "activations", "peak"):
        assert abs(z2_plan[category] / z2_measured[category] - 1) <= TOLERANCE, (category, z2_plan, z2_measured)


def _latent_moe_spec():
    """A small DeepSeek-V3-like model (multi-head latent attention with value heads narrower than the query/key
    heads, 1 dense + 2 MoE layers, 8 experts over EP 2, a shared expert) under full recompute at ZeRO-1 on 4 ranks,
    2 micro-batches of 2,048 tokens; 32 heads make the (heads, seq, seq) scores of a math-path attention large."""
    from leantrain.spec import spec_from_dict

    return spec_from_dict({
        "model": {"architecture": "moe", "n_layers": 3, "d_model": 512, "n_heads": 32, "n_kv_heads": 32,
                  "ffn_hidden": 1024, "vocab_size": 32768,
                  "mla": {"q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                          "v_head_dim": 32},
                  "moe": {"num_experts": 8, "top_k": 2, "num_shared_experts": 1, "expert_hidden": 4096,
                          "first_dense_layers": 1, "router": "sigmoid", "balance": "aux_free"}},
        "data": {"tokens_total": 1e9, "seq_len": 2048},
        "training": {"global_batch_tokens": 4 * 2 * 2048, "micro_batch": 1, "activation_checkpointing": "full"},
        "precision": {"compute": "bf16"},
        "parallelism": {"data_parallel": 4, "expert_parallel": 2, "zero_stage": 1},
        "hardware": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 4},
        "budget": {"num_gpus": 4, "target_days": None}})


def test_plan_matches_the_rehearsal_of_latent_attention_and_experts_under_full_recompute() -> None:
    """MoE + MLA under full recompute, per category (a few seconds). Until 2026-12-07 the rehearsal ran the
    CPU's math-path attention for MLA's unequal head widths, which a GPU never runs (it takes the memory-efficient
    kernel: golive/rehearse_swaps.py `_gpu_attention`), and filed the experts' gathered weights as activations
    (golive/rehearse_memory.py `fsdp_gathers_as_temp`): plan ÷ rehearsal activations 0.55, temp 0.55, peak 0.65
    here; DeepSeek-V3's widths cut to 4 layers on 2,048 ranks: 0.34, 0.43, 0.40 (the heavy test below)."""
    from leantrain.golive.rehearse import rehearse

    ratios = rehearse(_latent_moe_spec(), ranks=[0], isolated=False)["plan_vs_rehearsal"]
    bad = {c: round(r, 3) for c, r in ratios.items() if r is not None and abs(r - 1) > TOLERANCE}
    assert not bad, ratios


@pytest.mark.slow
def test_fp8_gathers_the_linear_weights_in_float8_as_planned() -> None:
    """Under fp8 with FSDP2 the trainer all-gathers its float8 Linear weights in float8 (torchao's
    enable_fsdp_float8_all_gather, train/precision.py): an 8B-wide stage of 4 layers at FSDP 8, ZeRO-2 (the stage
    kept gathered), holds 0.81 GiB less temp than in bf16, its 872M Linear weights at 1 byte instead of 2. The
    plan counted them at 2 bytes until 2026-12-07 (temp 1.18 of the rehearsal, bf16 1.09): now fp8's ratio is
    bf16's (~15 s each)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    reports = {c: rehearse(load_spec(Path(__file__).resolve().parents[1] / "examples" / "llama3-8b-h100.yaml",
                                     overrides=["model.n_layers=4", "parallelism.data_parallel=8",
                                                "parallelism.zero_stage=2", "hardware.num_nodes=1",
                                                "training.global_batch_tokens=65536", f"precision.compute={c}"]),
                           ranks=[0], isolated=False) for c in ("bf16", "fp8")}
    held = {c: r["ranks"][0]["memory_bytes"]["temp"] for c, r in reports.items()}
    assert (held["bf16"] - held["fp8"]) / 2**30 == pytest.approx(4 * 218.1e6 / 2**30, rel=0.02)  # 4 × wq..w3
    ratios = {c: r["plan_vs_rehearsal"]["temp"] for c, r in reports.items()}
    assert ratios["fp8"] == pytest.approx(ratios["bf16"], abs=0.01) and abs(ratios["fp8"] - 1) <= TOLERANCE


def test_float8_gathered_linears_are_those_whose_rows_fill_every_shard() -> None:
    """FSDP2 gathers a float8 weight in float8 only when its rows give every rank some (train/precision.py
    `fills_every_shard`): DeepSeek-V3's widths at FSDP 2,048 keep wq_a (1,536 rows), wkv_a (576), wo and w2
    (7,168: 1,792 ranks filled) in the compute dtype; at FSDP 8 every Linear gathers in float8."""
    from leantrain.spec import load_spec
    from leantrain.spec.rules import float8_gathered_params
    from leantrain.spec.shapes import resolve_shape

    shape = resolve_shape(load_spec(Path(__file__).resolve().parents[1] / "examples" / "deepseek-v3.yaml").model)
    m, d = shape.mla, shape.d_model
    wq_b, wkv_b = 128 * m.qk_head_dim * m.q_lora_rank, 128 * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
    assert float8_gathered_params(shape, tp=1, shards=2048, moe_layer=False) == wq_b + wkv_b + 2 * d * shape.ffn_hidden
    assert float8_gathered_params(shape, tp=1, shards=8, moe_layer=False) == shape.attention_params() - (
        m.q_lora_rank + m.kv_lora_rank) + shape.dense_mlp_params()  # every Linear (the two latent norms are not)
    shared = shape.moe.num_shared_experts * shape.moe.expert_hidden
    assert float8_gathered_params(shape, tp=1, shards=2048, moe_layer=True) == wq_b + wkv_b + 2 * d * shared


@pytest.mark.heavy
@pytest.mark.slow
def test_plan_matches_the_rehearsal_of_deepseek_v3_widths_under_full_recompute() -> None:
    """examples/deepseek-v3.yaml as trained here (1F1B, full recompute, fp8), cut to 4 layers (3 dense + 1 MoE) on
    one pipeline stage of 2,048 ranks (DP 2048, EP 64), 2 micro-batches: plan 14.9 GiB, rehearsal 36.8 GiB until
    2026-12-07 (20 GiB of math-path attention scores per MLA layer), 14.35 GiB since (~20 s). With the float8
    Linear weights gathered in float8 where their rows fill every shard (2026-12-07): temp 1.051 → 0.962."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "deepseek-v3.yaml", overrides=[
        "model.n_layers=4", "parallelism.pipeline_parallel=1", "parallelism.data_parallel=2048",
        "parallelism.pipeline_schedule=1f1b", "training.global_batch_tokens=16777216"])
    ratios = rehearse(spec, ranks=[0], isolated=False)["plan_vs_rehearsal"]
    bad = {c: round(r, 3) for c, r in ratios.items() if r is not None and abs(r - 1) > TOLERANCE}
    assert not bad, ratios


def _torch_peak_chunks(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """The most chunk forwards whose backward has not run yet, over the order torch's schedule gives `rank`."""
    from torch.distributed.pipelining import schedules as ts

    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // p)
        warmup = ts._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)
        ops = ts._get_1f1b_rank_ops(
            v, p, warmup, v * m - warmup, warmup, rank,
            lambda step: ((step // per_round) % v) * p + rank,
            lambda step: (v - 1 - ((step - warmup) // per_round) % v) * p + rank)
    else:  # Schedule1F1B: min(m, p - rank) warm-up forwards, then one forward and one backward a step
        warmup = min(m, p - rank)
        ops = [ts._Action(rank, ts._ComputationType.FORWARD, i) for i in range(warmup)]
        for i in range(m):
            ops.append(ts._Action(rank, ts._ComputationType.FULL_BACKWARD, i))
            if warmup + i < m:
                ops.append(ts._Action(rank, ts._ComputationType.FORWARD, warmup + i))
    live = peak = 0
    for op in ops:
        if op is not None and op.computation_type == ts._ComputationType.FORWARD:
            live += 1
            peak = max(peak, live)
        elif op is not None and op.computation_type == ts._ComputationType.FULL_BACKWARD:
            live -= 1
    return peak


@pytest.mark.parametrize(("schedule", "p", "v", "m"), [
    ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16), ("1f1b", 4, 1, 2), ("interleaved_1f1b", 2, 2, 4),
    ("interleaved_1f1b", 2, 2, 16), ("interleaved_1f1b", 4, 2, 16), ("interleaved_1f1b", 8, 2, 32),
    ("interleaved_1f1b", 16, 7, 16), ("interleaved_1f1b", 4, 4, 8), ("interleaved_1f1b", 4, 2, 6),
    ("interleaved_1f1b", 2, 2, 2)])
def test_in_flight_microbatches_are_torchs_schedule_order(schedule: str, p: int, v: int, m: int) -> None:
    """The plan's warm-up count is the one torch's Schedule1F1B / ScheduleInterleaved1F1B run (the trainer's
    schedules): at every rank, the peak of chunk forwards not yet backwarded, in units of the stage (v chunks).
    m = 6 on 4 stages is a round of 6 micro-batches in torch (`microbatches_per_round`), not Megatron's p."""
    layout = Layout(dp=1, tp=1, pp=p, schedule=schedule, virtual_stages=v)
    for rank in range(p):
        peak_chunks = _torch_peak_chunks(schedule, p, v, m, rank)
        assert in_flight_microbatches(layout, m, stage=rank) == peak_chunks / v, rank
        # the planner's "every chunk forward before the first backward" (plan/memory.py): torch's order says so
        assert (backward_chunks_at_peak(layout, m, stage=rank) == 0) == (v > 1 and peak_chunks == m * v), rank




def _interleaved_ops(p: int, v: int, m: int, rank: int) -> list:
    """The actions torch's ScheduleInterleaved1F1B gives `rank` (its own warm-up and 1F1B order)."""
    from torch.distributed.pipelining import schedules as ts

    per_round = m // max(1, m // p)
    warmup = ts._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)
    return ts._get_1f1b_rank_ops(
        v, p, warmup, v * m - warmup, warmup, rank,
        lambda step: ((step // per_round) % v) * p + rank,
        lambda step: (v - 1 - ((step - warmup) // per_round) % v) * p + rank)

@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 4), (2, 2, 16), (4, 2, 16), (16, 7, 16), (4, 4, 8),
                                           (4, 2, 6), (8, 2, 32), (2, 32, 2)])
def test_backward_chunks_at_peak_are_torchs_schedule_order(p: int, v: int, m: int) -> None:
    """At every rank, the most chunks whose backward has started at a moment the chunk forwards not yet
    backwarded are at their peak, over the order torch's ScheduleInterleaved1F1B runs (the planner holds those
    chunks' gathered weights and unsharded gradients at the peak, plan/memory.py)."""
    from torch.distributed.pipelining import schedules as ts

    layout = Layout(dp=1, tp=1, pp=p, schedule="interleaved_1f1b", virtual_stages=v)
    for rank in range(p):
        ops = _interleaved_ops(p, v, m, rank)
        peak = _torch_peak_chunks("interleaved_1f1b", p, v, m, rank)
        live, touched, at_peak = 0, set(), 0
        for op in ops:
            if op is None:
                continue
            if op.computation_type == ts._ComputationType.FORWARD:
                live += 1
            elif op.computation_type == ts._ComputationType.FULL_BACKWARD:
                touched.add(op.stage_index)
                if live == peak:  # the backward runs with every forward at its peak still live
                    at_peak = max(at_peak, len(touched))
                live -= 1
        expected = backward_chunks_at_peak(layout, m, stage=rank)
        if expected == 0:  # the first backward comes once every forward ran: at most its own chunk touched
            assert at_peak <= 1, rank
        else:
            assert expected == at_peak, (rank, expected, at_peak)


def test_fewer_micro_batches_than_stages_idle_the_pipeline() -> None:
    """Interleaved 1F1B with m < p (torch's flex-pp schedule allows it): m micro-batches cross p·v chunk positions
    one after another, so with 1 micro-batch on 2 stages half the time is idle whatever v, where (p − 1)/(v·m)
    would give 1/v; at m = p both agree."""
    import dataclasses

    from leantrain.plan.inputs import plan_inputs
    from leantrain.plan.timing import step_time
    from leantrain.spec import spec_from_dict

    inputs = plan_inputs(spec_from_dict({
        "model": {"n_layers": 64, "d_model": 4096, "n_heads": 32, "vocab_size": 32000},
        "data": {"tokens_total": 1e10, "seq_len": 4096}, "hardware": {"accelerator": "H100-SXM", "num_nodes": 1},
        "budget": {"target_days": None, "num_gpus": 8}}))
    base = Layout(dp=4, tp=1, pp=2, zero=1, schedule="interleaved_1f1b", virtual_stages=32)
    one = step_time(inputs, base, sequences_per_step=4)  # m = 1
    two = step_time(inputs, dataclasses.replace(base), sequences_per_step=8)  # m = 2 = p
    assert one.bubble_s / one.compute_s == pytest.approx(1.0, rel=0.05)
    assert two.bubble_s / two.compute_s == pytest.approx(1 / 64, rel=0.3)

def _recv_buffer_worker(rank: int, port: int, m: int, out: str) -> None:
    """One rank of a 2-stage Schedule1F1B over gloo: the receive buffers its PipelineStage keeps after 2 steps."""
    import json
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    d, seq = 32, 16
    stage = PipelineStage(torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Linear(d, d)), rank, 2,
                          torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda y, t: (y - t).pow(2).mean())
    for _ in range(2):
        if rank == 0:
            schedule.step(torch.randn(m, seq, d))
        else:
            schedule.step(target=torch.zeros(m, seq, d), losses=[])
    held = [info.buffer for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos if getattr(info, "buffer", None) is not None]
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump({"buffers": len(held), "numel": sorted({t.numel() for t in held})}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("m", [5])
def test_pipeline_receive_buffers_are_what_torchs_stage_keeps(tmp_path: Path, m: int) -> None:
    """torch's PipelineStage keeps one receive buffer per micro-batch for the first stage's output gradients and
    the last stage's inputs, a micro-batch's hidden states each, across steps: what plan.memory
    `recv_buffer_bytes` counts (PIPELINE_RECV_BUFFERS)."""
    import json
    import socket

    import torch.multiprocessing as mp

    from leantrain.plan.inputs import plan_inputs
    from leantrain.plan.memory import recv_buffer_bytes
    from leantrain.spec import spec_from_dict

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_recv_buffer_worker, args=(port, m, str(tmp_path)), nprocs=2, join=True)
    seen = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}
    inputs = plan_inputs(spec_from_dict({"model": {"n_layers": 4, "d_model": 32, "n_heads": 4, "vocab_size": 64},
                                         "data": {"tokens_total": 1e6, "seq_len": 16}}))
    one = 16 * 32 * inputs.act_bytes  # a micro-batch of one sequence: seq × d_model
    layout = Layout(dp=1, tp=1, pp=2)
    for rank in (0, 1):
        assert seen[rank]["numel"] == [16 * 32], seen
        assert recv_buffer_bytes(inputs, layout, stage=rank, num_microbatches=m) == seen[rank]["buffers"] * one, seen
