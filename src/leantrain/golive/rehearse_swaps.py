"""What `leantrain rehearse` answers in place of a device run, where fake tensors have no values or a second
rank in one process would see the first one's state (the watching is `rehearse_probes`).

- `host_reads`: `.tolist()` of a device tensor as one counted sync, and DTensor's shard-offset arithmetic on
  real host tensors.
- `balanced_expert_splits`: expert parallelism's all-to-all split sizes as a balanced router gives them.
- `planned_save`: a checkpoint save planned by DCP's planner (write items, bytes) instead of written.
- `planned_weight_reads`: `model.init_from`'s safetensors read as headers, each slice a fake tensor.
- `synthetic_data_dir`: token data when the spec's data dir is not here.
- `accelerator_kernels`, `eager_optimizer_updates`: the GPU's kernel choices, and torchao's compiled
  optimizer update run eagerly.
- `rank_keyed_meshes`, `forget_torch_caches`: device meshes that are equal only within one rank, and torch's
  per-mesh caches dropped between ranks, so a later rank rehearsed in the same process never gets an earlier
  rank's mesh.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from leantrain.errors import UserInputError
from leantrain.golive.rehearse_probes import HostSyncCounter, Probes, call_site
from leantrain.spec.schema import JobSpec


def synthetic_data_dir(spec: JobSpec, *, root: Path) -> Path:
    """A small token data dir with the spec's vocabulary and sources, when the spec's own is not here. Preference
    pairs (`finetune.method: dpo`) have a layout of their own (chosen and rejected windows, response masks) that
    only `leantrain prepare` writes: such a spec is rehearsed on its prepared data dir."""
    from leantrain.data.layout import write_token_data_dir

    if spec.task == "finetune" and spec.finetune.method == "dpo":
        raise UserInputError(f"data.dir {spec.data.dir}: not here, and a finetune.method dpo job is rehearsed on "
                             "its prepared preference pairs; run `leantrain prepare` on the spec first")
    rng = np.random.default_rng(spec.training.seed)
    vocab = spec.model.vocab_size or 32000
    names = [s.name for s in spec.data.sources] or ["synthetic"]
    docs = {name: [rng.integers(1, vocab, int(rng.integers(64, 4096))).tolist() for _ in range(16)]
            for name in names}
    weights = {name: 1.0 / len(names) for name in names}
    path = root / "data"
    write_token_data_dir(path, docs, vocab_size=vocab, eos_id=0, weights=weights, valid_docs_by_source=None,
                         shard_size_tokens=1 << 20)
    return path


@contextmanager
def host_reads(counter: HostSyncCounter) -> Iterator[None]:
    """Two host reads answered without an op per element, as a device run does each in one step:
    - `.tolist()` of a fake (device) tensor is one transfer and one sync; fake tensors read it element by element
      through the dispatcher (a world-sized per-rank vector at 16,384 ranks was half a 405B rank's rehearsal).
      It is counted once at its line and answered with the healthy run's values (as the counter answers
      `.item()`); a tensor whose values the host knows (built from Python numbers) is read as it is.
    - DTensor's shard-offset arithmetic (`_compute_local_shape_and_global_offset`: an `arange` over a dimension,
      split and read back) is host data from Python numbers: it runs on real tensors, as on a device run. On
      fake ones its reads had no values, so a strided shard's offset was a stand-in (and each read a sync).
      The answer depends only on the global shape, the mesh's shape, this rank's coordinate and the
      placements, so it is kept for the rank's next tensor of the same kind: a strided shard's arithmetic
      builds index tensors as long as the dimension (57 ms for 405B's 53,248-row w1), and each save plans
      a parameter and its two Adam states alike."""
    from torch.distributed.tensor import _utils

    fake_tolist = FakeTensor.tolist
    offsets = _utils._compute_local_shape_and_global_offset

    def tolist(tensor: FakeTensor) -> Any:
        if tensor.constant is not None or not counter.probes.counting:
            return fake_tolist(tensor)
        counter.count("_local_scalar_dense")
        value = True if tensor.dtype == torch.bool else 1.0 if tensor.dtype.is_floating_point else 1
        return _nested(value, list(tensor.shape))

    known: dict[tuple[Any, ...], Any] = {}

    def real_offsets(global_shape: Any, mesh_shape: Any, my_coordinate: Any, placements: Any,
                     skip_offset: bool = False) -> Any:
        coordinate = my_coordinate if isinstance(my_coordinate, (list, tuple)) else (
            [my_coordinate(dim) for dim in range(len(mesh_shape))] if callable(my_coordinate) else None)
        try:
            key = (tuple(global_shape), tuple(mesh_shape), tuple(coordinate), tuple(placements), skip_offset)
            hash(key)
        except TypeError:  # a symbolic size or coordinate: no memo
            key = None
        if key is not None and key in known:
            return known[key]
        with unset_fake_temporarily():
            answer = offsets(global_shape, mesh_shape, coordinate, placements, skip_offset)
        if key is not None:
            known[key] = answer
        return answer

    with mock.patch.object(FakeTensor, "tolist", tolist), \
            mock.patch.object(_utils, "_compute_local_shape_and_global_offset", real_offsets):
        yield


def _nested(value: Any, shape: list[int]) -> Any:
    if not shape:
        return value
    return [_nested(value, shape[1:]) for _ in range(shape[0])]


@contextmanager
def balanced_expert_splits(probes: Probes) -> Iterator[None]:
    """Expert parallelism's all-to-all split sizes (`leantrain.parallel.expert.host_splits`, a host read of the
    routed counts) as a balanced router would give them: the rows spread evenly over the EP ranks. The read is
    counted as the host sync it is."""
    from leantrain.parallel import expert

    def balanced(send_counts: torch.Tensor, recv_counts: torch.Tensor, *, num_rows: int) -> tuple[list[int], list[int]]:
        if probes.counting:
            probes.current.syncs[f"{call_site()} expert split sizes (.tolist)"] += 1
        ep = send_counts.shape[0]
        splits = [num_rows // ep + (1 if i < num_rows % ep else 0) for i in range(ep)]
        return splits, list(splits)

    with mock.patch.object(expert, "host_splits", balanced):
        yield


@contextmanager
def rank_keyed_meshes() -> Iterator[None]:
    """A DeviceMesh equal (and hashed) by its layout, ranks and this rank: torch's equality leaves the rank out,
    as one process is one rank, so a cache keyed by a mesh (DTensor's sharding propagation, FSDP's specs) handed
    the next rank rehearsed in the same process a mesh of an earlier rank (its coordinate, hence its shard
    offsets). Within one rank nothing changes."""
    from torch.distributed.device_mesh import DeviceMesh

    key = DeviceMesh._hash_key
    equal = DeviceMesh.__eq__

    def hash_key(mesh: DeviceMesh) -> tuple[Any, ...]:
        return (*key(mesh), getattr(mesh, "_rank", None))

    def eq(mesh: DeviceMesh, other: object) -> bool:
        return equal(mesh, other) and getattr(mesh, "_rank", None) == getattr(other, "_rank", None)

    # torch's __hash__ hashes `_hash_key()` (and keeps it on the mesh), so the key is all it needs
    with mock.patch.object(DeviceMesh, "_hash_key", hash_key), mock.patch.object(DeviceMesh, "__eq__", eq):
        yield


@contextmanager
def accelerator_kernels(capability: tuple[int, int] | None) -> Iterator[None]:
    """`model.moe.grouped_mm_supported` answered for a GPU of `capability` (the catalog's, hardware.py): on an
    A100 the trainer runs the padded fallback (its memory and its host sync), on Hopper the grouped GEMM, while
    the rehearsal's CPU device would take the grouped GEMM for both. None (the `cpu` accelerator): the CPU's own
    rule stays, and its fp32 grouped GEMM, which torch's shape rule for the op refuses (bf16 only, the CUDA
    kernel's rule), runs as `_Fp32GroupedGemm`."""
    from leantrain.model import moe

    if capability is None:
        grouped = moe._grouped

        def cpu_grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            if isinstance(x, FakeTensor) and x.dtype == torch.float32:
                return moe._ContiguousGrad.apply(_Fp32GroupedGemm.apply(x, weight, offsets))
            return grouped(x, weight, offsets)

        with mock.patch.object(moe, "_grouped", cpu_grouped):
            yield
        return

    def on_the_accelerator(device: torch.device, dtype: torch.dtype) -> bool:
        return hasattr(torch, "_grouped_mm") and moe.grouped_mm_on_gpu(capability, dtype)

    with mock.patch.object(moe, "grouped_mm_supported", on_the_accelerator), \
            mock.patch.object(F, "scaled_dot_product_attention", _gpu_attention(capability)):
        yield


def _gpu_attention(capability: tuple[int, int]) -> Any:
    """`F.scaled_dot_product_attention` as a GPU of `capability` picks its kernel, where the CPU picks another.

    Value heads narrower than the query/key heads (latent attention, `model.mla`: 128 against 128 + 64 in
    DeepSeek-V3) are refused by both flash kernels, the CPU's and CUDA's (they need one head width), and the CPU
    then runs the math path, which materialises the (heads, seq, seq) scores in fp32, their softmax and its bf16
    copy: 20 GiB per MLA layer at DeepSeek-V3's 128 heads and 4,096 tokens, held while the layer's backward runs.
    CUDA's dispatcher (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) takes the memory-efficient kernel
    instead (q and k one width, every width a multiple of 8; bf16 from sm80), which keeps its output and an fp32
    log-sum-exp per head and query row. That op is run here (its fake-tensor rule and autograd formula are
    torch's own); every other call takes torch's path (same widths: the CPU's flash kernel holds what CUDA's
    does)."""
    sdpa = F.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        widths = (query.shape[-1], key.shape[-1], value.shape[-1])
        if not (isinstance(query, FakeTensor) and attn_mask is None and query.shape[-3] == key.shape[-3]
                and widths[0] == widths[1] != widths[2] and all(width % 8 == 0 for width in widths)
                and (dtype != torch.bfloat16 or capability >= (8, 0))):
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        query, key, value = (tensor.to(dtype) for tensor in (query, key, value))  # autocast's cast of SDPA
        grad = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, grad, dropout_p, is_causal, scale=scale)[0]

    return attention


