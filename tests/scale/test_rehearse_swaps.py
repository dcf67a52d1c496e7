"""What the rehearsal answers in place of a device run (golive/rehearse_swaps.py): one sync for a `.tolist()`,
DTensor's shard offsets computed for real, and ranks rehearsed one after another in one process that each keep
their own device mesh (each fails when its swap is taken out)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from pins import EXAMPLES

# FSDP4 × TP2 with a vocabulary (514) that splits unevenly: the last rank's embedding shard is smaller.
UNEVEN = ("parallelism.data_parallel=4", "parallelism.tensor_parallel=2", "parallelism.zero_stage=3",
          "hardware.num_nodes=4", "training.global_batch_tokens=4096", "hardware.accelerator=H100-SXM",
          "model.tie_embeddings=false", "model.vocab_size=514")


def _uneven(*, isolated: bool) -> dict[str, Any]:
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    return rehearse(load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=list(UNEVEN)), ranks=[0, 7], isolated=isolated)


def _rank_facts(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(r["rank"], r["memory_bytes"], r["collectives_per_step"], r["host_sync_counts"]) for r in report["ranks"]]


@pytest.mark.slow
def test_ranks_rehearsed_in_one_process_equal_ranks_in_processes_of_their_own() -> None:
    together, apart = _uneven(isolated=False), _uneven(isolated=True)
    assert _rank_facts(together) == _rank_facts(apart)
    params = {r["rank"]: r["memory_bytes"]["params"] for r in apart["ranks"]}
    assert params[7] < params[0]  # the uneven vocabulary: rank 7's own (smaller) shards, not rank 0's


def _without_rank_keyed_meshes() -> str:
    """The error of the uneven rehearsal with `rank_keyed_meshes` taken out (run in a fresh process: meshes and
    process groups that earlier in-process rehearsals of the test worker left behind must not be met first)."""
    from leantrain.golive import rehearse
    from leantrain.golive.rehearse import RehearsalError

    with mock.patch.object(rehearse, "rank_keyed_meshes", contextlib.nullcontext):
        try:
            _uneven(isolated=False)
        except RehearsalError as err:
            return str(err)
    return "no error"


def test_without_rank_keyed_meshes_a_later_rank_meets_an_earlier_ranks_mesh() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        message = pool.submit(_without_rank_keyed_meshes).result(timeout=300)
    assert message.startswith("rank 7"), message


def test_tolist_of_a_device_tensor_is_one_sync_answered_healthy() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leantrain.golive.rehearse_probes import HostSyncCounter, Probes
    from leantrain.golive.rehearse_swaps import host_reads

    probes = Probes()
    counter = HostSyncCounter(probes)
    with FakeTensorMode(), counter, host_reads(counter):
        per_rank = torch.zeros(2, 16384)  # a world-sized vector: one transfer on a device
        values = per_rank.tolist()
        flags = (torch.ones(3) > 0).tolist()
        known = torch.tensor([3, 4]).tolist()  # built from Python numbers: the host has the values
    assert len(values) == 2 and len(values[1]) == 16384 and values[1][-1] == 1.0
    assert flags == [True, True, True] and known == [3, 4]
    syncs = probes.phase("startup").syncs
    assert sum(syncs.values()) == 2 and all(site.endswith("_local_scalar_dense") for site in syncs), syncs


def test_shard_offsets_are_computed_for_real_under_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    from leantrain.golive.rehearse_probes import HostSyncCounter, Probes
    from leantrain.golive.rehearse_swaps import host_reads
    from leantrain.parallel.dryrun import fake_process_group

    placements = (_StridedShard(0, split_factor=8), Shard(0))  # FSDP over TP's vocabulary split
    with fake_process_group(rank=16383, world_size=16384):
        mesh = init_device_mesh("cpu", (16, 128, 8), mesh_dim_names=("pp", "dp_shard", "tp"))["dp_shard", "tp"]
        expected = compute_local_shape_and_global_offset((128256, 16384), mesh, placements)
        probes = Probes()
        counter = HostSyncCounter(probes)
        with FakeTensorMode(allow_non_fake_inputs=True), counter, host_reads(counter):
            rehearsed = compute_local_shape_and_global_offset((128256, 16384), mesh, placements)
    assert expected == ((30, 16384), (128226, 0))  # the last rank's 30 rows, at its own offset
    assert rehearsed == expected and not probes.phase("startup").syncs


def test_shard_offsets_are_kept_per_coordinate_not_reused_across_them() -> None:
    """The offset arithmetic's answers are kept (a strided shard's costs tens of ms), keyed by the coordinate
    too: every coordinate of a strided FSDP × TP split still gets its own offset inside one watch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _utils
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    from leantrain.golive.rehearse_probes import HostSyncCounter, Probes
    from leantrain.golive.rehearse_swaps import host_reads

    placements = (_StridedShard(0, split_factor=4), Shard(0))
    coordinates = [[a, b] for a in range(3) for b in range(4)] * 2
    expected = [_utils._compute_local_shape_and_global_offset((1000, 64), (3, 4), c, placements)
                for c in coordinates]
    counter = HostSyncCounter(Probes())
    with FakeTensorMode(allow_non_fake_inputs=True), counter, host_reads(counter):
        rehearsed = [_utils._compute_local_shape_and_global_offset((1000, 64), (3, 4), c, placements)
                     for c in coordinates]
    assert rehearsed == expected
    assert len({offset for _, offset in rehearsed}) == 12


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _workers(pid: int) -> set[int]:
    """The spawned multiprocessing workers among `pid`'s children."""
    children = {int(c) for c in _read(f"/proc/{pid}/task/{pid}/children").split()}
    return {c for c in children if b"spawn_main" in _read(f"/proc/{c}/cmdline")}


