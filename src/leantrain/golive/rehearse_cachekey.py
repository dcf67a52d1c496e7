"""Fake-tensor cache keys at the cost of a few attribute reads: what `leantrain rehearse` swaps in for speed.

FakeTensorMode caches each op's output metadata under a key built from its arguments; a rehearsed step is
hundreds of thousands of cache hits, and building the key was a third of a rank's time (DeepSeek-V3's rank 0:
45 of 148 s CPU). torch builds the key of a tensor argument field by field: `extract_tensor_metadata` makes a
`TensorMetadata` (memory format by a stride walk, the sparse checks three times), then `_flatten_into` walks its
17 fields with `dataclasses.fields`, recursing into the shape and the strides element by element.

`fast_cache_keys()` builds the same key, element for element, with less work per tensor: the part of the key
that depends only on the shape and strides (their flattened form and the memory format) is computed by torch's
own code the first time a (shape, strides) pair is met and reused after; the other fields are read directly.
It serves only what it can answer exactly: strided fake tensors of this mode with static shapes and no
constant, in a mode without a shape environment (the rehearsal's). Anything else (symbolic shapes, sparse
layouts, real tensors, graph modules, ...) goes to torch's own code, which also raises its cache bypasses.

The equality is checked twice: `fast_cache_keys` compares both builders on sample tensors before it swaps and
keeps torch's own when they differ (a later torch may change the key), and the tests compare them on every key
of a rehearsed job (tests/scale/test_rehearse_cachekey.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch._subclasses import fake_tensor as _fake

_TORCH_PREP = _fake.FakeTensorMode._prep_args_for_hash
_STRIDED = torch.strided
_TAIL = (False, None, None, None)  # is_sparse, is_coalesced, dense_dim, sparse_dim of a strided tensor
_PLAIN = frozenset({int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format})
_MAX_LAYOUTS = 1 << 16  # (shape, strides) pairs kept; a rehearsal meets a few thousand


class _Layouts:
    """Per (shape, strides): that part of torch's key (the shape's and strides' flattened form, as a tuple) and
    the memory format torch records, both taken from torch's own builder the first time."""

    def __init__(self) -> None:
        self.known: dict[tuple[Any, Any], tuple[tuple[object, ...], object]] = {}

    def learn(self, mode: Any, tensor: Any, state: Any, shape: Any, stride: Any) -> list[object]:
        whole: list[object] = []
        _fake.extract_tensor_metadata(tensor)._flatten_into(whole, mode, state)
        sizes = 2 + 2 * len(shape) + 2 + 2 * len(stride)  # (Size, "length_n", int, d, ...) then the strides'
        if len(self.known) >= _MAX_LAYOUTS:
            self.known.clear()
        self.known[(shape, stride)] = (tuple(whole[1:1 + sizes]), whole[3 + sizes])
        return whole


def _fast_prep(layouts: _Layouts) -> Any:
    fake_type = _fake.FakeTensor

    def prep(self: Any, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]) -> None:
        if self.shape_env is not None:
            return _TORCH_PREP(self, result, args, state, id_hashed_objects)
        if isinstance(args, (list, tuple, dict)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        if isinstance(args, dict):
            prep(self, result, args.keys(), state, id_hashed_objects)
            prep(self, result, args.values(), state, id_hashed_objects)
            return None
        known = layouts.known
        for arg in args:
            kind = type(arg)
            if kind is fake_type and arg.fake_mode is self and arg.constant is None and arg.layout is _STRIDED \
                    and not arg._has_symbolic_sizes_strides:
                shape, stride = arg.shape, arg.stride()
                entry = known.get((shape, stride))
                if entry is None:
                    result.extend(layouts.learn(self, arg, state, shape, stride))
                    continue
                sizes, memory_format = entry
                result.append(arg.dtype)
                result.extend(sizes)
                result += (arg.device, _STRIDED, memory_format, arg.storage_offset(), arg.untyped_storage().nbytes(),
                           arg.requires_grad, arg.is_quantized, arg.is_conj(), arg.is_neg(), arg.is_inference())
                result.extend(_TAIL)
            elif kind in _PLAIN or arg is None:  # torch's last rule: the type, then the value
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                prep(self, result, arg, state, id_hashed_objects)
            else:  # torch's own rules (bypasses, SymInts, dicts, graph modules, ...), without its (tuple, 1) header
                start = len(result)
                _TORCH_PREP(self, result, (arg,), state, id_hashed_objects)
                del result[start:start + 2]
        return None

    return prep


def _samples(mode: Any) -> list[object]:
    """Arguments of the kinds a rehearsed step passes: views, transposes, offsets, channels-last, scalars."""
    with mode:
        base = torch.empty(4, 6, dtype=torch.bfloat16)
        grad = torch.empty(3, 5, requires_grad=True)
        image = torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
        return [base, base.t(), base[1:], base.view(24)[3:9], grad, image, torch.empty(()), torch.empty(0, 7),
                torch.empty(5, dtype=torch.int64), [base, 3, 2.5], (True, None, torch.float32), {"dim": -1},
                torch.device("cpu"), torch.contiguous_format]


def same_keys(prep: Any) -> bool:
    """Whether `prep` builds torch's key on the samples (twice each: first and cached layouts)."""
    mode = _fake.FakeTensorMode()
    args = _samples(mode)
    for _ in range(2):
        ours: list[object] = []
        theirs: list[object] = []
        state = _fake._CacheKeyState(mode.shape_env)
        prep(mode, ours, args, state, [])
        _TORCH_PREP(mode, theirs, args, state, [])
        if ours != theirs or [type(v) for v in ours] != [type(v) for v in theirs]:
            return False
    return True


@contextmanager
def fast_cache_keys() -> Iterator[bool]:
    """FakeTensorMode's cache keys built by `_fast_prep` while inside (yields whether it swapped: False when
    the samples show this torch builds its keys differently, and torch's own builder stays)."""
    prep = _fast_prep(_Layouts())
    if not same_keys(prep):
        yield False
        return
    with mock.patch.object(_fake.FakeTensorMode, "_prep_args_for_hash", prep):
        yield True