@contextmanager
def eager_optimizer_updates() -> Iterator[None]:
    """torchao's optimizers (`precision.optimizer_state: 8bit`) compile their per-parameter update at each step
    (`torch.compile(single_param_adam)` in torchao/optim/adam.py), which fake tensors cannot go through; the
    rehearsal runs that update eagerly, as it runs the model (`training.compile` off). What the update holds is
    the states it creates (the 8-bit moments and their block scales) and the same in-place arithmetic. The
    module's `torch` is what is swapped, not the optimizer's `step`: torch's Optimizer wraps a subclass's step in
    its profiling hook at the first construction, so a step patched later is not the one called."""
    try:
        from torchao.optim import adam, subclass_8bit
    except ImportError:  # no torchao: the spec's 8-bit states were refused before the rehearsal got here
        yield
        return
    # torchao builds its 8-bit quantisation maps once per process, at their first use (lru_cache): built under fake
    # tensors they would hold the rehearsal's healthy answers, and every later real 8-bit run in this process would
    # quantise its moments with them (a tiny run's loss 4.89 -> 21.4 by step 3). Built here, for real, first.
    subclass_8bit.get_qmap_signed()
    subclass_8bit.get_qmap_unsigned()
    with mock.patch.object(adam, "torch", _EagerCompile(adam.torch)):
        yield


