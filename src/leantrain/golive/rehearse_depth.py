"""A deep model rehearsed at two depths and extended to its own: what `leantrain rehearse` does by default
when a pipeline chunk holds more than three layers (below that the two short runs cost as much as one whole);
likewise a step of many micro-batches, rehearsed short and extended (end of this module).

A fake tensor costs about as much host time as a small real op (the dispatch, not the data), so a rank of
Llama 3.1 405B on 16,384 GPUs (8 of 126 layers per PP16 stage, 16 micro-batches, 3 steps) is minutes of
Python per layer. Everything the rehearsal records is, per rank, a sum over that rank's layers plus what the
rest of the model adds (embedding, head, loss, optimizer and framework overhead): states, activations (1F1B
keeps the same micro-batches in flight whatever the depth), the collectives of each block, its host syncs.
So the trainer's own path runs twice, with one and with two layers per pipeline chunk (same widths,
vocabulary, world, layout, batch), and each number is extended linearly to the rank's real layer count:
f(L) = f(1) + (f(2) − f(1)) × (L − 1) per chunk. The FSDP detail that the last block keeps its gathered
parameters is the same at every depth ≥ 1, and so is the loss's temporary at the peak.

Not extended (run at full depth instead, `--depth full`): a model whose layers differ (MoE with leading dense
layers, where depth changes the mix) or whose weights come from a checkpoint (`init_from`: the files are the
checkpoint's). Checked against full-depth rehearsals in tests/scale/test_scale_pins.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from leantrain.golive.rehearse_report import merge_collectives
from leantrain.spec.schema import JobSpec
from leantrain.spec.shapes import chunk_layers

SHORT_DEPTHS = (1, 2)  # layers per pipeline chunk in the two short rehearsals


def chunks_of(spec: JobSpec) -> int:
    par = spec.parallelism
    return par.pipeline_parallel * par.virtual_stages


def why_not_extended(spec: JobSpec, *, n_layers: int) -> str | None:
    """None when the spec can be rehearsed at two depths and extended; else the reason to run it whole."""
    moe = spec.model.moe
    if spec.model.n_layers is None:
        return "model.n_layers is not given (the shape comes from size_billion)"
    if spec.model.init_from is not None:
        return "model.init_from: the checkpoint's files are read as they are"
    if spec.model.architecture == "moe" and moe is not None and (moe.first_dense_layers or 0) > 0:
        return "model.moe.first_dense_layers: the depth changes the mix of dense and MoE layers"
    if max(chunk_layers(n_layers, chunks_of(spec))) <= sum(SHORT_DEPTHS):
        return "at most three layers per pipeline chunk: rehearsed whole (as cheap as the two short runs)"
    return None


def with_layers(spec: JobSpec, n_layers: int) -> JobSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"n_layers": n_layers})})


def rank_layers(spec: JobSpec, *, n_layers: int, stage: int) -> int:
    """Layers pipeline rank `stage` holds at full depth (its chunks stage, stage + pp, ...)."""
    pp = spec.parallelism.pipeline_parallel
    counts = chunk_layers(n_layers, chunks_of(spec))
    return sum(counts[stage::pp])


def _line(one: float, two: float, units: float) -> float:
    return one + (two - one) * units


def _num(one: float, two: float, units: float, *, whole: bool) -> float:
    value = _line(one, two, units)
    return max(0, round(value)) if whole else max(0.0, value)


def _collectives(one: list[dict[str, Any]], two: list[dict[str, Any]], units: float) -> list[dict[str, Any]]:
    by_key_one = {(c["op"], c["group"]): c for c in one}
    by_key_two = {(c["op"], c["group"]): c for c in two}
    out = []
    for key in sorted(set(by_key_one) | set(by_key_two)):
        a, b = by_key_one.get(key, {}), by_key_two.get(key, {})
        count = _num(a.get("count", 0), b.get("count", 0), units, whole=True)
        if count:
            out.append({"op": key[0], "group": key[1], "count": count,
                        "bytes": _num(a.get("bytes", 0), b.get("bytes", 0), units, whole=True)})
    return out


def _counts(one: dict[str, int], two: dict[str, int], units: float) -> dict[str, int]:
    merged = {site: _num(one.get(site, 0), two.get(site, 0), units, whole=True) for site in {*one, *two}}
    return {site: n for site, n in sorted(merged.items()) if n}


def extend_rank(one: dict[str, Any], two: dict[str, Any], *, layers: int, virtual_stages: int) -> dict[str, Any]:
    """One rank's report at full depth from its reports at one and two layers per chunk."""
    units = (layers - virtual_stages) / virtual_stages  # extra layers per chunk beyond the first
    out = _extend(one, two, units)
    out["layers"] = layers
    return out


