"""The rehearsal's speed swaps change nothing it reports (golive/rehearse_dispatch.py, the probes' and the memory
tracker's fast paths): every cache-hit output built both ways is the same tensor, a rehearsal with every swap off
reports exactly what it reports with them on, and the output swap is refused when its samples differ."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import re
from typing import Any

import pytest
from pins import EXAMPLES

from leantrain.golive import rehearse_dispatch

DENSE = ("parallelism.data_parallel=2", "parallelism.tensor_parallel=2", "parallelism.pipeline_parallel=2",
         "parallelism.zero_stage=3", "hardware.num_nodes=4", "training.global_batch_tokens=4096",
         "hardware.accelerator=H100-SXM", "precision.compute=fp8", "model.tie_embeddings=false")
MOE = ("parallelism.data_parallel=4", "parallelism.expert_parallel=4", "parallelism.zero_stage=3",
       "hardware.num_nodes=4", "training.global_batch_tokens=8192", "hardware.accelerator=H100-SXM",
       "precision.compute=bf16", "training.activation_checkpointing=full")
JOBS = [("tiny-cpu.yaml", DENSE), ("moe-small-cpu.yaml", MOE)]


def _crosschecked_outputs(example: str, sets: tuple[str, ...]) -> tuple[int, list[str]]:
    """Rehearse `example` with every cache-hit output built by both builders: (hits compared, first differences)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    built = rehearse_dispatch._fast_output
    checked: list[int] = []
    differ: list[str] = []

    def crosschecked() -> Any:
        fast = built()

        def output(mode: Any, state: Any, entry: Any, key: Any, func: Any, args: Any) -> Any:
            theirs = rehearse_dispatch._TORCH_OUTPUT(mode, state, entry, key, func, args)
            ours = fast(mode, state, entry, key, func, args)
            if ours is None or theirs is None or not hasattr(ours, "fake_mode"):
                same = ours is theirs
            else:
                a, b = rehearse_dispatch._described(ours), rehearse_dispatch._described(theirs)
                view = func.is_view if hasattr(func, "is_view") else False
                same = a[:-1] == b[:-1] and (not view or a[-1] == b[-1])
            checked.append(1)
            if not same:
                differ.append(f"{func}: ours {ours!r:.200}, torch {theirs!r:.200}")
            return theirs

        return output

    rehearse_dispatch._fast_output = crosschecked  # this process is the test's own (below)
    rehearse(load_spec(EXAMPLES / example, overrides=list(sets)), ranks=[0], isolated=False)
    return len(checked), differ[:3]


