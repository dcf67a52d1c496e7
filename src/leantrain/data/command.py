"""`leantrain prepare SPEC [--out DIR] [--probe]` and the demo's prepare stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.data.chat_prepare import with_model_tokenizer
from leantrain.data.pipeline import PrepareResult, prepare_data
from leantrain.data.probe import ProbeResult
from leantrain.data.probe import probe as trial_read
from leantrain.data.shards import atomic_write_bytes
from leantrain.data.stats import render_report
from leantrain.errors import CheckFailed, UserInputError, check_output_dir
from leantrain.spec.schema import JobSpec
from leantrain.spec.shapes import resolve_shape


def _check_vocab(spec: JobSpec, *, tokenizer_vocab: int | None, tokenizer_path: Path | None = None) -> None:
    """The model's embedding must cover every token id the tokenizer can produce: before prepare, a BPE
    tokenizer's target size; after, the manifest's vocab_size, the prepared tokenizer's largest id + 1 (so it
    covers every id written to the shards, their max_token_id, and a tokenizer whose ids have gaps)."""
    model_vocab = resolve_shape(spec.model).vocab_size
    if tokenizer_vocab is None:
        wanted = spec.data.tokenizer.vocab_size if spec.data.tokenizer.kind == "bpe" else None
        if wanted is not None and wanted > model_vocab:
            raise UserInputError(
                f"data.tokenizer vocabulary ({wanted}) is larger than model.vocab_size ({model_vocab}); "
                f"raise model.vocab_size to at least {wanted} or lower data.tokenizer.vocab_size"
            )
    elif tokenizer_vocab > model_vocab:
        where = f" ({tokenizer_path})" if tokenizer_path is not None else ""
        raise UserInputError(
            f"data.tokenizer{where}: its token ids run up to {tokenizer_vocab - 1} (the data dir's vocab_size "
            f"{tokenizer_vocab}), but model.vocab_size is {model_vocab} and every id must be below it. Raise "
            f"model.vocab_size to at least {tokenizer_vocab}, or prepare with a tokenizer whose ids fit"
            + (" or a smaller data.tokenizer.vocab_size" if spec.data.tokenizer.kind == "bpe" else "")
        )


def build(spec: JobSpec, *, data_dir: Path, console: Console, force: bool = False) -> PrepareResult:
    """Run the pipeline for a spec, show the report, and check the vocabulary against the model."""
    if not spec.data.sources:
        raise UserInputError("data.sources is empty: list at least one corpus (name, path, format)")
    spec = with_model_tokenizer(spec)  # model.init_from: the checkpoint's tokenizer unless the spec names one
    _check_vocab(spec, tokenizer_vocab=None)
    result = prepare_data(spec.data, data_dir=data_dir, console=console, force=force)
    render_report(result.report, console=console)
    _check_vocab(spec, tokenizer_vocab=result.manifest.vocab_size,
                 tokenizer_path=data_dir / str(result.manifest.tokenizer.get("path", "tokenizer.json")))
    return result


def summary(result: PrepareResult) -> str:
    shards = result.manifest.shards
    train = sum(s.num_tokens for s in shards if s.split == "train")
    valid = sum(s.num_tokens for s in shards if s.split == "valid")
    docs = sum(s.num_docs for s in shards)
    state = "up to date" if result.up_to_date else f"reused {result.reused_shards} shard(s)"
    return (f"{result.data_dir}: {len(shards)} shards, {docs:,} docs, {train:,} train + {valid:,} valid tokens, "
            f"vocab {result.manifest.vocab_size} ({state})")


def render_probe(result: ProbeResult, *, console: Console) -> None:
    table = Table(title="trial read (memory-mapped, real sampler)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("loader tokens/s (one rank)", f"{result.measured_tokens_per_s:,.0f}")
    table.add_row("needed tokens/s (one dp rank)", f"{result.needed_tokens_per_s:,.0f}")
    table.add_row("margin", f"{result.margin:,.1f}×")
    table.add_row("first batch (open + read)", f"{result.first_batch_s * 1e3:.1f} ms")
    table.add_row("batches read", f"{result.num_batches:,}")
    console.print(table)
    console.print(f"needed rate from {result.needed_source}")
    verdict = "[green]PASS: the loader outruns the GPUs" if result.passed else "[red]FAIL: the loader is too slow"
    console.print(f"{verdict} ({result.margin:.1f}× the needed rate)")


def run(*, console: Console, spec: JobSpec, out: Path | None, probe: bool, force: bool = False) -> None:
    """`leantrain prepare`: build the data dir, or with `probe` only trial-read it (exit 1 when too slow)."""
    data_dir = Path(out) if out is not None else Path(spec.data.dir)
    check_output_dir(data_dir, "--out" if out is not None else "data.dir")  # a file there, or a file above it
    if probe:
        result = _probe(spec, data_dir=data_dir, console=console)
        if not result.passed:
            raise CheckFailed(f"trial read: {result.measured_tokens_per_s:,.0f} tokens/s is below the needed "
                              f"{result.needed_tokens_per_s:,.0f} tokens/s per data-parallel rank")
        return
    result = build(spec, data_dir=data_dir, console=console, force=force)
    console.print(summary(result))
    train_tokens = sum(s.num_tokens for s in result.manifest.shards if s.split == "train")
    if not train_tokens:
        raise UserInputError(_no_training_tokens(spec, result, data_dir))
    console.print(f"data.tokens_total {spec.data.tokens_total:.3g} = {spec.data.tokens_total / train_tokens:.2f} "
                  "epochs of these training tokens")


def _no_training_tokens(spec: JobSpec, result: PrepareResult, data_dir: Path) -> str:
    """Why a prepared data dir has no training tokens, naming the fields to change (the dir is kept)."""
    valid = [s for s in result.manifest.shards if s.split != "train"]
    kept = sum(s.num_docs for s in valid)
    if kept:
        return (f"data.valid_fraction {spec.data.valid_fraction:g}: all {kept:,} kept documents "
                f"({sum(s.num_tokens for s in valid):,} tokens) went to the validation split, so {data_dir} has no "
                "training tokens (each document's side is set by a hash of it, so a handful of documents can all "
                "land on one side); add documents or lower data.valid_fraction and prepare again (the data dir "
                f"written is kept; {data_dir / 'report.json'} has the counts)")
    drops: dict[str, int] = {}
    for source in result.report["sources"]:
        for reason, count in source.get("drops", {}).items():
            drops[reason] = drops.get(reason, 0) + count
    docs_in = sum(source["docs_in"] for source in result.report["sources"])
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(drops.items(), key=lambda kv: -kv[1]))
    return (f"data.sources: every one of the {docs_in:,} documents read was dropped "
            f"({reasons or 'no reason recorded'}), so {data_dir} has no training tokens; check the sources, or "
            f"the filter that drops them under data.cleaning (its report: {data_dir / 'report.json'}), and prepare "
            "again")


def _probe(spec: JobSpec, *, data_dir: Path, console: Console) -> ProbeResult:
    result = trial_read(spec, data_dir=data_dir)
    render_probe(result, console=console)
    payload: dict[str, Any] = result.to_json()
    atomic_write_bytes(data_dir / "probe.json", (json.dumps(payload, indent=2) + "\n").encode())
    return result


def demo_stage(ctx: Any) -> str:
    """Prepare the demo's data into ctx.spec().data.dir and trial-read it; one line for the demo table."""
    spec = ctx.spec()
    data_dir = Path(spec.data.dir)
    result = build(spec, data_dir=data_dir, console=ctx.console)
    trial = _probe(spec, data_dir=data_dir, console=ctx.console)
    dropped = sum(s["docs_in"] - s["docs_out"] for s in result.report["sources"])
    pii = sum(result.report["pii"].values())
    return (f"{sum(s.num_docs for s in result.manifest.shards):,} docs kept, {dropped:,} dropped, {pii} PII redacted, "
            f"{sum(s.num_tokens for s in result.manifest.shards):,} tokens; loader {trial.margin:,.0f}× needed")
