"""What `leantrain rehearse` watches while the trainer runs under a fake process group and fake tensors.

- `HostSyncCounter`: a dispatch mode that sees every op the trainer issues on device tensors (fake tensors
  stand for them) and counts the ones that block the host on CUDA: `aten._local_scalar_dense` (what
  `.item()`, `bool()`, `float()`, `int()` and `.tolist()` call), `nonzero`, boolean-mask indexing,
  `masked_select`, `bincount`, `unique`, `repeat_interleave` without an output size. Their values do not exist
  under fake tensors, so it answers them itself, with the healthy run's answer: True for a flag (finite, not
  empty), 1 for a number, every element selected by a mask. Each is recorded with its site, the innermost
  leantrain frame (`leantrain/train/trainer.py:224 _local_scalar_dense`).
- `CollectiveRecorder`: handed every op the counter's mode sees, it records the c10d and functional-collective
  ops (FSDP2's
  all-gathers and reduce-scatters, TP's DTensor redistributions, pipeline send/recv, expert all-to-alls, the
  checkpoint manager's agreements, object collectives) and records each as (op, group, bytes): the group is
  the mesh axis it runs on (`dp_shard`, `tp`, `pp`, `ep`, ...) or, off the device mesh, `world` / `control`
  (control-plane calls); bytes are what this rank hands the call (its input tensors). torch's
  `CommDebugMode` counts ops but not their groups or sizes, which is what tells O(layers) from O(world).
  It is no dispatch mode of its own: each mode stacked over fake tensors re-dispatches every op once more
  through Python (~8 % of a 405B rank's rehearsal each), so the one mode does both.
- `FileReads`: files this process opens (Python's `open` audit event, which `open()`, `os.open()`,
  `np.memmap` and `np.load` raise) and bytes it reads (`rchar` in /proc/self/io), outside the Python install.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS as _fake_handlers
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

aten = torch.ops.aten
# c10d and functional-collective op names → one name per collective in rehearsal.json
OP_NAMES = {
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "allreduce_": "all_reduce", "all_reduce": "all_reduce",
    "allreduce_coalesced_": "all_reduce", "all_reduce_coalesced": "all_reduce", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "broadcast_": "broadcast",
    "broadcast": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv", "gather_": "gather",
    "scatter_": "scatter", "reduce_": "reduce",
}
# A tensor's metadata read through the dispatcher (C++ asking a Python tensor its device: the autograd engine, FSDP,
# DTensor; 60 % of the ops a rehearsed step dispatches): never a sync, no collective, passed straight on.
METADATA_OPS = {torch.ops.prim.device.default, torch.ops.prim.layout.default}
_DEVICE_HANDLERS = {torch.ops.prim.device.default: _fake_handlers.get(torch.ops.prim.device.default)}
VIEW_OPS = {aten.select.int, aten.slice.Tensor, aten.alias.default, aten.view.default, aten.unbind.int}
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # src/leantrain
SYNC_OPS = {
    aten._local_scalar_dense.default: "_local_scalar_dense",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",
}


# Collectives issued from these parts of leantrain (or from torch itself: FSDP, DTensor, pipelining) move the
# model's tensors: the data plane. The rest (checkpoint agreement, metrics, run bookkeeping) is the control plane.
# The loss (train/step_metrics.py's SourceLoss) is part of the step's math: under loss parallelism its
# vocabulary-split cross-entropy reduces over the TP ranks. So are fp8's weight scales (train/precision.py
# after each optimizer step: torchao's precompute_float8_dynamic_scale_for_fsdp, one all-reduce of the amaxes
# over the FSDP ranks, as torchtitan does).
DATA_PLANE_SITES = ("leantrain/parallel/", "leantrain/model/", "leantrain/train/step_metrics.py",
                    "leantrain/train/precision.py", "torch")


def is_control_site(site: str) -> bool:
    return not site.startswith(DATA_PLANE_SITES)


def call_site() -> str:
    """`leantrain/pkg/module.py:LINE` of the innermost frame in leantrain outside the rehearsal's own modules
    (golive/rehearse*.py; "torch" if none).

    Walks the interpreter's frames directly (no source lines are read: `traceback.extract_stack` would cost
    milliseconds per collective)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_ROOT_PREFIX) and not filename.startswith(_REHEARSAL_PREFIX):
            return f"leantrain/{filename[len(_ROOT_PREFIX):]}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "torch"


_ROOT_PREFIX = str(PACKAGE_ROOT) + os.sep
_REHEARSAL_PREFIX = str(Path(__file__).resolve().parent / "rehearse")


