"""Each dispatched op of a rehearsal at less host cost, with the same result: what `leantrain rehearse` swaps in
for speed besides the cache keys (`rehearse_cachekey`).

A rehearsed step is ~100,000 ops through FakeTensorMode (DeepSeek-V3's stage 2, 17 micro-batches: 99,000 ops
and 92,000 device reads a step), nearly all cache hits, and each passes the rehearsal's dispatch modes (the
probes, the memory tracker) before it. Two costs per op are not the fake tensors' work:

- `fast_cache_outputs`: a cache hit's output is a new FakeTensor made from the cached metadata. torch builds it
  through `FakeTensor.__new__`, which validates its arguments and sets five memo descriptors (15 attribute
  writes through Python descriptors), then `__init__`; together a quarter of a rehearsed step. Here the same
  tensor is made from the same meta tensor by `Tensor._make_subclass` with the same flags, and its instance
  attributes are copied from a tensor torch built for the same mode and device (the meta tensor is made with
  Python dispatch off, as torch makes it inside `in_kernel_invocation_manager`, without that manager's mode
  flags, which only the fake mode's own kernels read). It serves only what it can
  answer exactly: a strided output of a mode without a shape environment (static shapes), not conjugated or
  negated, no debug trace; anything else is torch's own code. Before it swaps, `fast_cache_outputs` builds
  sample outputs (a new tensor, a view, requires-grad, an integer dtype) both ways and compares everything a
  tensor carries (metadata, storage, dispatch keys, instance attributes), and keeps torch's builder when they
  differ; the tests compare both on every cache hit of rehearsed jobs (tests/scale/test_rehearse_dispatch.py).
- `unwrapped_dispatch`: torch wraps every dispatch mode's `__torch_dispatch__` in `torch._disable_dynamo`, so
  that TorchDynamo never traces into a mode; the wrapper saves and sets the interpreter's frame-evaluation
  callback on each call, 3.5 calls an op (the modes, and the wrappers calling each other). A rehearsal never
  compiles (`training.compile` is off, fake tensors cannot be compiled here), so while it runs the modes' own
  functions are called directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch._subclasses import fake_tensor as _fake

_TORCH_OUTPUT = _fake.FakeTensorMode._get_output_tensor_from_cache_entry
_STRIDED = torch.strided


def _template(mode: Any, device: torch.device, cache: dict[tuple[int, torch.device], dict[str, Any]]) -> dict[str, Any]:
    """The instance attributes torch's constructor gives a FakeTensor of `mode` on `device` (made once)."""
    key = (id(mode), device)
    attributes = cache.get(key)
    if attributes is None:
        with _fake.in_kernel_invocation_manager(mode):
            elem = torch.empty(0, device="meta")
        attributes = dict(vars(_fake.FakeTensor(mode, elem, device)))
        attributes.pop("_fake_device", None)
        cache[key] = attributes
    return attributes


def _fast_output() -> Any:
    fake_type = _fake.FakeTensor
    make = torch.Tensor._make_subclass
    throw_on_mutable = torch._C._set_throw_on_mutable_data_ptr
    warn_on_mutable = torch._C._set_warn_deprecated_on_mutable_data_ptr
    no_python_dispatch = torch._C._DisableTorchDispatch  # what torch's `in_kernel_invocation_manager` does for it
    templates: dict[tuple[int, torch.device], dict[str, Any]] = {}
    devices: dict[torch.device, torch.device] = {}

    def output(self: Any, state: Any, entry: Any, key: Any, func: Any, args: Any) -> Any:
        metadata = entry.metadata
        if (metadata is None or entry.inplace_idx is not None or self.shape_env is not None
                or metadata.layout is not _STRIDED or metadata.is_conj or metadata.is_neg
                or _fake.FakeTensorConfig.debug):
            return _TORCH_OUTPUT(self, state, entry, key, func, args)
        view = isinstance(func, torch._ops.OpOverload) and func.is_view
        storage = args[entry.view_idx].untyped_storage() if view else None
        with no_python_dispatch():  # a plain meta tensor, which no mode or subclass may turn into a fake one
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, layout=_STRIDED,
                                        device="meta", requires_grad=metadata.requires_grad)
            if storage is not None:
                empty.set_(storage, metadata.storage_offset, metadata.shape, metadata.stride)
        device = devices.get(metadata.device)
        if device is None:
            device = devices[metadata.device] = fake_type._normalize_fake_device(torch.device(metadata.device))
        tensor = make(fake_type, empty, empty.requires_grad, dispatch_device=True, device_for_backend_keys=device)
        (warn_on_mutable if self._allow_unsafe_data_ptr_access else throw_on_mutable)(tensor)
        tensor.__dict__.update(templates.get((id(self), device)) or _template(self, device, templates))
        tensor._fake_device = device
        return tensor

    return output


