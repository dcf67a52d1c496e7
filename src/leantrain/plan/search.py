"""Layout search: enumerate tp, pp, dp, ep, micro-batch, recompute and ZeRO level for a GPU count, drop
what does not fit (keeping the reason), rank the rest by predicted tokens/s, and say what would fit when
nothing does.

Candidates: only layouts the trainer runs, by the spec's own rules (spec/rules.py `shape_problems`,
`moe_problems`, `finetune_layout_problems`, `batch_divides`: what `leantrain check` says of the spec with that
layout written in). tp divides the GPUs per node (Megatron's rule: TP stays on NVLink), the query and KV heads and
the FFN; pp divides GPUs / tp and is at most the layer count (uneven stages allowed); interleaving v ∈ {1, 2, 4,
...} and the most the layers allow (pp·v ≤ layers); ep divides dp and the expert count; dp × micro-batch divides
the global batch's sequences, micro-batch 1, 2, 4, ... up to `plan.max_micro_batch`; LoRA/QLoRA without TP,
QLoRA and DPO without a pipeline (DPO without TP); ZeRO-2 and -3 (the trainer's FSDP2 shards gradients at ZeRO-1
too: the same layout as -2), HSDP (shards inside a node, replicas across nodes) for ZeRO-3 when dp spans nodes;
recompute none, then selective and op (torchtitan's op-level policy, where the trainer runs it: dense SwiGLU
blocks with full weights; the faster of the two that fit), then full, stopping at the first tier that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from leantrain.hardware import CATALOG, GiB
from leantrain.plan.flops import Recompute
from leantrain.plan.inputs import PlanInputs, sequences_per_step
from leantrain.plan.layout import Layout
from leantrain.plan.memory import MemoryBreakdown, memory_per_gpu
from leantrain.plan.timing import StepTime, step_time
from leantrain.spec.rules import (
    batch_divides,
    finetune_layout_problems,
    moe_problems,
    op_recompute_problem,
    shape_problems,
)
from leantrain.spec.schema import ParallelismSpec

SMALLER_MB_FAILED = "does not fit: a smaller micro-batch of the same layout did not fit"
STATES_FAILED = "does not fit: params+grads+optimizer largest (other chunkings of the same layout)"
BATCH_UNEVEN = ("the trainer refuses: dp does not divide the global batch's sequences (training.global_batch_tokens "
                "must be a multiple of micro_batch × seq_len × data_parallel)")


@dataclass(frozen=True)
class Candidate:
    """A layout with its memory and step time; `why` says what is good or bad about it."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime

    @property
    def why(self) -> str:
        t, mem = self.time, self.memory
        return (f"bubble {t.bubble_fraction:.0%}, comm {t.comm_fraction:.0%}, "
                f"headroom {mem.headroom / GiB:.1f} GiB of {mem.capacity / GiB:.0f} GiB")


@dataclass
class SearchResult:
    """Fitting layouts best first, how many were rejected and why, and what would fit otherwise."""

    num_gpus: int
    ranked: list[Candidate]
    num_evaluated: int
    rejected: dict[str, int] = field(default_factory=dict)
    smallest: Candidate | None = None  # the least memory-hungry layout (reported when nothing fits)
    suggestions: list[str] = field(default_factory=list)
    num_fitting: int = 0
    all_fitting: list[Candidate] = field(default_factory=list, repr=False)  # ranked, best first

    def rank_of(self, layout: Layout) -> int | None:
        """1-based rank of a layout among the fitting ones, whatever recompute policy its group settled on
        (None when it was not a candidate or does not fit). With dp > 1 ZeRO-0 and ZeRO-1 are ranked as ZeRO-2,
        the level the search lists for them (see `candidate_layouts`)."""
        zero = 2 if layout.zero in (0, 1) and layout.dp > 1 else layout.zero
        for i, cand in enumerate(self.all_fitting, start=1):
            if replace(layout, zero=zero, recompute=cand.layout.recompute) == cand.layout:
                return i
        return None

    def rank_by_throughput(self, candidate: Candidate) -> int:
        """1-based rank an evaluated layout would take among the fitting ones by tokens/s (for layouts the
        search does not generate, such as a planning-only DualPipe schedule)."""
        return 1 + sum(c.time.tokens_per_s > candidate.time.tokens_per_s for c in self.all_fitting)

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def _refused(rejected: dict[str, int] | None, problems: list[str]) -> bool:
    """Count a layout group the trainer refuses under the spec rule's own words (its first problem)."""
    if problems and rejected is not None:
        key = f"the trainer refuses: {problems[0]}"
        rejected[key] = rejected.get(key, 0) + 1
    return bool(problems)