@contextmanager
def planned_weight_reads() -> Iterator[None]:
    """A checkpoint's weights (`model.init_from`: continued pre-training and fine-tuning) read as a device run reads
    them, each rank its own slices, but without the data: each safetensors file this rank opens has its header
    read (an open of the file, counted by the file probe), and each slice is answered with a fake tensor of its
    shape and dtype, its bytes counted as read (`fill_from_hf`'s return). safetensors builds a real tensor on a
    storage of the mapped file, which fake tensors cannot take."""
    from leantrain.model import hf_load

    with mock.patch.object(hf_load, "_Reader", _PlannedReader):
        yield


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class _PlannedReader:
    """`hf_load._Reader` with headers only (see `planned_weight_reads`)."""

    def __init__(self) -> None:
        self.headers: dict[Any, dict[str, Any]] = {}
        self.bytes = 0

    def read(self, file: Any, hf_name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if file not in self.headers:
            with open(file, "rb") as handle:  # the format: an 8-byte length, then the JSON header
                (length,) = struct.unpack("<Q", handle.read(8))
                self.headers[file] = json.loads(handle.read(length))
        entry = self.headers[file][hf_name]
        dims = entry["shape"]
        full = [*box, *(slice(0, size) for size in dims[len(box):])]
        shape = [len(range(*cut.indices(size))) for cut, size in zip(full, dims, strict=True)]
        piece = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[entry["dtype"]])
        self.bytes += piece.numel() * piece.element_size()
        return piece

    def close(self) -> None:
        self.headers.clear()