def _alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[-1].split()[0] != b"Z"


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_a_terminated_rehearsal_takes_its_worker_processes_with_it(tmp_path: Any) -> None:
    """SIGTERM to `leantrain rehearse` (a scheduler, `kill`) used to leave its spawned rank workers running as
    orphans, minutes of CPU each; now each worker, and the manager serving their broadcast channel, ends with its
    parent (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sets = [f"--set={s}" for s in UNEVEN]
    proc = subprocess.Popen([sys.executable, "-m", "leantrain.cli", "rehearse", str(EXAMPLES / "tiny-cpu.yaml"),
                             *sets, "--ranks", "0,1,2,3,4,5,6,7", "--json", str(tmp_path / "r.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 3 and time.monotonic() < deadline and proc.poll() is None:
            workers |= _workers(proc.pid)  # the channel's manager, then the rank workers
            time.sleep(0.05)
        assert len(workers) >= 3, workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], workers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for worker in workers:
            with contextlib.suppress(OSError):
                os.kill(worker, signal.SIGKILL)


def test_the_peak_listing_adds_up_to_the_rehearsals_categories() -> None:
    """scripts/rehearsal_peak.py lists the storages live at the peak; its activations are the report's."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "rehearsal_peak.py"
    loaded = importlib.util.spec_from_file_location("rehearsal_peak", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    record, live = module.peak_storages(EXAMPLES / "tiny-cpu.yaml", sets=list(UNEVEN), rank=0)
    listed = sum(size * n for (category, size), n in live.items() if category == "ACT")
    assert listed == record["memory_bytes"]["activations"] > 0



def test_a_one_rank_unsharded_job_is_rehearsed_and_its_state_counted() -> None:
    """One GPU, no FSDP or TP (plain parameters, allocated by `to_empty`): the rehearsal runs and counts the fp32
    parameters (with the buffers), their gradients and two AdamW moments per parameter."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.model import Transformer, model_args_from_spec
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[
        "parallelism.data_parallel=1", "hardware.gpus_per_node=1", "hardware.accelerator=H100-SXM",
        "precision.compute=bf16", "precision.master_weights=fp32", "precision.optimizer_state=fp32"])
    with torch.device("meta"):
        model = Transformer(model_args_from_spec(spec.model, max_seq_len=spec.data.seq_len))
    numel = sum(p.numel() for p in model.parameters())  # the tied embedding once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    memory = rehearse(spec, ranks=[0], isolated=False)["ranks"][0]["memory_bytes"]
    assert (memory["params"], memory["grads"], memory["optimizer"]) == (4 * numel + buffers, 4 * numel, 8 * numel)


def test_to_empty_of_fake_parameters_needs_the_converters_memo_dropped() -> None:
    """torch refuses to swap a fake parameter its converter still watches; inside `unwatched_fake_params` the
    same `to_empty` allocates every parameter and keeps the tied one tied."""
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from leantrain.golive.rehearse_swaps import unwatched_fake_params

    def build() -> nn.Sequential:
        with torch.device("meta"):
            model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        return model

    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match="Couldn't swap"):
        build().to_empty(device="cpu")
    with FakeTensorMode(allow_non_fake_inputs=True), unwatched_fake_params():
        model = build().to_empty(device="cpu")
        assert model(torch.tensor([1, 2])).shape == (2, 10)
    assert isinstance(model[0].weight, FakeTensor) and model[0].weight.device.type == "cpu"
    assert model[1].weight is model[0].weight


@pytest.mark.parametrize(("accelerator", "compute", "padded"), [
    ("A100-80GB", "bf16", True), ("H100-SXM", "bf16", False), ("H100-SXM", "fp32", True)])
def test_moe_experts_run_the_kernel_the_accelerator_would(accelerator: str, compute: str, padded: bool) -> None:
    """The grouped GEMM needs sm90+ and bf16 (model/moe.py): an A100 or an fp32 job runs the padded fallback, with
    its host sync per MoE layer and micro-batch, where the rehearsal's CPU device would run the grouped GEMM
    (and, in fp32, fail: its fake kernel takes bf16 only)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / "moe-small-cpu.yaml", overrides=[
        f"hardware.accelerator={accelerator}", f"precision.compute={compute}"])
    rank = rehearse(spec, ranks=[0], isolated=False)["ranks"][0]
    moe_sites = [site for site in rank["host_sync_sites"] if site.startswith("leantrain/model/moe.py")]
    assert bool(moe_sites) is padded, rank["host_sync_sites"]
    assert (rank["host_syncs_per_step"] > 0) is padded