def _tp_degrees(inputs: PlanInputs, num_gpus: int, rejected: dict[str, int] | None = None) -> list[int]:
    """tp stays inside a node, and the trainer splits the heads, KV heads and FFN over it (`shape_problems`)."""
    return [t for t in _divisors(min(inputs.gpus_per_node, num_gpus))
            if num_gpus % t == 0 and not _refused(rejected, shape_problems(_par(tp=t), inputs.shape))]


def _par(*, tp: int = 1, pp: int = 1, ep: int = 1) -> ParallelismSpec:
    """The degrees the spec rules read, without validating the rest of the section (the search's hot path)."""
    return ParallelismSpec.model_construct(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                           virtual_stages=1)


def _virtual_stages(n_layers: int, pp: int) -> list[int]:
    """Chunks per pipeline rank: powers of two, the divisors of the layers per rank (equal chunks, e.g.
    MegaScale's v = 6 for 96 layers on 8 stages) and the most the layers allow (pp · v ≤ layers)."""
    if pp == 1:
        return [1]
    most = n_layers // pp
    return sorted({v for v in (*_powers_of_two(most), *_divisors(most), most) if 1 <= v <= most})


def candidate_layouts(inputs: PlanInputs, num_gpus: int, *, max_micro_batch: int,
                      skipped: dict[str, int] | None = None) -> list[Layout]:
    """Every layout the search evaluates for `num_gpus`, each with recompute none (the search tries heavier
    policies only while it does not fit); (tp, pp) pairs dropped before evaluation are counted in `skipped`.

    ZeRO levels: 2 and 3 where dp > 1 (3 also as HSDP, sharded inside a node), 0 where dp == 1. ZeRO-1 is never
    listed: the trainer's FSDP2 shards gradients at ZeRO-1 as at ZeRO-2 (parallel/fsdp.py), so they are one layout
    (`SearchResult.rank_of` finds a ZeRO-1 or ZeRO-0 layout as its ZeRO-2 twin). Interleaving: `_virtual_stages`."""
    shape = inputs.shape
    seqs = sequences_per_step(inputs)
    dpo = inputs.preference  # DPO and ORPO, as the spec rule reads finetune.method
    groups: list[Layout] = []
    for tp in _tp_degrees(inputs, num_gpus, skipped):
        for pp in _divisors(num_gpus // tp):
            if pp > shape.n_layers:
                break
            dp = num_gpus // (tp * pp)
            if dp > seqs:  # a replica without a whole sequence would silently grow the global batch
                if skipped is not None:
                    key = f"dp larger than the {seqs} sequences of the global batch"
                    skipped[key] = skipped.get(key, 0) + 1
                continue
            if _refused(skipped, finetune_layout_problems(dpo=dpo, weights=inputs.finetune, tensor_parallel=tp,
                                                          pipeline_parallel=pp, data_parallel=dp)):
                continue
            micro_batches = [b for b in _powers_of_two(max_micro_batch)
                             if batch_divides(global_batch_tokens=inputs.global_batch_tokens, micro_batch=b,
                                              seq_len=inputs.seq_len, data_parallel=dp)]
            if not micro_batches:
                if skipped is not None:
                    skipped[BATCH_UNEVEN] = skipped.get(BATCH_UNEVEN, 0) + 1
                continue
            eps = [1]
            if shape.moe is not None:
                eps = [e for e in _divisors(dp) if not _refused(skipped, moe_problems(_par(tp=tp, ep=e), shape))]
            for ep in eps:
                for v in _virtual_stages(shape.n_layers, pp):
                    for mb in micro_batches:
                        zeros = [0] if dp == 1 else [2, 3]  # the trainer's ZeRO-1 is its ZeRO-2
                        for zero in zeros:
                            base = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, micro_batch=mb, virtual_stages=v,
                                          schedule="interleaved_1f1b" if v > 1 else "1f1b")
                            variants = [base]
                            hsdp_shard = max(1, inputs.gpus_per_node // tp)
                            if (zero == 3 and 1 < hsdp_shard < dp and dp % hsdp_shard == 0
                                    and hsdp_shard % ep == 0):
                                variants.append(replace(base, dp_replicate=dp // hsdp_shard))
                            groups.extend(variants)
    return groups


def recompute_ladder(inputs: PlanInputs) -> tuple[tuple[Recompute, ...], ...]:
    """The recompute policies the search tries, in tiers of cost: none; then selective and op (where the trainer
    runs it: spec/rules.py `op_recompute_problem`), whose costs cross over with the sequence length and the
    attention kernel's speed (selective repeats the attention core, op the wk, wo and w3 matmuls), so both are
    tried and the faster that fits is kept; full last."""
    middle: tuple[Recompute, ...] = ("selective",)
    if op_recompute_problem(inputs.shape, weights=inputs.finetune) is None:
        middle = ("selective", "op")
    return ("none",), middle, ("full",)


def evaluate(inputs: PlanInputs, layout: Layout) -> Candidate:
    """Memory and step time of one layout."""
    seqs = sequences_per_step(inputs)
    m = layout.num_microbatches(seqs)
    return Candidate(layout=layout, memory=memory_per_gpu(inputs, layout, num_microbatches=m),
                     time=step_time(inputs, layout, sequences_per_step=seqs))


def _reject_reason(mem: MemoryBreakdown) -> str:
    parts = {"params+grads+optimizer": mem.params + mem.grads + mem.optimizer, "activations": mem.activations,
             "buffers": mem.buffers}
    worst = max(parts, key=lambda k: parts[k])
    return f"does not fit: {worst} largest"


def search_layouts(inputs: PlanInputs, num_gpus: int, *, max_micro_batch: int = 8, top_k: int = 5,
                   suggest: bool = True) -> SearchResult:
    """Rank fitting layouts for `num_gpus` by predicted tokens/s (ties: more headroom).

    Recomputing more never runs faster, so the first tier of `recompute_ladder` (none, selective or op, full)
    that fits holds a layout's only candidate worth ranking (of selective and op the faster that fits); and once
    a layout does not fit even with full recompute, the same layout with a larger micro-batch (which holds at
    least as many activations: mb × in-flight never shrinks when mb doubles) is not evaluated."""
    fitting: list[Candidate] = []
    rejected: dict[str, int] = {}
    leanest: tuple[Layout, MemoryBreakdown] | None = None
    evaluated = 0
    seqs = sequences_per_step(inputs)
    groups = candidate_layouts(inputs, num_gpus, max_micro_batch=max_micro_batch, skipped=rejected)
    too_big: set[tuple] = set()  # layouts (without micro-batch) that did not fit at a smaller micro-batch
    states_too_big: set[tuple] = set()  # weights + grads + optimizer alone exceed memory, whatever v and mb
    ladder = recompute_ladder(inputs)
    for base in groups:
        states_key = (base.dp, base.tp, base.pp, base.ep, base.dp_replicate, base.zero)
        key = (*states_key, base.virtual_stages)
        if key in too_big:  # a larger micro-batch holds more of everything: it cannot fit either
            rejected[SMALLER_MB_FAILED] = rejected.get(SMALLER_MB_FAILED, 0) + 1
            continue
        if states_key in states_too_big:
            rejected[STATES_FAILED] = rejected.get(STATES_FAILED, 0) + 1
            continue
        m = base.num_microbatches(seqs)
        for tier in ladder:  # dearer policies only while nothing cheaper fits
            fits = []
            for recompute in tier:
                layout = base if recompute == "none" else replace(base, recompute=recompute)
                mem = memory_per_gpu(inputs, layout, num_microbatches=m)
                evaluated += 1
                if leanest is None or mem.total < leanest[1].total:
                    leanest = (layout, mem)
                if mem.fits:  # step time only for layouts that fit
                    fits.append(Candidate(layout=layout, memory=mem,
                                          time=step_time(inputs, layout, sequences_per_step=seqs)))
                else:
                    reason = _reject_reason(mem)
                    rejected[reason] = rejected.get(reason, 0) + 1
            if fits:
                fitting.append(max(fits, key=lambda c: (c.time.tokens_per_s, c.memory.headroom)))
                break
        else:  # (with grad_sync: last_micro_batch a larger micro-batch can drop the unsharded gradients)
            if inputs.grad_sync == "every_micro_batch":
                too_big.add(key)
                if mem.params + mem.grads + mem.optimizer > mem.capacity:
                    states_too_big.add(states_key)
    smallest = evaluate(inputs, leanest[0]) if leanest is not None else None
    fitting.sort(key=lambda c: (-c.time.tokens_per_s, -c.memory.headroom))
    result = SearchResult(num_gpus=num_gpus, ranked=fitting[:max(top_k, 1)], num_evaluated=evaluated,
                          rejected=rejected, smallest=smallest, num_fitting=len(fitting))
    result.all_fitting = fitting
    if not fitting and suggest:
        result.suggestions = what_would_fit(inputs, num_gpus, smallest=smallest, max_micro_batch=max_micro_batch)
    return result


def _fits_anywhere(inputs: PlanInputs, num_gpus: int, *, max_micro_batch: int) -> Candidate | None:
    return search_layouts(inputs, num_gpus, max_micro_batch=max_micro_batch, top_k=1, suggest=False).best


def what_would_fit(inputs: PlanInputs, num_gpus: int, *, smallest: Candidate | None,
                   max_micro_batch: int) -> list[str]:
    """Concrete changes that would make the job fit, with numbers."""
    lines: list[str] = []
    if smallest is not None:
        mem = smallest.memory
        lines.append(
            f"the leanest layout ({smallest.layout.describe()}) needs {mem.total / GiB:.0f} GiB per GPU "
            f"(weights {mem.params / GiB:.0f}, grads {mem.grads / GiB:.0f}, optimizer {mem.optimizer / GiB:.0f}, "
            f"activations {mem.activations / GiB:.0f}, buffers {mem.buffers / GiB:.0f}) of "
            f"{mem.capacity / GiB:.0f} GiB"
        )
    node = inputs.gpus_per_node
    gpus = max(node, num_gpus)
    found = None
    for _ in range(12):  # double until something fits, then bisect on whole nodes
        gpus *= 2
        if _fits_anywhere(inputs, gpus, max_micro_batch=max_micro_batch):
            found = gpus
            break
    if found is not None:
        low, high = max(num_gpus, found // 2) // node, found // node
        while high - low > 1:
            mid = (low + high) // 2
            if _fits_anywhere(inputs, mid * node, max_micro_batch=max_micro_batch):
                high = mid
            else:
                low = mid
        best = _fits_anywhere(inputs, high * node, max_micro_batch=max_micro_batch)
        assert best is not None
        lines.append(f"more GPUs: {high * node} GPUs ({high} nodes) fit with {best.layout.describe()}")
    if inputs.moment_bytes > 1.5:
        from dataclasses import replace as dc_replace

        from leantrain.plan.inputs import MOMENT_BYTES

        eight_bit = dc_replace(inputs, moment_bytes=MOMENT_BYTES["8bit"])
        hit = _fits_anywhere(eight_bit, num_gpus, max_micro_batch=max_micro_batch)
        lines.append("8-bit optimizer states (precision.optimizer_state: 8bit): "
                     + (f"fits with {hit.layout.describe()}" if hit else "still does not fit on these GPUs"))
    for name in ("H200", "B200", "MI300X"):
        acc = CATALOG[name]
        if acc.memory_bytes > inputs.memory_bytes:
            hit = _fits_anywhere(inputs.with_memory(acc.memory_bytes), num_gpus, max_micro_batch=max_micro_batch)
            if hit:
                lines.append(f"a larger accelerator: {name} ({acc.memory_bytes / GiB:.0f} GiB) fits with "
                             f"{hit.layout.describe()}")
                break
    if smallest is not None and smallest.layout.recompute == "full" and smallest.layout.micro_batch == 1:
        lines.append("full recompute and micro-batch 1 were already tried: the weights and optimizer states "
                     "themselves are too large; shard them over more GPUs")
    return lines