def _extend(one: dict[str, Any], two: dict[str, Any], units: float) -> dict[str, Any]:
    """`two` with every recorded number moved along the line through `one` and `two` by `units` steps."""
    out = dict(two)
    out["memory_bytes"] = {k: _num(one["memory_bytes"][k], v, units, whole=True)
                           for k, v in two["memory_bytes"].items()}
    out.update(_calls_and_syncs(one, two, units))
    for key in ("host_syncs_per_step", "host_syncs_per_logging_step"):
        out[key] = _num(one[key], two[key], units, whole=True)
    if isinstance(two.get("checkpoint_save"), dict) and isinstance(one.get("checkpoint_save"), dict):
        out["checkpoint_save"] = dict(two["checkpoint_save"]) | {
            k: _num(one["checkpoint_save"][k], two["checkpoint_save"][k], units, whole=True)
            for k in ("write_items", "bytes") if k in two["checkpoint_save"]}
    out["rehearsal_s"] = {k: round(one["rehearsal_s"].get(k, 0.0) + v, 3) for k, v in two["rehearsal_s"].items()}
    if isinstance(one.get("microbatch_slope"), dict) and isinstance(two.get("microbatch_slope"), dict):
        a, b = one["microbatch_slope"], two["microbatch_slope"]  # per micro-batch, itself a sum over layers
        out["microbatch_slope"] = {
            "memory_bytes": {k: _line(a["memory_bytes"][k], v, units) for k, v in b["memory_bytes"].items()},
            **_calls_and_syncs(a, b, units)}
    return out


def _calls_and_syncs(one: dict[str, Any], two: dict[str, Any], units: float) -> dict[str, Any]:
    """`collectives_per_step` and `host_sync_counts` of a report (or a slope) moved along the line by `units`."""
    return {"collectives_per_step": _collectives(one["collectives_per_step"], two["collectives_per_step"], units),
            "host_sync_counts": {phase: _counts(one["host_sync_counts"].get(phase, {}), counts, units)
                                 for phase, counts in two["host_sync_counts"].items()}}


