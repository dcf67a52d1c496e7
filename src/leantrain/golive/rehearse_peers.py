"""The rehearsed rank's peers, answered without them: torch.distributed's object collectives.

A rehearsal runs one rank of a fake world; what its peers would send in an object collective is answered from
the rank itself (a gather: every rank's value equal to this one's) or from what the broadcast's source, rank
0, sent in its own rehearsal (`Broadcasts`). The ranks run side by side in worker processes (golive/rehearse.py): rank 0
publishes what it sends into a channel shared with the other workers while it runs (`Broadcasts.channel`, a
multiprocessing manager's dict), and a rank that needs one of its values waits for it there, or for rank 0 to
end (then nothing more will come, and the rank's own objects stand, as before). So the other ranks need not
wait for the whole of rank 0's rehearsal before they start: at the ranks' real start-up rank 0's values come
within its first seconds. The workers end with the rehearsal that started them (`die_with_parent`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from leantrain.golive.rehearse_probes import Probes

META = ("stage_meta", 0)  # the channel's key for the source's first pipeline-stage metadata
DONE = ("done", 0)  # set by the parent when the source's rehearsal has ended
POLL_S = 0.02  # lookups are few (start-up agreements, the first stage metadata): polling costs nothing


@dataclass
class Broadcasts:
    """What each broadcast's source sent, by (group, call number): the other ranks receive it at the same call
    (collectives are issued in the same order on every rank of a group)."""

    sent: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    # Pipeline stages' metadata (the activations' shapes and dtypes a stage sends its neighbour): every stage
    # boundary carries the same hidden states, so what any stage sent (rank 0's first, or this rank's own
    # latest) is what a neighbour would receive.
    stage_meta: list[Any] = field(default_factory=list)
    own_meta: list[Any] = field(default_factory=list)
    # Shared with the other workers (a manager's dict proxy) while the source runs: the source publishes into it,
    # the others wait on it (module docstring). None: this process's record only.
    channel: Any = None
    publishes: bool = False

    def new_rank(self) -> None:
        self.calls.clear()
        self.own_meta.clear()

    def record(self, key: tuple[str, int], objects: list[Any]) -> None:
        """This rank is the broadcast's source: keep what it sent (and publish it, when it is the channel's)."""
        self.sent[key] = objects
        if self.publishes and self.channel is not None:
            self.channel[key] = objects

    def lookup(self, key: tuple[str, int]) -> list[Any] | None:
        """What the source sent at `key`, waiting for it while the source still runs; None if it never did."""
        if key in self.sent:
            return self.sent[key]
        if self.channel is None or self.publishes:
            return None
        while True:
            done = DONE in self.channel
            value = self.channel.get(key)
            if value is not None or done:
                if value is not None:
                    self.sent[key] = value
                return value
            time.sleep(POLL_S)

    def add_meta(self, objects: list[Any]) -> None:
        self.own_meta.append(objects)
        if not self.stage_meta:
            self.stage_meta.append(objects)
            if self.publishes and self.channel is not None:
                self.channel[META] = objects

    def known_meta(self) -> Any | None:
        """The stage metadata a neighbour would send: this rank's own latest, else the source's first."""
        if self.own_meta or self.stage_meta:
            return (self.own_meta or self.stage_meta)[-1]
        value = self.lookup(META)
        if value is not None:
            self.stage_meta.append(value)
        return value


@contextmanager
def object_collectives(probes: Probes, broadcasts: Broadcasts) -> Iterator[None]:
    """torch.distributed's object collectives (pickled payloads in CPU tensors) answered without a real peer: each
    is recorded as a control-plane call on its group and returns what identical ranks would: every rank's value
    equal to this one's for a gather; for a broadcast, what the source sent when it was rehearsed (`Broadcasts`),
    else this rank's own objects."""
    from unittest import mock

    def label(group: Any) -> str:
        group = group if group is not None else dist.group.WORLD
        return getattr(group, "group_name", "control")

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        probes.current.add_collective("all_gather_object", label(group), len(pickle.dumps(obj)))
        out[:] = [obj] * len(out)

    def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                      group: Any = None, group_dst: int | None = None) -> None:
        probes.current.add_collective("gather_object", label(group), len(pickle.dumps(obj)))
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list)

    def broadcast_object_list(objects: list[Any], src: int | None = None, group: Any = None,
                              device: Any = None, group_src: int | None = None) -> None:
        name = label(group)
        probes.current.add_collective("broadcast_object_list", name, len(pickle.dumps(objects)))
        key = (name, broadcasts.calls[name])
        broadcasts.calls[name] += 1
        source = src if src is not None else dist.get_global_rank(group or dist.group.WORLD, group_src or 0)
        if dist.get_rank() == source:
            broadcasts.record(key, pickle.loads(pickle.dumps(objects)))
        elif (sent := broadcasts.lookup(key)) is not None:
            objects[:] = pickle.loads(pickle.dumps(sent))

    def send_object_list(objects: list[Any], dst: int | None = None, group: Any = None, device: Any = None,
                         group_dst: int | None = None, use_batch: bool = False) -> None:
        probes.current.add_collective("send_object_list", label(group), len(pickle.dumps(objects)))
        broadcasts.add_meta(pickle.loads(pickle.dumps(objects)))

    def recv_object_list(objects: list[Any], src: int | None = None, group: Any = None, device: Any = None,
                         group_src: int | None = None, use_batch: bool = False) -> None:
        known = broadcasts.known_meta()
        if known is not None:
            objects[:] = pickle.loads(pickle.dumps(known))
        probes.current.add_collective("recv_object_list", label(group), len(pickle.dumps(objects)))

    def barrier(group: Any = None, **kwargs: Any) -> None:
        probes.current.add_collective("barrier", label(group), 0)

    with mock.patch.multiple(dist, all_gather_object=all_gather_object, gather_object=gather_object,
                             broadcast_object_list=broadcast_object_list, barrier=barrier,
                             send_object_list=send_object_list, recv_object_list=recv_object_list):
        yield


def die_with_parent() -> None:
    """Worker initializer: the worker ends with the rehearsal that spawned it. Without it a SIGTERM to
    `leantrain rehearse` (a scheduler, `kill`) left its workers running as orphans, each minutes of CPU into a
    rank (seen 2026-12-03). Linux: prctl(PR_SET_PDEATHSIG, SIGTERM); elsewhere a no-op."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call above took effect
        os._exit(1)