def _moe_saved_tensors() -> tuple[list[tuple[Any, ...]], tuple[Any, ...]]:
    """(shape, dtype) of every tensor an fp32 MoE block (shared expert included) saves for its backward, and
    (shape, dtype) of the input's gradient."""
    from leantrain.model.moe import MoE
    from leantrain.model.transformer import model_args_from_spec
    from leantrain.spec import spec_from_dict

    spec = spec_from_dict({
        "model": {"architecture": "moe", "n_layers": 1, "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_hidden": 64, "vocab_size": 64,
                  "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16, "num_shared_experts": 1}},
        "data": {"tokens_total": 1e6, "seq_len": 16}, "training": {"global_batch_tokens": 32}})
    block = MoE(model_args_from_spec(spec.model, max_seq_len=16))
    x = torch.randn(2, 16, 32, requires_grad=True)
    saved: list[tuple[Any, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out.sum().backward()
    assert x.grad is not None
    return sorted(saved, key=str), (tuple(x.grad.shape), x.grad.dtype)


def test_the_cpus_fp32_grouped_gemm_runs_under_fake_tensors_holding_what_the_real_one_holds() -> None:
    """The `cpu` accelerator keeps the CPU's kernel rule: fp32 experts run `torch._grouped_mm`, which torch's fake
    shape rule refuses (bf16 only). `accelerator_kernels(None)` runs it as a stand-in that saves what the real op
    saves, so the bundled fp32 MoE example can be rehearsed (until 2026-12-06 it stopped at moe.py's `_grouped`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leantrain.golive.rehearse import rehearse
    from leantrain.golive.rehearse_swaps import accelerator_kernels
    from leantrain.spec import load_spec

    real = _moe_saved_tensors()
    with FakeTensorMode(), pytest.raises(RuntimeError, match="BF16"):
        _moe_saved_tensors()
    with FakeTensorMode(), accelerator_kernels(None):
        assert _moe_saved_tensors() == real
    report = rehearse(load_spec(EXAMPLES / "moe-small-cpu.yaml"), ranks=[0], isolated=False)
    for category, ratio in report["plan_vs_rehearsal"].items():  # the plan, counted independently, agrees
        assert 0.9 <= ratio <= 1.1, (category, report["plan_vs_rehearsal"])


def test_eight_bit_optimizer_states_are_rehearsed_at_their_own_size() -> None:
    """`precision.optimizer_state: 8bit` (torchao's AdamW8bit, the seed example's setting): its update, compiled
    by torchao at every step, runs eagerly under the rehearsal (fake tensors cannot be compiled: the rehearsal
    of examples/seed-10b.yaml stopped at optim.py's `step_if_finite`), and its states are counted by their uint8
    codes and block scales, not by the fp32 size they present (plan ÷ rehearsal was 0.25)."""
    optim = pytest.importorskip("torchao.optim")
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    # torch wraps AdamW8bit.step in its profiling hook at the first construction: whatever ran before in this
    # process, the rehearsal's eager update must hold (a patched `step` did not, in a test worker)
    optim.AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))])
    from torchao.optim import subclass_8bit
    from torchao.optim.quant_utils import create_dynamic_map

    # torchao builds its quantisation maps at their first use, once per process: the rehearsal must not be that use
    # (under fake tensors the maps held its answers, and a later real 8-bit run here diverged: loss 4.89 -> 21.4)
    subclass_8bit.get_qmap_signed.cache_clear()
    subclass_8bit.get_qmap_unsigned.cache_clear()
    overrides = ["model.d_model=256", "model.ffn_hidden=512", "hardware.num_nodes=1"]
    eight, full = (rehearse(load_spec(EXAMPLES / "tiny-cpu.yaml", overrides=[
        *overrides, f"precision.optimizer_state={state}"]), ranks=[0], isolated=False) for state in ("8bit", "fp32"))
    assert subclass_8bit.get_qmap_signed() == tuple(create_dynamic_map(signed=True))
    assert subclass_8bit.get_qmap_unsigned() == tuple(create_dynamic_map(signed=False))
    assert 0.9 <= eight["plan_vs_rehearsal"]["optimizer"] <= 1.1, eight["plan_vs_rehearsal"]
    states = {name: r["ranks"][0]["memory_bytes"]["optimizer"] for name, r in (("8bit", eight), ("fp32", full))}
    assert 0.25 <= states["8bit"] / states["fp32"] <= 0.3, states  # 1 byte + scales per moment against 4


@pytest.mark.parametrize("example", ["continue-pretrain-cpu.yaml", "finetune-lora-cpu.yaml"])
def test_jobs_that_start_from_existing_weights_are_rehearsed(tmp_path: Path, example: str) -> None:
    """Continued pre-training and fine-tuning load `model.init_from`: safetensors builds each slice on a storage of
    the mapped file, which fake tensors cannot take (both examples stopped at hf_load.py's read), and torch's
    MemTracker hooked every parameter, which a frozen LoRA base refuses. The weights are read as headers, each
    rank's slices answered as fake tensors; the files are counted as opened."""
    pytest.importorskip("transformers")
    from leantrain.golive.rehearse import rehearse
    from leantrain.model.tiny_hf import save_tiny_hf
    from leantrain.spec import load_spec

    hf = save_tiny_hf(tmp_path / "hf", tokenizer=True)
    report = rehearse(load_spec(EXAMPLES / example, overrides=[f"model.init_from={hf}"]), ranks=[0], isolated=False)
    rank = report["ranks"][0]
    assert str(Path(hf) / "model.safetensors") in rank["startup"]["files"]
    # LoRA: activations 1.14, peak 1.11 planned/rehearsed until the plan took off what a frozen base does not keep
    ratios = report["plan_vs_rehearsal"]
    assert abs(ratios["peak"] - 1) <= 0.1 and abs(ratios["activations"] - 1) <= 0.1, ratios


def test_a_dpo_job_without_its_prepared_pairs_is_one_clear_error() -> None:
    from leantrain.errors import UserInputError
    from leantrain.golive.rehearse_swaps import synthetic_data_dir
    from leantrain.spec import spec_from_dict

    spec = spec_from_dict({"task": "finetune", "finetune": {"method": "dpo", "dpo": {"weights": "full"}},
                           "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 128},
                           "data": {"tokens_total": 1e5, "seq_len": 32, "dir": "/nowhere/pairs"},
                           "training": {"global_batch_tokens": 128, "micro_batch": 2}})
    with pytest.raises(UserInputError, match="rehearsed on its prepared preference pairs"):
        synthetic_data_dir(spec, root=Path("/tmp"))


def test_full_dpo_rehearses_with_its_frozen_reference_counted(tmp_path: Path) -> None:
    """Full DPO (`finetune.dpo.weights: full`) keeps a frozen copy of the init_from weights beside the policy
    (train/dpo.py). The rehearsal, on prepared preference pairs, counts it in the rank's parameters and in the
    tracked peak: params plan ÷ rehearsal was 1.98 (the copy missing from the rehearsal)."""
    pytest.importorskip("transformers")
    import json

    from leantrain.cli import main
    from leantrain.golive.rehearse import rehearse
    from leantrain.model.tiny_hf import save_tiny_hf
    from leantrain.spec import load_spec

    hf = save_tiny_hf(tmp_path / "hf", tokenizer=True)
    with open(tmp_path / "prefs.jsonl", "w", encoding="utf-8") as out:
        for a in range(40):
            prompt = [{"role": "user", "content": f"What is {a} + 1?"}]
            out.write(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": f"{a + 1}."}],
                                  "rejected": [{"role": "assistant", "content": "I cannot add."}]}) + "\n")
    text = (EXAMPLES / "dpo-lora-cpu.yaml").read_text()
    for old, new in (("../demo-out/lora-hf", str(hf)), ("../demo-out/dpo-data", str(tmp_path / "pairs")),
                     ("../demo-out/arith-prefs.jsonl", str(tmp_path / "prefs.jsonl")),
                     ("../demo-out/dpo-run", str(tmp_path / "run"))):
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "dpo.yaml").write_text(text)
    assert main(["prepare", str(tmp_path / "dpo.yaml")]) == 0
    spec = load_spec(tmp_path / "dpo.yaml", overrides=["finetune.dpo.weights=full"])
    report = rehearse(spec, ranks=[0], isolated=False)
    ratios = report["plan_vs_rehearsal"]
    assert 0.9 <= ratios["params"] <= 1.1 and 0.9 <= ratios["peak"] <= 1.1, ratios