@pytest.mark.parametrize(("example", "sets"), JOBS, ids=["fsdp-tp-pp-fp8", "moe-ep-full-recompute"])
def test_every_cache_hit_output_is_torchs_own(example: str, sets: tuple[str, ...]) -> None:
    """Each cache hit's output is built by both builders and compared (shape, strides, dtype, device, storage and
    its size, dispatch keys, every instance attribute; a view's storage is its input's); torch's is the one used.
    In a process of its own, as tests/scale/test_rehearse_cachekey.py explains."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        checked, differ = pool.apply(_crosschecked_outputs, (example, sets))
    assert checked > 1000  # the swap was in place for the whole rehearsal
    assert not differ, differ


def _report(example: str, sets: tuple[str, ...], *, swaps: bool) -> str:
    """rehearsal.json of `example` (rank 0 and the last rank) with the speed swaps on or all off, without the
    fields that differ from run to run (seconds, scratch paths, the host's cached matmul peak, which the first
    process to need it measures and writes).

    Python's cyclic garbage collector is off while it runs: some of the step's autograd nodes sit in reference
    cycles, and when the collector frees them (and a tensor they hold) depends on how many Python objects were
    made before, which the swaps change (on the MoE job one 128-byte tensor was in or out of the last rank's peak
    with the memory tracker's pytree walk or without it; with the collector off both count it). Memory is
    returned apart, to name the category that differs."""
    import gc
    from functools import partial
    from unittest import mock

    from leantrain.golive import rehearse as rehearse_module
    from leantrain.golive import rehearse_cachekey, rehearse_memory, rehearse_probes
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    @contextlib.contextmanager
    def off(*_args: Any) -> Any:
        yield False

    gc.collect()
    gc.disable()
    with contextlib.ExitStack() as stack:
        if not swaps:
            for module, name, value in (
                    (rehearse_cachekey, "fast_cache_keys", off), (rehearse_dispatch, "fast_cache_outputs", off),
                    (rehearse_dispatch, "unwrapped_dispatch", off), (rehearse_dispatch, "cache_hits", lambda _m: None),
                    (rehearse_module, "step_mem_tracker", partial(rehearse_memory.step_mem_tracker, lean=False)),
                    (rehearse_probes, "metadata_answer", lambda func, args, kwargs: func(*args, **(kwargs or {})))):
                stack.enter_context(mock.patch.object(module, name, value))
        spec = load_spec(EXAMPLES / example, overrides=list(sets))
        report = rehearse(spec, ranks=[0, spec.parallelism.data_parallel * spec.parallelism.tensor_parallel
                                       * spec.parallelism.pipeline_parallel - 1], isolated=False)
    for rank in report["ranks"]:
        rank.pop("rehearsal_s")
        rank["startup"].pop("bytes_read")
        for key in ("files", "metadata_reads"):
            rank["startup"][key] = [f for f in rank["startup"][key] if not f.endswith("cpu_peak_flops.json")]
        rank["startup"]["files_opened"] = len(rank["startup"]["files"])
    memory = {str(r["rank"]): r.pop("memory_bytes") for r in report["ranks"]}
    for r in report["ranks"]:
        r.pop("plan_vs_rehearsal")
    report.pop("plan_vs_rehearsal")
    text = re.sub(r"leantrain-rehearse-[A-Za-z0-9_]+", "SCRATCH", json.dumps(report, sort_keys=True, default=str))
    return json.dumps({"report": text, "memory": memory})


# fp8 memory used to differ from one process to the next (up to three 32 KiB fp8 copies of a micro-batch's
# activations on rank 0 here, ±0.2 GiB at Llama-3-8B width): torch's MemTracker stopped at the first storage of a
# tensor it already knew, and a gathered or viewed Float8TrainingTensor's storages (a new `_data`, its input's
# `_scale`) come as a set ordered by address. The rehearsal's tracker counts every storage
# (`StepMemTracker._track`; tests/test_rehearse_memory.py), and fp8 memory is now the same to the byte too.


BF16 = tuple(s for s in DENSE if not s.startswith("precision.compute")) + ("precision.compute=bf16",)


@pytest.mark.parametrize(("example", "sets"), [("tiny-cpu.yaml", BF16), ("tiny-cpu.yaml", DENSE),
                                               ("moe-small-cpu.yaml", MOE)],
                         ids=["fsdp-tp-pp-bf16", "fsdp-tp-pp-fp8", "moe-ep-full-recompute"])
def test_a_rehearsal_reports_the_same_with_every_speed_swap_off(example: str, sets: tuple[str, ...]) -> None:
    """Memory by category, collectives, control calls, host syncs and their sites, start-up files and the planned
    save: the same to the byte with torch's own cache keys, outputs, fake-mode dispatch of cache hits, wrapped
    dispatch modes, device reads through every mode and torch's memory tracking (its dispatch, snapshot updates
    and module hooks: `step_mem_tracker(lean=False)`)."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as fast_pool, context.Pool(1) as plain_pool:
        fast = json.loads(fast_pool.apply_async(_report, (example, sets), {"swaps": True}).get())
        plain = json.loads(plain_pool.apply_async(_report, (example, sets), {"swaps": False}).get())
    assert fast["report"] == plain["report"]
    for rank, memory in plain["memory"].items():
        for category, value in memory.items():
            assert fast["memory"][rank][category] == value, (rank, category)


def test_the_output_swap_is_refused_when_the_samples_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """A builder that leaves out one of the tensor's memos fails the samples, and torch's builder stays."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    built = rehearse_dispatch._fast_output

    def forgetful() -> Any:
        fast = built()

        def output(*args: Any) -> Any:
            tensor = fast(*args)
            vars(tensor).pop("_nonzero_memo", None)
            return tensor

        return output

    with rehearse_dispatch.fast_cache_outputs() as swapped:
        assert swapped and FakeTensorMode._get_output_tensor_from_cache_entry is not rehearse_dispatch._TORCH_OUTPUT
    assert FakeTensorMode._get_output_tensor_from_cache_entry is rehearse_dispatch._TORCH_OUTPUT
    monkeypatch.setattr(rehearse_dispatch, "_fast_output", forgetful)
    with rehearse_dispatch.fast_cache_outputs() as swapped:
        assert not swapped and FakeTensorMode._get_output_tensor_from_cache_entry is rehearse_dispatch._TORCH_OUTPUT


def test_dispatch_modes_are_rewrapped_on_exit() -> None:
    """Inside, a mode class dispatches through its own function; outside, through torch's wrapper again."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wrapped = FakeTensorMode.__dict__["__torch_dispatch__"]
    with rehearse_dispatch.unwrapped_dispatch(FakeTensorMode):
        assert FakeTensorMode.__dict__["__torch_dispatch__"] is wrapped.__wrapped__
    assert FakeTensorMode.__dict__["__torch_dispatch__"] is wrapped