@dataclass
class StepLog:
    """What one step (or the startup) did: host syncs by site, collectives by (op, group)."""

    syncs: Counter[str] = field(default_factory=Counter)  # "site op" → count
    # (op, group, control plane?) → [count, bytes]
    collectives: dict[tuple[str, str, bool], list[int]] = field(default_factory=dict)

    def plus(self, other: StepLog) -> StepLog:
        """Both logs' calls together (a step and its logging call)."""
        total = StepLog(syncs=self.syncs + other.syncs)
        for log in (self, other):
            for key, (count, num_bytes) in log.collectives.items():
                entry = total.collectives.setdefault(key, [0, 0])
                entry[0] += count
                entry[1] += num_bytes
        return total

    def copy(self) -> StepLog:
        return StepLog(syncs=Counter(self.syncs), collectives={k: list(v) for k, v in self.collectives.items()})

    def minus(self, earlier: StepLog) -> StepLog:
        """What was recorded since `earlier` (a copy of this log made before)."""
        calls = {key: [count - earlier.collectives.get(key, [0, 0])[0], num_bytes - earlier.collectives.get(
            key, [0, 0])[1]] for key, (count, num_bytes) in self.collectives.items()}
        return StepLog(syncs=self.syncs - earlier.syncs, collectives={k: v for k, v in calls.items() if v[0]})

    def add_collective(self, op: str, group: str, num_bytes: int, *, control: bool = True) -> None:
        entry = self.collectives.setdefault((op, group, control), [0, 0])
        entry[0] += 1
        entry[1] += num_bytes


