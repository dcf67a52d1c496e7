"""Each scale-lane pin fails when its defect is planted: a rehearsal of a small 8-rank FSDP job, clean, then with
a host sync in the step, a control-plane agreement every step, a collective per rank of the world, a rank over
its accelerator's memory. Also the command's exit codes and rehearsal.json's fields."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pins import (
    EXAMPLES,
    few_control_collectives,
    memory_fits,
    no_host_syncs,
    same_collectives_at_both_sizes,
)

from leantrain.cli import main

TINY = ("parallelism.data_parallel=8", "parallelism.zero_stage=3", "hardware.num_nodes=4",
        "training.global_batch_tokens=8192", "hardware.accelerator=H100-SXM")


def _rehearse(*extra: str, world: int | None = None) -> dict[str, Any]:
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[*TINY, *extra])
    return rehearse(spec, world_size=world, ranks=[0], isolated=False)  # in this process: the patches apply


@pytest.fixture(scope="module")
def clean() -> dict[str, Any]:
    return _rehearse()


def test_the_clean_job_passes_every_pin(clean: dict[str, Any]) -> None:
    assert not memory_fits(clean) and not no_host_syncs(clean) and not few_control_collectives(clean)
    rank = clean["ranks"][0]
    groups = {c["group"] for c in rank["collectives_per_step"]}
    assert groups == {"dp_shard"}, rank["collectives_per_step"]  # FSDP's gathers and scatters, the grad norm
    assert rank["checkpoint_save"]["write_items"] > 0 and rank["startup"]["files_opened"] > 0


def test_an_auto_checkpoint_interval_follows_the_planned_step_time_not_this_cpu(monkeypatch) -> None:
    """`checkpoint.interval_steps: auto` saves by seconds since the last save. The rehearsal's manager reads the
    planner's step time per step (golive/rehearse_swaps.py `planned_clock`), so a CPU that rehearses an hour per
    clock reading plans the same save as this one: the forced one at the last step (2), the tiny job's planned
    interval being far longer than the control window's 100 planned steps. On its own clock every check step of
    the window would save (the last at step 100)."""
    import itertools

    from leantrain.ckpt.manager import CheckpointManager

    init, readings = CheckpointManager.__init__, itertools.count()

    def slow_clock(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "clock": lambda: 3600.0 * next(readings)})

    monkeypatch.setattr(CheckpointManager, "__init__", slow_clock)
    report = _rehearse("checkpoint.interval_steps=auto")
    assert report["ranks"][0]["checkpoint_save"]["step"] == 2, report["ranks"][0]["checkpoint_save"]


def test_fp8_weight_scales_are_a_data_plane_collective_not_a_control_call(clean: dict[str, Any]) -> None:
    """fp8 under FSDP all-reduces its weights' amaxes over the FSDP ranks after each optimizer step (torchao's
    precompute_float8_dynamic_scale_for_fsdp, called from train/precision.py): part of the step's math, like
    torchtitan's. DeepSeek-V3's fp8 rehearsal had filed it as a control-plane call every step (1.02 per step
    against the pin's 1/50), and the memory tracker's own listing of torchao's fp8 weights (whose
    `__tensor_flatten__` reads `bool(scale)`) as a host sync of the trainer's, one per layer and step."""
    report = _rehearse("precision.compute=fp8")
    rank = report["ranks"][0]
    assert not few_control_collectives(report), rank["control_collectives"]
    assert not no_host_syncs(report), rank["host_sync_counts"]

    def dp_all_reduces(r: dict[str, Any]) -> int:
        return sum(c["count"] for c in r["collectives_per_step"] if (c["op"], c["group"]) == ("all_reduce", "dp_shard"))

    assert dp_all_reduces(rank) > dp_all_reduces(clean["ranks"][0])  # the amaxes' reduce, beside the grad norm's


