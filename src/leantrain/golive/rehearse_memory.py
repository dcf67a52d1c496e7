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

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any
from unittest import mock


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


def pipeline_receive_buffers(stages: Iterable[Any]) -> list[Any]:
    """The receive buffers torch's PipelineStages of this rank keep (`args_recv_info` for the inputs of a
    non-first chunk, `grad_recv_info` for the output gradients of a non-last one; root inputs have none)."""
    buffers = []
    for stage in stages:
        for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            for infos in table.values():
                for info in infos:
                    if getattr(info, "buffer", None) is not None and not getattr(info, "is_root_arg", False):
                        buffers.append(info.buffer)
    return buffers


def step_mem_tracker(*, quiet: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Any:
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
    from copy import deepcopy

    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            if module in self.memory_tracking and not self._mod_tracker.is_bw and (
                    set(self._mod_tracker.parents) - {name}) <= {"Global"}:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_and_maybe_create_winfos(self, t: Any, reftype: Any, update_existing: bool = False) -> Any:
            with quiet():
                kept = [winfo for st in get_untyped_storages(t)
                        if (winfo := self._WINFO.get(st, (None, None))[0]) is not None
                        and winfo.reftype == _MemRefType.OTH]
                if kept and reftype != _MemRefType.OTH:
                    return set(kept)  # a buffer written by a recv or an all-gather: still a buffer
                return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return StepMemTracker()


@contextmanager
def fsdp_gathers_as_temp(tracker: Any) -> Iterator[None]:
    """Within it, FSDP2's flat all-gather output is filed by `tracker` as "Other" (temp) from its all-gather on
    (module docstring; `step_mem_tracker` keeps it there while the collective and the copy-out touch it)."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    original = _fsdp_param_group.foreach_all_gather

    def foreach_all_gather(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        output = getattr(result, "all_gather_output", None)  # torch types the result as optional
        if output is not None:
            tracker._update_and_maybe_create_winfos(output, _MemRefType.OTH)
        return result

    with mock.patch.object(_fsdp_param_group, "foreach_all_gather", foreach_all_gather):
        yield