class Probes:
    """The log of the current phase; `new_phase` starts the next one (the trainer's step boundaries)."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, StepLog]] = [("startup", StepLog())]
        self.counting = True  # off while the rehearsal's own bookkeeping (save planning) runs
        self._redirect: StepLog | None = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        was, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = was

    @property
    def current(self) -> StepLog:
        return self._redirect if self._redirect is not None else self.phases[-1][1]

    @contextmanager
    def into(self, log: StepLog) -> Iterator[None]:
        """Record into `log` for a while (the checkpoint manager's calls inside a training step)."""
        saved, self._redirect = self._redirect, log
        try:
            yield
        finally:
            self._redirect = saved

    def new_phase(self, name: str) -> None:
        self.phases.append((name, StepLog()))

    def new_log(self, name: str) -> StepLog:
        """A log for calls recorded apart from the phases (`into`), found by `phase(name)`."""
        self.phases.insert(0, (name, StepLog()))
        return self.phases[0][1]

    def phase(self, name: str) -> StepLog:
        return next(log for label, log in self.phases if label == name)


class HostSyncCounter(TorchDispatchMode):
    """Counts (and answers) the ops that would block the host on a device tensor. See the module docstring."""

    def __init__(self, probes: Probes, *, collectives: CollectiveRecorder | None = None) -> None:
        super().__init__()
        self.probes = probes
        self.collectives = collectives
        self._last_site: str | None = None
        self._kinds: dict[Any, object] = {}  # op → what it is to this mode (`_op_kind`), learnt at its first call
        # FakeTensorMode's cache read from here (`rehearse_dispatch.cache_hits`): an op's output, or MISS
        self.from_cache: Callable[[Any, Any, dict[str, Any]], Any] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _op_kind(func)
        if kind is _METADATA:
            return metadata_answer(func, args, kwargs)
        kwargs = kwargs or {}
        if DTensor in types:
            return NotImplemented  # let DTensor lower to its local ops, which this mode then sees
        if kind is _COLLECTIVE and self.collectives is not None:
            self.collectives.see(func, args, kwargs)
        if _host_only(args, kwargs):
            # Host data (the mesh's rank tables, torch.tensor(<Python numbers>), the sampler's batches): its
            # values are known, so the op runs for real and nothing it reads is a device sync.
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        name = SYNC_OPS.get(func)
        if kind is not _VIEW and name is None:
            self._last_site = None
        if name is None and func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            name = "boolean-mask index"
        if name is None:
            if self.from_cache is not None:
                out = self.from_cache(func, args, kwargs)
                if out is not MISS:
                    return out
            return func(*args, **kwargs)
        if not self.probes.counting:
            return _answer_or_run(func, args, kwargs)
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        try:  # a value the host knows already (a tensor built from Python numbers) is no device sync
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            pass
        self.count(name)
        return _healthy_answer(func, args, kwargs)

    def count(self, name: str) -> None:
        """One host sync of kind `name` at the trainer's current line (reads of one tensor element by element
        on one line are one transfer, one sync)."""
        site = f"{call_site()} {name}"
        if site != self._last_site:
            self.probes.current.syncs[site] += 1
        self._last_site = site


def _answer_or_run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return func(*args, **kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException):
        return _healthy_answer(func, args, kwargs)


_METADATA, _COLLECTIVE, _VIEW, _OTHER = object(), object(), object(), object()
MISS = object()  # `HostSyncCounter.from_cache`'s answer when the op is not a cache hit


def is_collective(func: Any) -> bool:
    """A c10d or functional collective (or point-to-point op) that moves data; not a wait or a barrier."""
    return func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and not func.__name__.startswith(
        ("wait", "barrier", "monitored_barrier"))


def _op_kind(func: Any) -> object:
    if func in METADATA_OPS:
        return _METADATA
    if is_collective(func):
        return _COLLECTIVE
    return _VIEW if func in VIEW_OPS else _OTHER


def metadata_answer(func: Any, args: Any, kwargs: Any) -> Any:
    """A tensor's device or layout: what FakeTensorMode answers for a fake tensor (its handler, called here
    instead of passing the read through the modes below), else the op itself."""
    handler = _DEVICE_HANDLERS.get(func)
    if handler is not None and len(args) == 1 and type(args[0]) is FakeTensor:
        return handler(args)
    return func(*args, **(kwargs or {}))


def _host_only(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the op's arguments hold at least one tensor and no fake tensor (nested lists and tuples too)."""
    found = False
    for group in (args, kwargs.values()):
        seen = _scan(group)
        if seen is None:
            return False
        found = found or seen
    return found


def _scan(args: Any) -> bool | None:
    """None when `args` hold a fake tensor, else whether they hold a tensor."""
    found = False
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if isinstance(arg, FakeTensor):
                return None
            found = True
        elif isinstance(arg, (list, tuple)):
            seen = _scan(arg)
            if seen is None:
                return None
            found = found or seen
    return found


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from _tensors(arg)


def _healthy_answer(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A stand-in for a value fake tensors do not have: what a healthy run would read."""
    tensor = args[0]
    if func is aten._local_scalar_dense.default:
        if tensor.dtype == torch.bool:
            return True
        return 1.0 if tensor.dtype.is_floating_point else 1
    if func is aten.nonzero.default:  # every element non-zero
        return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)
    if func is aten.masked_select.default:
        mask = args[1]
        return torch.empty(torch.broadcast_shapes(tensor.shape, mask.shape).numel(), dtype=tensor.dtype,
                           device=tensor.device)
    if func is aten.bincount.default:
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        minlength = int(args[2] if len(args) > 2 else kwargs.get("minlength", 0))
        dtype = weights.dtype if weights is not None else torch.long
        return torch.zeros(max(minlength, 1), dtype=dtype, device=tensor.device)
    if func is aten.index.Tensor:  # a leading boolean mask selecting everything
        indices = args[1]
        mask = indices[0]
        if mask is None or mask.dtype != torch.bool or any(i is not None for i in indices[1:]):
            raise NotImplementedError("boolean-mask indexing other than one leading mask")
        return tensor.reshape(-1, *tensor.shape[mask.dim():]).clone()
    if func is aten.repeat_interleave.Tensor:
        return torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    return tensor.reshape(-1).clone(), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)


class CollectiveRecorder:
    """Records every collective and point-to-point op it is shown (by `HostSyncCounter`'s dispatch mode) with its
    group and bytes. See the module docstring."""

    def __init__(self, probes: Probes, *, group_names: dict[str, str]) -> None:
        self.probes = probes
        self.group_names = group_names  # c10d group name → label (mesh axis, world, control)

    def see(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if is_collective(func):
            op = OP_NAMES.get(func._opname, func._opname.strip("_"))
            group = self._group_label([*args, *kwargs.values()])
            num_bytes = sum(t.numel() * t.element_size() for t in _input_tensors(func, args))
            self.probes.current.add_collective(op, group, num_bytes, control=is_control_site(call_site()))

    def _group_label(self, args: list[Any]) -> str:
        for arg in args:
            name = None
            if isinstance(arg, str) and arg in self.group_names:
                name = arg
            elif isinstance(arg, torch.ScriptObject):
                with contextlib.suppress(Exception):
                    name = dist.ProcessGroup.unbox(arg).group_name
            elif isinstance(arg, dist.ProcessGroup):
                name = arg.group_name
            if name is not None:
                return self.group_names.get(name, "control")
        return "control"


def _input_tensors(func: Any, args: Any) -> Iterator[torch.Tensor]:
    """The tensors this rank contributes: for in-place c10d ops with an output list first, the inputs after it."""
    name = func._opname
    if func.namespace == "c10d" and name in ("allgather_", "_allgather_base_", "reduce_scatter_",
                                              "_reduce_scatter_base_", "alltoall_", "alltoall_base_",
                                              "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"):
        yield from _tensors(args[1:2])
        return
    first = args[0] if args else None
    yield from _tensors([first])


def group_labels(mesh: Any) -> dict[str, str]:
    """c10d group name → label, for every axis and flattened view of the trainer's mesh and the default group."""
    labels: dict[str, str] = {}
    if mesh is not None:  # a group that is both a flattened view and a raw axis is named by the view (dp_shard)
        for name in [*mesh.flattened, *(mesh.world.mesh_dim_names or ())]:
            sub = mesh[name]
            if sub.ndim == 1:
                labels.setdefault(sub.get_group().group_name, name)
    if dist.is_initialized():
        world = dist.group.WORLD
        assert world is not None
        labels.setdefault(world.group_name, "world")
    return labels


# ----- files ---------------------------------------------------------------------------------------------
_IGNORED_ROOTS = tuple(
    str(Path(p).resolve()) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                     sysconfig.get_paths()["platlib"], sys.prefix, sys.base_prefix}
) + ("/proc", "/sys", "/dev", "/etc", "/usr")
_ACTIVE: list[FileReads] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _ACTIVE:
        return
    path, mode = args[0], args[1]
    if not isinstance(path, (str, bytes, os.PathLike)) or (isinstance(mode, str) and any(c in mode for c in "wax+")):
        return
    if isinstance(mode, int) and mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        return
    resolved = os.path.realpath(os.fsdecode(path))
    if resolved.startswith(_IGNORED_ROOTS) or resolved.endswith((".py", ".pyc", ".so")):
        return
    for reads in _ACTIVE:
        reads.opened[resolved] += 1


_HOOKED = False


@dataclass
class FileReads:
    """Files opened for reading (path → opens) and bytes read while `watch` was active."""

    opened: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0

    @contextmanager
    def watch(self) -> Iterator[FileReads]:
        global _HOOKED
        if not _HOOKED:  # audit hooks cannot be removed: one for the process, idle unless a watch is active
            sys.addaudithook(_audit)
            _HOOKED = True
        before = _rchar()
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)
            self.bytes_read += max(0, _rchar() - before)


def _rchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


CONTROL_WINDOW_STEPS = 100  # the checkpoint manager's per-step control plane is watched over this many steps


def control_window(trainer: Any) -> int:
    """The checkpoint manager's per-step work (agreement, interval, preemption checks) over
    `CONTROL_WINDOW_STEPS` further steps, as the loop calls it after each step; returns the window."""
    hook = trainer.checkpointer
    if hook is None:
        return CONTROL_WINDOW_STEPS
    first = trainer.step
    for step in range(first + 1, first + 1 + CONTROL_WINDOW_STEPS):
        trainer.step = step
        hook.maybe_save(trainer)
    return CONTROL_WINDOW_STEPS


def reference_parts(trainer: Any) -> list[Any]:
    """The modules of full DPO's frozen reference model (train/dpo.py: a copy of the init_from weights, sharded
    like the policy), held on the device beside the trained model; none for other jobs."""
    reference = getattr(getattr(trainer, "objective", None), "reference", None)
    return list(reference.parts) if reference is not None else []


def resident_bytes(trainer: Any) -> dict[str, int]:
    """This rank's parameters (and buffers; full DPO's frozen reference copy among them), gradients and
    optimizer states after a step, from the tensors."""
    def local_bytes(tensor: Any) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if is_traceable_wrapper_subclass(local):  # torchao's 8-bit optimizer states: uint8 codes + block scales,
            names, _ = local.__tensor_flatten__()  # which present themselves as the parameter's fp32
            return sum(local_bytes(getattr(local, name)) for name in names)
        return local.numel() * local.element_size()

    params = grads = 0
    for part in trainer.parallel.parts:
        params += sum(local_bytes(b) for b in part.buffers())
    for param in trainer.parallel.parameters():
        params += local_bytes(param)
        if param.grad is not None:
            grads += local_bytes(param.grad)
    for part in reference_parts(trainer):
        params += sum(local_bytes(t) for t in (*part.parameters(), *part.buffers()))
    optimizer = sum(local_bytes(v) for state in trainer.optimizer.state.values() for v in state.values()
                    if hasattr(v, "numel") and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": optimizer}
