"""What `leantrain rehearse`'s memory count must see and must not see.

Must see: the steady step (step 2) is counted by torch's MemTracker, which learns of a tensor when an op of the
tracked step makes or touches it. torch's PipelineStage makes its receive buffers (one per micro-batch for each
non-first chunk's input and each non-last chunk's output gradient) once, in step 1, and they stay allocated
through every step; MemTracker would count each only from the op that first writes it in step 2, in the
category of that moment (a receive issued by the schedule outside autograd's backward reads as an
activation), so at the peak the buffers of micro-batches not yet received were missing and the rest were
filed as activations. `pipeline_receive_buffers` hands them to the tracker before the step and
`step_mem_tracker` keeps them in their own category ("Other", reported under temp, as the plan counts them,
`plan.memory.PIPELINE_RECV_BUFFERS`) for the whole step.

Likewise FSDP2's flat all-gather buffer (one per unshard of a parameter group, freed after the copy into the
unsharded parameters): MemTracker files it as an activation when the unshard runs in a forward, so a peak that
falls in a forward (an interleaved pipeline's from 8 micro-batches on) showed a whole group's gathered weights,
the embedding's 1,002 MiB at Llama-3-8B width, as activations. `fsdp_gathers_as_temp` re-files each such buffer
under "Other" (temp, where the plan counts gathered weights) as soon as the all-gather is issued.

And every storage of a tensor subclass: torch's MemTracker stops at the first storage of a tensor it already
knows, and torchao's Float8TrainingTensor out of an all-gather, a wait or a view is a new `_data` beside its
input's `_scale`, listed in a set ordered by address; fp8 under sequence parallelism missed some of its gathered
inputs, differently from run to run. `StepMemTracker._track` counts each.

Must not see: DTensor's sharding propagation under fake tensors.

For every DTensor op (and inside the vocabulary-parallel loss's handlers) torch computes the output's global
shape by running the op once on tensors of the *global* shape (`ShardingPropagator._propagate_tensor_meta`).
On a real run it does so in a FakeTensorMode of its own: nothing is allocated, and a memory tracker on the
device never sees them. Under the rehearsal's FakeTensorMode it reuses that mode, so the global-shape
tensors are made on the rehearsed device and MemTracker counts them live for the op's duration: at TP 8 the
loss's peak then held two fp32 logits of the whole vocabulary (the rehearsal's temp did not shrink with TP).
`unseen_sharding_propagation` runs the propagation with the rehearsal's other dispatch modes (MemTracker, the
probes) off the stack, as a real run does. Checked against real gloo runs in tests/test_rehearse_memory.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any
from unittest import mock

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import (
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
    _ModMemStats,
    _UpdateType,
    _WeakRefInfo,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from leantrain.golive.rehearse_probes import METADATA_OPS, metadata_answer


@contextmanager
def unseen_sharding_propagation() -> Iterator[None]:
    """Within it, DTensor's global-shape meta propagation is invisible to the dispatch modes (see module doc)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, op_schema: Any) -> Any:
        fake_mode = detect_fake_mode()
        if fake_mode is None:
            return original(self, op_schema)
        try:
            with _disable_current_modes(), fake_mode:  # the fake mode alone: no tracker, no probe sees it
                return original(self, op_schema)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return original(self, op_schema)  # the host-sync probe answers what fake tensors cannot

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate):
        yield


def pipeline_receive_buffers(stages: Iterable[Any], *, chunk: int | None = None) -> list[Any]:
    """The receive buffers torch's PipelineStages of this rank keep (`args_recv_info` for the inputs of a
    non-first chunk, `grad_recv_info` for the output gradients of a non-last one; root inputs have none), of
    every micro-batch or of micro-batch `chunk`."""
    buffers = []
    for stage in stages:
        for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            for index, infos in table.items():
                if chunk is not None and index != chunk:
                    continue
                for info in infos:
                    if getattr(info, "buffer", None) is not None and not getattr(info, "is_root_arg", False):
                        buffers.append(info.buffer)
    return buffers


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        return None


_NO_HOOK = _NoHook()


