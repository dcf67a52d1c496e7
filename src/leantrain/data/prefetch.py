"""A prefetching loader around a sampler: the next micro-batches are read (and pinned, on CUDA) on a background
thread while the device runs the current step, so `next_batch` is a queue pop instead of memory-mapped reads
on the critical path (torch's DataLoader does the same with `pin_memory=True` and a prefetch factor; torchtitan
feeds its loop through one).

One producer thread calls the wrapped sampler in order, so the sequence of batches is exactly the sampler's.
The state a checkpoint sees is the state after the last batch *handed out* (each queued batch carries the
sampler state that follows it), never the producer's read-ahead position: a resume continues at the first
batch the trainer did not take, bit for bit. `load_state_dict` stops the producer, drops what it read ahead,
moves the sampler; the next `next_batch` starts it again. Nothing is read before the first `next_batch`, so
building the trainer (and a rehearsal's startup) opens no shard.
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any

_POLL_S = 0.1  # how often a blocked producer looks at its stop flag


class PrefetchingSampler:
    """Wraps any sampler with `next_batch()`, `state_dict()` and `load_state_dict()`; other attributes pass through."""

    def __init__(self, sampler: Any, *, depth: int = 4, pin_memory: bool = False) -> None:
        self._sampler = sampler
        self._depth, self._pin = max(1, depth), pin_memory
        self._state = copy.deepcopy(sampler.state_dict())
        self._thread: threading.Thread | None = None  # started by the first next_batch (nothing read at startup)

    def __getattr__(self, name: str) -> Any:  # source_names, vocab_size, has_loss_mask, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._sampler, name)

    @property
    def global_sample_index(self) -> int:
        """The global sample index the next handed-out batch starts from (not the read-ahead position)."""
        return int(self._state["global_sample_index"])

    def next_batch(self) -> Any:
        if self._thread is None:
            self._start()
        batch, state, error = self._queue.get()
        if error is not None:
            self._queue.put((None, None, error))  # every later call fails the same way
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._halt()
        self._sampler.load_state_dict(state)
        self._state = copy.deepcopy(self._sampler.state_dict())

    def close(self) -> None:
        """Stop the producer thread (idempotent)."""
        self._halt()

    def _start(self) -> None:
        self._queue: queue.Queue[tuple[Any, Any, BaseException | None]] = queue.Queue(maxsize=self._depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True,
                                        name="leantrain-prefetch")
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                batch = self._sampler.next_batch()
                if self._pin:
                    batch = _pinned(batch)
                item: tuple[Any, Any, BaseException | None] = (batch, copy.deepcopy(self._sampler.state_dict()), None)
            except Exception as err:  # handed to the consumer, raised there
                item = (None, None, err)
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return


def _pinned(batch: Any) -> Any:
    """The batch's tensors in page-locked host memory (an asynchronous copy to the GPU needs it)."""
    fields = {name: value.pin_memory() if hasattr(value, "pin_memory") else value
              for name, value in vars(batch).items()}
    return type(batch)(**fields)