def _described(tensor: Any) -> tuple[object, ...]:
    """Everything a fake tensor carries that a later op or tracker can read."""
    attributes = {k: v for k, v in vars(tensor).items() if k != "fake_mode"}
    return (type(tensor), tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.layout,
            tensor.requires_grad, tensor.storage_offset(), tensor.untyped_storage().nbytes(),
            tensor.is_contiguous(), str(torch._C._dispatch_keys(tensor)), tensor.fake_mode is not None,
            sorted(attributes.items(), key=lambda kv: kv[0]), tensor.untyped_storage()._cdata)


def same_outputs(output: Any) -> bool:
    """Whether `output` builds torch's cache-hit outputs on sample ops (new tensors, views, requires-grad,
    integer and bf16 dtypes): each op is run once to fill the cache, then its hit built by both builders."""
    mode = _fake.FakeTensorMode()
    aten = torch.ops.aten
    with mode:
        base = torch.empty(4, 6, dtype=torch.bfloat16)
        grad = torch.empty(3, 5, requires_grad=True)
        ids = torch.empty(7, dtype=torch.int64)
    samples = [(aten.add.Tensor, (base, base)), (aten.t.default, (base,)), (aten.view.default, (base, [24])),
               (aten.mul.Tensor, (grad, grad)), (aten.slice.Tensor, (base, 0, 1, 3)), (aten.neg.default, (ids,))]
    for func, args in samples:
        with mode:
            func(*args)  # a cache entry for it
        state = _fake._CacheKeyState(mode.shape_env)
        key = mode._cache_key(state, func, args, {})
        entry = _fake.FakeTensorMode.cache.get(key)
        if not isinstance(entry, _fake._DispatchCacheValidEntry) or entry.is_output_tuple:
            return False
        info = entry.output_infos[0]
        theirs = _TORCH_OUTPUT(mode, state, info, key, func, args)
        ours = output(mode, state, info, key, func, args)
        if _described(ours)[:-1] != _described(theirs)[:-1]:
            return False
        if func.is_view and _described(ours)[-1] != _described(theirs)[-1]:  # a view shares its input's storage
            return False
    return True


@contextmanager
def fast_cache_outputs() -> Iterator[bool]:
    """FakeTensorMode's cache hits build their outputs with `_fast_output` while inside (yields whether it
    swapped: False when the samples show this torch builds them differently, and torch's own builder stays)."""
    output = _fast_output()
    if not same_outputs(output):
        yield False
        return
    with mock.patch.object(_fake.FakeTensorMode, "_get_output_tensor_from_cache_entry", output):
        yield True


def cache_hits(mode: Any) -> Any:
    """`HostSyncCounter.from_cache` for `mode`: an op's output when FakeTensorMode's cache holds it, built in
    the probes' dispatch mode instead of one level down in the fake mode's (`MISS` otherwise, and the op goes on
    down as before). The fake mode's own dispatch of a cache hit does exactly this and nothing more: the key,
    the lookup, the output from the entry, the hit counted; its other answers (device reads, attribute queries,
    misses, bypasses, a cross-check) stay with it."""
    from leantrain.golive.rehearse_probes import MISS

    cache = _fake.FakeTensorMode.cache
    own = frozenset(_fake._DISPATCH_META_HANDLERS) | frozenset(_fake._DISPATCH_HANDLE_DIRECTLY)
    valid = _fake._DispatchCacheValidEntry
    bypass = _fake._BypassDispatchCache
    key_state = _fake._CacheKeyState

    def hit(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if func in own or not mode.cache_enabled or mode.cache_crosscheck_enabled or mode.shape_env is not None:
            return MISS
        state = key_state(None)
        try:
            key = mode._cache_key(state, func, args, kwargs)
        except bypass:
            return MISS
        entry = cache.get(key)
        if type(entry) is not valid:
            return MISS
        output = mode._output_from_cache_entry(state, entry, key, func, args)
        _fake.FakeTensorMode.cache_hits += 1
        return output

    return hit


@contextmanager
def unwrapped_dispatch(*modes: type) -> Iterator[None]:
    """While inside, each of these dispatch-mode classes dispatches through its own `__torch_dispatch__`, without
    the `torch._disable_dynamo` wrapper torch put around it (see the module docstring); restored on exit."""
    with contextlib.ExitStack() as stack:
        for cls in modes:
            wrapped = cls.__dict__.get("__torch_dispatch__")
            raw = getattr(wrapped, "__wrapped__", None)
            if raw is not None and callable(raw):
                stack.enter_context(mock.patch.object(cls, "__torch_dispatch__", raw))
        yield