class StepMemTracker(MemTracker):
    """torch's MemTracker, for a loop: a root module called again (the next micro-batch, the next pipeline
    chunk) starts its per-module stats afresh instead of raising; the per-device peak is kept across calls; and
    a storage filed as "Other" (the pipeline's receive buffers handed to `track_external`, FSDP's all-gather
    buffers re-filed by `fsdp_gathers_as_temp`) keeps that category when an op writes into it (torch's tracker
    would re-file it as an activation or temp at each write).

    Its own bookkeeping runs inside `quiet()` (the rehearsal passes `Probes.paused`): listing a tensor's storages
    flattens tensor subclasses, and torchao's fp8 weight wrapper reads `bool(scale)` in its `__tensor_flatten__`,
    which the host-sync counter would otherwise file under the trainer's line (one "sync" per fp8 layer per step
    in DeepSeek-V3's rehearsal; the trainer itself never flattens them in an eager step).

    Only the device's peak is kept up to date after each op: torch's tracker also walks every module it has
    seen after every op to update per-module peaks, which the rehearsal never reads and which was a sixth of a
    405B rank's rehearsal time (the walk grows with the modules, ~90 per op there)."""

    def __init__(self, *, quiet: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        super().__init__()
        self.quiet = quiet
        self.on_peak: Callable[[], None] | None = None  # called when the peak moves (`MicroBatchSlope.saw_peak`)

    def _fresh_iteration(self, module: Any, name: str | None) -> None:
        """A root module called again outside backward (the next micro-batch or chunk): its stats start anew."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw and (
                set(self._mod_tracker.parents) - {name}) <= {"Global"}:
            del self.memory_tracking[module]

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        self._fresh_iteration(module, self._mod_tracker.get_known_fqn(module))
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
        """torch's, without gradient hooks on frozen parameters (a LoRA/QLoRA base, DPO's frozen reference),
        which have no gradient and refuse a hook: they are marked hooked with handles that remove nothing."""
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        """torch's, over every storage of `t`. torch's returns at the first storage it already knows, skipping the
        rest: a tensor subclass made of a new storage and a known one (torchao's Float8TrainingTensor out of an
        all-gather, a wait or a view: a new `_data` beside its input's `_scale`) had its new storage counted or
        not by the order of a set of storages, hashed by address, so from run to run (fp8 under sequence
        parallelism: up to ±0.2 GiB of activations at Llama-3-8B width)."""
        for st in get_untyped_storages(t):
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is None:
                self._new_winfo(st, t.device, reftype)
            elif winfo.size != st.size():
                old_mem_consumed = winfo.mem_consumed
                winfo.update_mem_consumed(st)
                self._update_snap(_UpdateType.SIZE, winfo, old_mem_consumed=old_mem_consumed)

    def _update_and_maybe_create_winfos(self, t: Any, reftype: Any, update_existing: bool = False) -> Any:
        """torch's, storage by storage, except that a storage filed as "Other" keeps that category (a buffer
        written by a recv or an all-gather: still a buffer)."""
        with self.quiet():
            winfos = set()
            for st in get_untyped_storages(t):
                winfo = self._WINFO.get(st, (None, None))[0]
                if winfo is None:
                    if update_existing:
                        raise KeyError("No existing winfo found")
                    winfo = self._new_winfo(st, t.device, reftype)
                elif winfo.reftype != reftype and winfo.reftype != _MemRefType.OTH:
                    old_reftype, winfo.reftype = winfo.reftype, reftype
                    self._update_snap(_UpdateType.REF, winfo, old_reftype=old_reftype)
                winfos.add(winfo)
            return winfos

    def _new_winfo(self, st: Any, device: torch.device, reftype: Any) -> Any:
        """A storage the tracker did not know: counted from now until its Python object dies."""
        winfo, w_st = _WeakRefInfo.create_winfo(st, device, reftype, self._delete_callback)
        self._WINFO[st] = (winfo, w_st)
        if winfo.mem_consumed > 0:
            self._update_snap(_UpdateType.ADD, winfo)
        return winfo

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)  # bytes by reference type: a flat dict of ints
                if self.on_peak is not None:
                    self.on_peak()


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE


class LeanStepMemTracker(StepMemTracker):
    """`StepMemTracker` without the work the rehearsal never reads (`step_mem_tracker`'s `lean`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in METADATA_OPS:  # a tensor's device or layout: no tensor made, nothing to track; the peak is
            # still read after it, as torch's does after every op (a hook may have added a gradient since)
            answer = metadata_answer(func, args, kwargs)
            if torch._C._get_dispatch_mode(_FAKE_KEY) is self._fake_mode_on_entry:
                self._update_peak_stats(None)
            return answer
        if DTensor in types:
            return NotImplemented  # DTensor lowers to local ops first, which this mode then sees
        fake_mode = torch._C._get_dispatch_mode(_FAKE_KEY)  # active_fake_mode(): fake modes are infra modes
        res = args[0] if func is _WAIT_TENSOR and fake_mode else func(*args, **(kwargs or {}))
        if fake_mode is self._fake_mode_on_entry:  # not DTensor's propagation in a fake mode of its own
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if not _track_outputs(self, reftype, res):
                tree_map_only(torch.Tensor, partial(self._track, reftype), res)
            self._update_peak_stats(None)
        return res

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: Any = None, old_reftype: Any = None) -> None:
        snap = self._curr_mem_snap.get(winfo.device)
        if snap is None or _TOTAL_KEY not in snap or u_type not in (_UpdateType.ADD, _UpdateType.DEL):
            return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        change = winfo.mem_consumed if u_type is _UpdateType.ADD else -winfo.mem_consumed
        snap[winfo.reftype] += change
        snap[_TOTAL_KEY] += change
        if u_type is _UpdateType.DEL and snap[_TOTAL_KEY] == 0:
            del self._curr_mem_snap[winfo.device]
        return None

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        tracker = self._mod_tracker
        name = tracker.get_known_fqn(module)
        self._fresh_iteration(module, name)
        if module not in self.memory_tracking:
            stats = _ModMemStats(name)
            stats.parameter_mem, stats.buffer_mem = self._track_module_params_and_buffers(
                module, install_grad_hooks=True)
            stats.input_mem = self._track_inputs_or_outputs(inputs)
            self.memory_tracking[module] = stats
        elif tracker.is_bw:  # the module's forward again inside its backward: a recomputation
            if self._ac_mod is None:
                self._ac_mod = weakref.ref(module)
                self._in_ac = True
        else:
            stats = self.memory_tracking[module]
            stats.mod_fqn = name
            stats.input_mem = self._track_inputs_or_outputs(inputs)

    def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
        if self._mod_tracker.is_bw:
            if self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False
        else:
            self.memory_tracking[module].output_mem = self._track_inputs_or_outputs(outputs)

    def _pre_bw_hook(self, module: Any, args: Any) -> None:
        return None  # torch's takes a snapshot for the module's peak in backward, which is never read

    def _post_bw_hook(self, module: Any, args: Any) -> None:
        return None


