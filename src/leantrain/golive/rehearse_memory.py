"""What `leantrain rehearse`'s memory count must not see: DTensor's sharding propagation under fake tensors.

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

from collections.abc import Iterator
from contextlib import contextmanager
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