class _EagerCompile:
    """A module's view of `torch` whose `compile` returns the function itself."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @staticmethod
    def compile(fn: Any = None, **_: Any) -> Any:
        return fn


class _Fp32GroupedGemm(torch.autograd.Function):
    """The CPU's fp32 `torch._grouped_mm` (rows (m, k) by their expert's (k, n) weight) as it holds memory: an
    (m, n) output, the rows, the stacked weights and the group ends saved for the backward (what the op's own
    autograd saves: tests/scale/test_rehearse_swaps.py), which makes one gradient of the rows and the weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return x.new_empty((x.shape[0], weight.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


@contextmanager
def unwatched_fake_params() -> Iterator[None]:
    """`torch.utils.swap_tensors` with the fake-tensor converter's memo entries of the two tensors dropped first.

    `Module.to_empty` swaps each fake parameter for its allocated twin (torch does so for every FakeTensor), and
    a swap refuses a tensor with a weak reference: the converter's memo holds one to each meta parameter it
    made fake. On a device the same `to_empty` puts a new Parameter in place; a sharded model (FSDP2, TP) never
    reaches this, as its parameters are DTensors. The memo serves only conversions of a real tensor that the
    model no longer holds, so dropping its entries changes nothing else."""
    swap = torch.utils.swap_tensors

    def unwatched(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for tensor in (t1, t2):
            if isinstance(tensor, FakeTensor):
                memo = tensor.fake_mode.fake_tensor_converter.tensor_memo
                for key in [key for key, value in memo.items() if value is tensor]:
                    del memo[key]
        swap(t1, t2)

    with mock.patch.object(torch.utils, "swap_tensors", unwatched):
        yield


def planned_save(records: list[dict[str, Any]], probes: Probes) -> Any:
    """CheckpointManager.save replaced by DCP's save planning: this rank's write items and bytes, no files."""

    def save(manager: Any, step: int, app_state: dict[str, Any], *, blocking: bool | None = None) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from leantrain.ckpt.dcp_io import build_state_dict

        # Planning reads shapes and offsets only; torch's offset arithmetic builds small host tensors, which
        # must be real (under the fake mode they would be fake and every read of them a stand-in).
        with probes.paused(), unset_fake_temporarily():
            state = build_state_dict(app_state)
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, is_coordinator=manager.rank == 0)
            plan = planner.create_local_plan()
        num_bytes = 0
        for item in plan.items:
            if item.tensor_data is not None:
                num_bytes += math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        records.append({"step": step, "write_items": len(plan.items), "bytes": num_bytes})
        manager.last_saved_step = step
        manager._last_save_clock = manager.clock()  # as a real save does: the interval counts from here

    return save


def planned_clock(trainer: Any, spec: Any) -> None:
    """The checkpoint manager's clock as the real run's: the planner's step time (the spec's layout, its
    accelerator) per step. With `checkpoint.interval_steps: auto` the manager saves by seconds since its last
    save, and on this CPU's wall clock the rehearsal's planned save depended on how fast the CPU rehearsed
    (Llama 3.1 405B's moved from step 100 to step 2 when the rehearsal got faster)."""
    from leantrain.plan.inputs import plan_inputs, sequences_per_step
    from leantrain.plan.layout import layout_from_spec
    from leantrain.plan.timing import step_time

    hook = getattr(trainer, "checkpointer", None)
    if hook is None or hook.manager.auto is None:
        return
    inputs = plan_inputs(spec)
    step_s = step_time(inputs, layout_from_spec(spec.parallelism, spec.training),
                       sequences_per_step=sequences_per_step(inputs)).step_s
    hook.manager.clock = lambda: float(trainer.step) * step_s
    hook.manager._last_save_clock = hook.manager.clock()


def forget_torch_caches() -> None:
    """Drop what torch caches per device mesh (DTensor's sharding propagation and redistribution plans): a
    second fake world in this process would find the first one's process groups in them."""
    from torch.distributed.tensor import DTensor, _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    for name in dir(_redistribute):
        cached = getattr(_redistribute, name)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    getattr(_redistribute, "_planner_cache", {}).clear()