def extend_reports(spec: JobSpec, *, n_layers: int, one: list[dict[str, Any]],
                   two: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's report at full depth (ranks in the same order in both short rehearsals)."""
    vs = spec.parallelism.virtual_stages
    return [extend_rank(a, b, layers=rank_layers(spec, n_layers=n_layers, stage=b["pipeline_stage"]),
                        virtual_stages=vs) for a, b in zip(one, two, strict=True)]


# Micro-batches. Once the pipeline is full, a step's collectives and host syncs are a fixed part plus a part per
# micro-batch, and so is its memory: 1F1B keeps at most pp - stage micro-batches in flight, but torch's
# PipelineStage allocates one receive buffer per micro-batch (activations forward, their gradients backward),
# a micro-batch's activation each. So a step of many micro-batches (DeepSeek-V3: 120) is rehearsed short and
# extended linearly, like the depth. A 1F1B pipeline step of pp + 2 measures in itself what one more micro-batch
# adds (golive/rehearse_slope.py; `extend_by_slope`). Other schedules, and accumulation without a pipeline, are
# rehearsed with two short counts M1 and M2 (`extend_microbatches`). M1 is where the growth is linear already,
# measured stage by stage on tiny models: 1F1B from pp + 1 (PP4, first stage: +435 kB from 4 to 5, then +156 kB
# per micro-batch from 5 to 24; the last stage linear from 4), interleaved from pp × virtual_stages (PP2 × v2:
# +4.1 MB from 2 to 4, then +0.84 MB per two up to 12). Interleaved and the other schedules keep the wider
# 2 × pp × virtual_stages (GPipe holds every micro-batch until its backward: linear from the start). M2 is
# M1 + 1 without a pipeline, M1 + pp for the schedules that run rounds of pp.
def _micro_step_tokens(spec: JobSpec, *, world_size: int) -> int:
    """Tokens of one micro-batch over all data-parallel ranks (the trainer's micro_batch × seq_len × dp)."""
    par = spec.parallelism
    dp = max(1, world_size // (par.tensor_parallel * par.pipeline_parallel))
    return spec.training.micro_batch * spec.data.seq_len * dp


def microbatches(spec: JobSpec, *, world_size: int) -> int:
    """The trainer's gradient-accumulation count (micro-batches per step) for `spec` at `world_size`."""
    return max(1, spec.training.global_batch_tokens // _micro_step_tokens(spec, world_size=world_size))


def short_microbatches(spec: JobSpec, *, count: int) -> tuple[int, ...] | None:
    """The counts to rehearse instead of `count` micro-batches: (M,) for a 1F1B pipeline, whose step measures
    what one more micro-batch adds (golive/rehearse_slope.py), (M1, M2) otherwise (other schedules, and plain
    gradient accumulation without a pipeline); None when the short runs would not save time."""
    pp, vs = spec.parallelism.pipeline_parallel, spec.parallelism.virtual_stages
    one_f_one_b = spec.parallelism.pipeline_schedule == "1f1b"
    if one_f_one_b and pp > 1:  # past the warm-up each micro-batch is one more F and B
        short = pp + 2  # two steady periods on the first stage: the one measured is not its first backward
        return (short,) if count > short else None
    if one_f_one_b:
        first, second = pp + 1, pp + 2
    else:  # torch's interleaved schedule runs micro-batches in rounds of pp
        first = max(2, 2 * pp * vs)
        second = first + max(pp, 1)
    return (first, second) if count > 2 * second - first else None


def with_microbatches(spec: JobSpec, count: int, *, world_size: int) -> JobSpec:
    """`spec` with a global batch of `count` micro-batches (everything else, the world included, the same)."""
    tokens = count * _micro_step_tokens(spec, world_size=world_size)
    return spec.model_copy(update={"training": spec.training.model_copy(update={"global_batch_tokens": tokens})})


def extend_microbatches(one: list[dict[str, Any]], two: list[dict[str, Any]], *, counts: tuple[int, int],
                        count: int) -> list[dict[str, Any]]:
    """Every rank's report at `count` micro-batches from its reports at `counts` (M1, M2)."""
    units = (count - counts[0]) / (counts[1] - counts[0])  # from M1, in steps of M2 - M1
    out = []
    for a, b in zip(one, two, strict=True):
        report = _extend(a, b, units)
        report["num_microbatches"] = count
        report["extended_from_microbatches"] = list(counts)
        out.append(report)
    return out


def extend_by_slope(reports: list[dict[str, Any]], *, count: int) -> list[dict[str, Any]]:
    """Every rank's report at `count` micro-batches from its short 1F1B rehearsal and what one more micro-batch
    adds, measured in that rehearsal's step (`microbatch_slope`)."""
    out = []
    for report in reports:
        short = report["num_microbatches"]
        report_out = _extend(report, _plus_slope(report), count - short)
        report_out["num_microbatches"] = count
        report_out["extended_from_microbatches"] = [short]
        out.append(report_out)
    return out


def _plus_slope(report: dict[str, Any]) -> dict[str, Any]:
    """`report` with one more micro-batch: every extended number plus its slope (non-numbers as they are)."""
    slope = report["microbatch_slope"]
    memory = dict(report["memory_bytes"])
    for k, v in slope["memory_bytes"].items():
        memory[k] = memory.get(k, 0) + v
    mine, added = report["host_sync_counts"], slope["host_sync_counts"]
    counts = {phase: dict(Counter(mine.get(phase, {})) + Counter(added.get(phase, {}))) for phase in {*mine, *added}}
    return {**report, "memory_bytes": memory,
            "collectives_per_step": merge_collectives([*report["collectives_per_step"],
                                                       *slope["collectives_per_step"]]),
            "host_sync_counts": counts,
            "host_syncs_per_step": report["host_syncs_per_step"] + sum(
                slope["host_sync_counts"].get("step", {}).values()),
            "host_syncs_per_logging_step": report["host_syncs_per_logging_step"] + sum(
                slope["host_sync_counts"].get("logging_step", {}).values()),
            "rehearsal_s": {k: 0.0 for k in report["rehearsal_s"]}}


def extend_to_count(per_count: list[list[dict[str, Any]]], *, counts: tuple[int, ...] | None,
                    count: int) -> list[dict[str, Any]]:
    """Every rank's report at `count` micro-batches from its short rehearsals (`short_microbatches`'s counts):
    as rehearsed when there were none, from the one short 1F1B step and what it measured one more micro-batch
    adds, or from two short counts."""
    if counts is None:
        return per_count[0]
    if len(counts) == 1:
        return extend_by_slope(per_count[0], count=count)
    return extend_microbatches(*per_count, counts=counts, count=count)


def depth_record(n_layers: int, *, full_reason: str | None) -> dict[str, Any]:
    """rehearsal.json's `depth`."""
    if full_reason is not None:
        return {"n_layers": n_layers, "full": full_reason}
    return {"n_layers": n_layers, "extended_from_layers_per_chunk": list(SHORT_DEPTHS)}


def microbatches_record(counts: tuple[int, ...] | None, *, count: int) -> dict[str, Any]:
    """rehearsal.json's `microbatches`."""
    if not counts:
        return {"full": count}
    if len(counts) == 1:
        return {"extended_from": list(counts), "per_microbatch": "measured in the rehearsed step "
                "(ranks[].microbatch_slope)"}
    return {"extended_from": list(counts)}