def test_a_host_sync_in_the_step_is_caught_with_its_site(monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.train import step_metrics

    add = step_metrics.LogWindow.add

    def add_reading_the_loss(self: Any, result: Any) -> None:
        float(result.loss)  # the defect: a device-to-host read every step
        add(self, result)

    monkeypatch.setattr(step_metrics.LogWindow, "add", add_reading_the_loss)
    report = _rehearse()
    assert no_host_syncs(report)
    assert report["ranks"][0]["host_syncs_per_step"] == 1
    # the site is the innermost leantrain frame: the loop's call of the (patched) window
    assert any(site.startswith("leantrain/train/trainer.py") for site in report["ranks"][0]["host_sync_sites"])


def test_an_agreement_every_step_is_caught(clean: dict[str, Any]) -> None:
    report = _rehearse("fault.preempt_check_every=1")
    assert few_control_collectives(report)
    assert report["ranks"][0]["control_collectives_per_step"] >= 1.0
    assert clean["ranks"][0]["control_collectives_per_step"] <= 1 / 50


def test_a_collective_per_rank_of_the_world_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.parallel.parallelize import ParallelModel

    finish = ParallelModel.finish_gradients

    def finish_with_one_call_per_rank(self: Any) -> None:
        flag = torch.zeros(1, device=self.device)
        for source in range(dist.get_world_size()):  # the defect: O(world) calls per step
            dist.broadcast(flag, src=source, group=self.mesh["dp_shard"].get_group())
        finish(self)

    monkeypatch.setattr(ParallelModel, "finish_gradients", finish_with_one_call_per_rank)
    small = _rehearse()
    large = _rehearse("parallelism.data_parallel=16", "hardware.num_nodes=8", "training.global_batch_tokens=16384")
    assert small["num_microbatches"] == large["num_microbatches"]
    found = same_collectives_at_both_sizes(small, large)
    assert any("broadcast" in line for line in found), found


def test_a_rank_over_its_memory_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rehearsal.json"
    code = main(["rehearse", str(EXAMPLES / "tiny-cpu.yaml"), *[f"--set={s}" for s in TINY],
                 "--set", "hardware.memory_gb=0.001", "--ranks", "0", "--json", str(out)])
    assert code == 1
    assert "rank 0 needs" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert memory_fits(report) and not report["fits"]
    assert report["over_capacity"][0]["rank"] == 0 and report["over_capacity"][0]["category"]


def test_rehearsal_json_has_every_field(tmp_path: Path) -> None:
    out = tmp_path / "rehearsal.json"
    assert main(["rehearse", str(EXAMPLES / "tiny-cpu.yaml"), *[f"--set={s}" for s in TINY],
                 "--ranks", "0,last", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"world_size", "layout", "plan", "plan_vs_rehearsal", "ranks", "fits"} <= set(report)
    assert [r["rank"] for r in report["ranks"]] == [0, 7]
    for rank in report["ranks"]:
        assert set(rank["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "temp", "peak"}
        assert {"collectives_per_step", "control_collectives_per_step", "host_syncs_per_step",
                "host_sync_sites", "startup"} <= set(rank)
        assert {"files_opened", "bytes_read", "metadata_reads"} <= set(rank["startup"])
        assert all({"op", "group", "count", "bytes"} == set(c) for c in rank["collectives_per_step"])
    assert set(report["plan"]) >= {"params", "grads", "optimizer", "activations", "temp", "peak"}


def test_the_plan_compared_is_priced_for_the_code_rehearsed(clean: dict[str, Any]) -> None:
    """A spec that plans fused kernels (as examples/llama3-405b.yaml and deepseek-v3.yaml do, for their published
    runs) is rehearsed eager (no compile under fake tensors), so the plan in rehearsal.json is the eager one, and
    says so."""
    from leantrain.golive.rehearse_report import planned_memory
    from leantrain.spec import load_spec

    fused = _rehearse("plan.kernels=fused")
    assert fused["plan_kernels"] == clean["plan_kernels"] == "eager"
    assert fused["plan"] == clean["plan"]
    spec = load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[*TINY, "plan.kernels=fused"])
    as_specified = planned_memory(spec, world_size=8, num_microbatches=clean["num_microbatches"])
    assert as_specified["activations"] < 0.9 * clean["plan"]["activations"]  # fused keeps fewer tensors


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "parallelism.tensor_parallel=2", "--set", "parallelism.data_parallel=4", "--world", "7"],
     "--world 7 is not divisible by parallelism.tensor_parallel"),
    (["--world", "7"], "training.global_batch_tokens"),
    (["--ranks", "8"], "rank 8 is outside"),
    (["--ranks", "zero"], "--ranks"),
    # a planning-only schedule is refused by name, as `train` refuses it (was: "pipeline.py:207 cannot run
    # under fake tensors: KeyError: 'dualpipe'")
    (["--set", "parallelism.pipeline_parallel=2", "--set", "parallelism.data_parallel=4",
      "--set", "parallelism.pipeline_schedule=dualpipe"], "parallelism.pipeline_schedule: dualpipe is planning only"),
])
def test_bad_input_exits_2_naming_the_option(args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    code = main(["rehearse", str(EXAMPLES / "tiny-cpu.yaml"), *[f"--set={s}" for s in TINY],
                 "--json", str(tmp_path / "r.json"), *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_plan_and_check_rehearse_their_layout(tmp_path: Path) -> None:
    spec = str(EXAMPLES / "tiny-cpu.yaml")
    assert main(["check", spec, *[f"--set={s}" for s in TINY], "--rehearse",
                 "--rehearsal-json", str(tmp_path / "check.json")]) == 0
    assert json.loads((tmp_path / "check.json").read_text())["world_size"] == 8  # the spec's own layout
    assert main(["plan", spec, "--rehearse", "--rehearsal-json", str(tmp_path / "plan.json")]) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["world_size"] == 2 and report["ranks"][0]["memory_bytes"]["peak"] > 0  # the plan's 2 GPUs


def test_a_deep_model_extended_from_two_depths_equals_its_full_rehearsal() -> None:
    """`--depth auto` rehearses 1 and 2 layers per pipeline chunk and extends linearly: on 8 layers over PP2 (4 per
    stage) the states, activations, collectives and host syncs of both stages equal the full-depth rehearsal and
    the peak is within 2 % (at Llama-3-8B width with TP2 × PP2 on 16 ranks every category was exactly equal)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[
        *TINY, "model.n_layers=8", "model.tie_embeddings=false", "parallelism.data_parallel=4",
        "parallelism.pipeline_parallel=2",
        "parallelism.pipeline_schedule=1f1b", "parallelism.zero_stage=3"])
    auto = rehearse(spec, ranks=[0, 7], isolated=False)
    full = rehearse(spec, ranks=[0, 7], isolated=False, depth="full")
    assert auto["depth"]["extended_from_layers_per_chunk"] == [1, 2] and "full" in full["depth"]
    for extended, whole in zip(auto["ranks"], full["ranks"], strict=True):
        assert extended["layers"] == 4 and extended["pipeline_stage"] == whole["pipeline_stage"]
        for key in ("collectives_per_step", "host_sync_counts", "host_syncs_per_step"):
            assert extended[key] == whole[key], (extended["rank"], key)
        got, want = extended["memory_bytes"], whole["memory_bytes"]
        for category in ("params", "grads", "optimizer", "activations"):
            assert got[category] == want[category], (extended["rank"], category)
        # the temporaries at the peak of a model this small move a little with depth (1.5 % of the peak here);
        # at 8B width they are exactly linear too
        assert abs(got["peak"] - want["peak"]) <= 0.02 * want["peak"], (got, want)


@pytest.mark.parametrize(("pp", "ranks", "total"), [(2, [0, 7], 16), (4, [0, 2, 7], 32)])
def test_a_step_of_many_micro_batches_extended_from_one_short_step_equals_its_full_rehearsal(
        pp: int, ranks: list[int], total: int) -> None:
    """`--depth auto` also rehearses a 1F1B step of many micro-batches as a short step of pp + 2 that measures what
    one more micro-batch adds (golive/rehearse_slope.py) and extends linearly: 16 micro-batches on PP2 and 32 on
    PP4 give the same collectives, host syncs and memory as the whole step (DeepSeek-V3's 120 is what this
    saves), on the first, a middle and the last stage. The memory does grow with the count (torch's stages
    allocate a receive buffer per micro-batch), linearly, and no longer by a whole output per micro-batch on the
    last stage (the schedule kept every micro-batch's logits: 36 MB here, now 7.6)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[
        *TINY, f"model.n_layers={pp}", "model.tie_embeddings=false", f"parallelism.data_parallel={8 // pp}",
        f"parallelism.pipeline_parallel={pp}", "parallelism.pipeline_schedule=1f1b", "parallelism.zero_stage=1",
        "training.global_batch_tokens=32768"])
    auto = rehearse(spec, ranks=ranks, isolated=False)
    full = rehearse(spec, ranks=ranks, isolated=False, depth="full")
    assert auto["microbatches"]["extended_from"] == [pp + 2] and full["microbatches"] == {"full": total}
    # every micro-batch's logits kept would be ~2.25 MB each (36 MB for PP2's 16)
    assert full["ranks"][1]["memory_bytes"]["activations"] < 10e6 * total / 16, full["ranks"][1]["memory_bytes"]
    assert auto["num_microbatches"] == full["num_microbatches"] == total
    for extended, whole in zip(auto["ranks"], full["ranks"], strict=True):
        for key in ("collectives_per_step", "host_sync_counts", "host_syncs_per_step"):
            assert extended[key] == whole[key], (extended["rank"], key)
        got, want = extended["memory_bytes"], whole["memory_bytes"]
        for category in ("params", "grads", "optimizer", "activations", "temp", "peak"):
            assert abs(got[category] - want[category]) <= 0.01 * max(want[category], 1), (extended["rank"], category)


def test_the_pipeline_receive_buffers_are_counted_whole_as_temp() -> None:
    """torch's PipelineStage makes one receive buffer per micro-batch in step 1 (the first stage's output
    gradients, the last stage's inputs) and keeps them through every step: the rehearsal counts all of them at
    the steady step's peak, as temp (the plan's category), not just those a receive of the tracked step has
    written yet, filed as activations. Four more micro-batches add exactly four buffers to temp, on both
    stages, and to the activations only the step's larger batch of token ids and targets (24 KB a micro-batch
    here, 1/5 of a buffer)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    def rehearsed(microbatches: int) -> list[dict[str, int]]:
        spec = load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[
            *TINY, "model.tie_embeddings=false", "parallelism.data_parallel=4", "parallelism.pipeline_parallel=2",
            "parallelism.pipeline_schedule=1f1b", "parallelism.zero_stage=1",
            f"training.global_batch_tokens={microbatches * 4 * 128 * 4}"])  # micro_batch 4 × seq 128 × dp 4
        report = rehearse(spec, ranks=[0, 7], isolated=False, depth="full")
        assert [r["num_microbatches"] for r in report["ranks"]] == [microbatches] * 2
        return [r["memory_bytes"] for r in report["ranks"]]

    buffer = 4 * 128 * 64 * 4  # micro_batch × seq × d_model × fp32: a stage's output (and its gradient)
    for few, many in zip(rehearsed(4), rehearsed(8), strict=True):
        batch = many["activations"] - few["activations"]
        assert 0 <= batch < buffer, (few, many)
        assert many["temp"] - few["temp"] == 4 * buffer, (few, many)
        assert many["peak"] - few["peak"] == 4 * buffer + batch, (few, many)


def _short_step(spec: Any, *, ranks: list[int], microbatches: int, slope: bool) -> list[dict[str, Any]]:
    """Each rank's report of `spec` run whole with `microbatches` micro-batches, measuring what one more adds."""
    from dataclasses import replace

    from leantrain.golive import rehearse_depth
    from leantrain.golive.rehearse import _rehearse_ranks, resolve_target, synthetic_data_dir

    world = spec.parallelism.world_size
    target = resolve_target(rehearse_depth.with_microbatches(spec, microbatches, world_size=world),
                            world_size=world, ranks=ranks)
    with tempfile.TemporaryDirectory() as scratch:
        data = synthetic_data_dir(target.spec, root=Path(scratch))
        [reports] = _rehearse_ranks([replace(target, slope=slope)], ranks=ranks, data_dir=data,
                                    scratch=Path(scratch), isolated=False)
    assert [r["num_microbatches"] for r in reports] == [microbatches] * len(ranks)
    return reports


MOE_PP = ("parallelism.data_parallel=4", "parallelism.expert_parallel=2", "parallelism.pipeline_parallel=2",
          "parallelism.pipeline_schedule=1f1b", "parallelism.zero_stage=3", "hardware.num_nodes=8",
          "hardware.accelerator=H100-SXM", "precision.compute=bf16", "training.activation_checkpointing=full",
          "model.n_layers=4", "training.global_batch_tokens=8192", "model.tie_embeddings=false")


@pytest.mark.parametrize(("example", "sets", "ranks"), [
    ("tiny-cpu.yaml", (*TINY, "model.n_layers=4", "model.tie_embeddings=false", "parallelism.data_parallel=2",
                       "parallelism.pipeline_parallel=4", "parallelism.pipeline_schedule=1f1b"), [0, 2, 4, 7]),
    ("moe-small-cpu.yaml", MOE_PP, [0, 7])], ids=["pp4-zero3", "pp2-moe-ep-full-recompute"])
def test_what_one_more_micro_batch_adds_is_measured_in_the_step(example: str, sets: tuple[str, ...],
                                                                 ranks: list[int]) -> None:
    """The slope a short 1F1B step measures in itself (one steady period; the micro-batch loop, the whole batch,
    the receive buffers) equals the difference of two whole rehearsals one micro-batch apart, rank by rank: memory
    by category, every collective's calls and bytes, every host sync site. ZeRO-3 gathers and reduces around each
    forward and backward and MoE adds all-to-alls and a host sync per micro-batch."""
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / example, overrides=list(sets))
    pp = spec.parallelism.pipeline_parallel
    measured = _short_step(spec, ranks=ranks, microbatches=pp + 2, slope=True)
    more = _short_step(spec, ranks=ranks, microbatches=pp + 3, slope=False)
    for short, long in zip(measured, more, strict=True):
        slope = short["microbatch_slope"]
        for category in ("activations", "temp", "peak"):
            assert slope["memory_bytes"][category] == long["memory_bytes"][category] - short["memory_bytes"][
                category], (short["rank"], category)
        calls = {(c["op"], c["group"]): (c["count"], c["bytes"]) for c in short["collectives_per_step"]}
        added = {key: (count - calls.get(key, (0, 0))[0], num_bytes - calls.get(key, (0, 0))[1])
                 for key, (count, num_bytes) in ((
                     (c["op"], c["group"]), (c["count"], c["bytes"])) for c in long["collectives_per_step"])}
        assert {(c["op"], c["group"]): (c["count"], c["bytes"]) for c in slope["collectives_per_step"]} == {
            key: value for key, value in added.items() if value != (0, 0)}, short["rank"]
        for phase in ("step", "logging_step"):
            syncs = {site: n - short["host_sync_counts"][phase].get(site, 0)
                     for site, n in long["host_sync_counts"][phase].items()}
            assert slope["host_sync_counts"][phase] == {s: n for s, n in syncs.items() if n}, (short["rank"], phase)
