"""What one more micro-batch adds to a 1F1B step, measured inside the rehearsed step: how `leantrain rehearse`
extends a step of many micro-batches from one short rehearsal (golive/rehearse_depth.py does the arithmetic).

Past its warm-up a 1F1B stage repeats one period per micro-batch: a backward, the fused send of its input
gradient and receive of the next input, a forward (and the loss on the last stage), the fused send of its output
and receive of the next output gradient. A step of m + 1 micro-batches is the step of m with one more period, so
the collectives and host syncs one more micro-batch adds are those of one period, counted from the start of one
steady backward to the start of the next (the last such pair of the step, so the first backward, which may do
once-per-step work, is never the one measured: the rehearsal runs pp + 2 micro-batches so that even the first
stage has two).

A micro-batch's memory is held where the step keeps one of something per micro-batch, each measured as the
tracked memory it adds:
- torch's PipelineStage keeps one receive buffer per micro-batch and direction (made in step 1, live through
  every step): the bytes of one micro-batch's buffers;
- the trainer builds the step's micro-batches one loop iteration each (`sampler.next_batch` and what the loop
  makes of it): the tracked memory between the starts of two consecutive iterations;
- under a pipeline the micro-batches are concatenated into the whole step's batch (`_whole_batch`): its memory
  over the micro-batch count;
- what a period leaves behind (a micro-batch's loss on the last stage, its expert counts): the tracked memory
  between the starts of the measured period's two backwards, when the step's peak is at or after that period
  (an earlier peak is not raised by a later period).
`tests/scale/test_scale_pins.py` checks the extension against whole rehearsals of many micro-batches, and
against the difference of two rehearsals one micro-batch apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from leantrain.errors import LeantrainError
from leantrain.golive.rehearse_probes import Probes, StepLog

ACTIVATION, TOTAL = "Activation", "Total"  # MemTracker's snapshot keys (its reference types are str enums)


@dataclass
class _Mark:
    kind: str  # "F" or "B": a forward or backward of one micro-batch starts
    log: StepLog  # the step's collectives and host syncs so far
    memory: dict[str, int]  # the tracker's current memory so far


@dataclass
class MicroBatchSlope:
    """Watches the steady step (`watch`) and gives what one more micro-batch adds (`memory`, `log`)."""

    probes: Probes
    tracker: Any  # the rehearsal's MemTracker
    device: Any
    marks: list[_Mark] = field(default_factory=list)
    iterations: list[dict[str, int]] = field(default_factory=list)
    whole_batch: dict[str, int] = field(default_factory=dict)
    microbatches: int = 0
    buffers_bytes: int = 0
    peak_mark: int = -1  # marks made before the step's latest peak

    def _memory(self) -> dict[str, int]:
        snap = self.tracker._curr_mem_snap.get(self.device, {})
        return {ACTIVATION: int(snap.get(ACTIVATION, 0)), TOTAL: int(snap.get(TOTAL, 0))}

    def _mark(self, kind: str) -> None:
        self.marks.append(_Mark(kind, self.probes.current.copy(), self._memory()))

    def saw_peak(self) -> None:
        """The tracker's peak just moved (its `_update_peak_stats` calls this)."""
        self.peak_mark = len(self.marks)

    @contextmanager
    def watch(self, trainer: Any) -> Iterator[None]:
        """While the steady step runs: its micro-batch loop, its whole batch and every stage's forward and
        backward starts are marked (instance attributes over the methods, removed on exit)."""
        from leantrain.golive.rehearse_memory import pipeline_receive_buffers

        parallel = trainer.parallel
        patched: list[tuple[Any, str]] = []

        def patch(owner: Any, name: str, wrapper: Any) -> None:
            setattr(owner, name, wrapper)
            patched.append((owner, name))

        next_batch = trainer.sampler.next_batch

        def counted_next_batch(*args: Any, **kwargs: Any) -> Any:
            self.iterations.append(self._memory())
            return next_batch(*args, **kwargs)

        whole = parallel._whole_batch

        def measured_whole_batch(micro_batches: Any) -> Any:
            before = self._memory()
            result = whole(micro_batches)
            after = self._memory()
            self.whole_batch = {k: after[k] - before[k] for k in after}
            self.microbatches = len(micro_batches)
            return result

        patch(trainer.sampler, "next_batch", counted_next_batch)
        patch(parallel, "_whole_batch", measured_whole_batch)
        for stage in parallel.stages:
            for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
                patch(stage, name, self._marking(kind, getattr(stage, name)))
        one = pipeline_receive_buffers(parallel.stages, chunk=0)
        self.buffers_bytes = sum(b.untyped_storage().nbytes() for b in one)
        try:
            yield
        finally:
            for owner, name in patched:
                delattr(owner, name)

    def _marking(self, kind: str, method: Any) -> Any:
        def marked(*args: Any, **kwargs: Any) -> Any:
            self._mark(kind)
            return method(*args, **kwargs)

        return marked

    def _period(self) -> tuple[int, int]:
        """Mark indices of the last steady period: a backward, a forward, the next backward."""
        kinds = [m.kind for m in self.marks]
        for i in range(len(kinds) - 3, -1, -1):
            if kinds[i:i + 3] == ["B", "F", "B"]:
                return i, i + 2
        raise MicroBatchSlopeError(
            f"the step has no steady 1F1B period (forward/backward starts: {''.join(kinds)})")

    def log(self) -> StepLog:
        """The collectives and host syncs of one more micro-batch."""
        start, end = self._period()
        return self.marks[end].log.minus(self.marks[start].log)

    def memory(self) -> dict[str, int]:
        """What one more micro-batch adds to the step's peak, by MemTracker's keys (activations, total)."""
        if len(self.iterations) < 3 or not self.microbatches:
            raise MicroBatchSlopeError("the step's micro-batch loop was not seen")
        start, end = self._period()
        iteration = {k: self.iterations[-1][k] - self.iterations[-2][k] for k in (ACTIVATION, TOTAL)}
        period = ({k: self.marks[end].memory[k] - self.marks[start].memory[k] for k in (ACTIVATION, TOTAL)}
                  if self.peak_mark >= start else {ACTIVATION: 0, TOTAL: 0})
        slope = {k: iteration[k] + self.whole_batch.get(k, 0) / self.microbatches + period[k]
                 for k in (ACTIVATION, TOTAL)}
        slope[TOTAL] += self.buffers_bytes
        return slope


class MicroBatchSlopeError(LeantrainError):
    """The rehearsed step did not show what one more micro-batch adds (exit 2, naming what was missing)."""

    exit_code = 2