def step_mem_tracker(*, quiet: Callable[[], AbstractContextManager[Any]] = nullcontext,
                     lean: bool = True) -> StepMemTracker:
    """The rehearsal's memory tracker (`StepMemTracker`). `lean` (the default) also drops the tracker's other
    per-op and per-module work that the rehearsal never reads, with the same counts
    (tests/scale/test_rehearse_dispatch.py compares both on rehearsed jobs): a device read is answered without
    passing it down (the peak is still read after it), an op's outputs are walked directly instead of by a
    pytree map, the fake mode is read from its dispatch slot instead of by a walk of the mode stack, adding and
    freeing a storage update the device's totals without rebuilding its default entry, and the module hooks keep
    the per-module bookkeeping the categories depend on (parameters, inputs and outputs tracked, the
    recomputation flag) but take no per-module snapshots (three copies of the device's totals per module
    call)."""
    return LeanStepMemTracker(quiet=quiet) if lean else StepMemTracker(quiet=quiet)


def _track_outputs(tracker: Any, reftype: Any, res: Any) -> bool:
    """`tracker._track` on every tensor of an op's result when it is a tensor, None, or a (nested) tuple or list
    of them: True; False for other results (left to a pytree map)."""
    if isinstance(res, torch.Tensor):
        tracker._track(reftype, res)
        return True
    if res is None or isinstance(res, (int, float, bool)):
        return True
    if type(res) in (tuple, list) or isinstance(res, tuple) and hasattr(res, "n_fields"):  # structseq too
        items = list(res)
        if all(isinstance(r, torch.Tensor) or r is None or isinstance(r, (int, float, bool)) for r in items):
            for r in items:
                if isinstance(r, torch.Tensor):
                    tracker._track(reftype, r)
            return True
    return False


@contextmanager
def fsdp_gathers_as_temp(tracker: Any) -> Iterator[None]:
    """Within it, FSDP2's flat all-gather output is filed by `tracker` as "Other" (temp) from its all-gather on
    (module docstring; `step_mem_tracker` keeps it there while the collective and the copy-out touch it), and so
    are the unsharded parameters a forward's copy-out fills.

    MemTracker files a module's parameters as such in the module's forward pre-hook, which runs before FSDP's own
    (global hooks first): a block's Linears see their unsharded weights there, but a unit whose parameters are its
    own, not a submodule's (an MoE layer's experts, with their own `fully_shard` over dp_mod_ep), shows only its
    shards, and the copy-out that follows, inside the MoE layer's forward, was filed as activations: DeepSeek-V3's
    4 local experts, 336 MiB of bf16 weights per MoE layer kept gathered to the backward at ZeRO-1, where the plan
    counts gathered weights as temp (activations 0.78 of the rehearsal's with 3 MoE layers, 2026-12-07). Filed
    before the copy-out (its storages exist from the step before), so the category holds at a peak in the
    copy-out itself. A recompute's copy-out (in a backward) is left to the tracker."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    original = _fsdp_param_group.foreach_all_gather
    wait_for_unshard = _fsdp_param_group.FSDPParamGroup.wait_for_unshard

    def foreach_all_gather(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        output = getattr(result, "all_gather_output", None)  # torch types the result as optional
        if output is not None:
            tracker._update_and_maybe_create_winfos(output, _MemRefType.OTH)
        return result

    def unsharded_as_temp(group: Any) -> None:
        if group._all_gather_result and not tracker._mod_tracker.is_bw:  # a forward's unshard, about to be copied
            with tracker.quiet():
                for fsdp_param in group.fsdp_params:
                    for tensor in getattr(fsdp_param, "all_gather_outputs", ()):
                        tracker._update_and_maybe_create_winfos(tensor, _MemRefType.OTH)
        wait_for_unshard(group)

    with mock.patch.object(_fsdp_param_group, "foreach_all_gather", foreach_all_gather), \
            mock.patch.object(_fsdp_param_group.FSDPParamGroup, "wait_for_unshard", unsharded_as_temp):
        yield
