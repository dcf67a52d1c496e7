"""The `data:` section of the job spec: sources, tokenizer, cleaning, dedup, PII, mixture, shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from leantrain.spec.base import PositiveInt, Section


class DataSource(Section):
    """One raw corpus."""

    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Short name (letters, digits, _ . -), used in the manifest, shard names and per-source loss.",
    )
    path: str | Path | None = Field(
        None, description="File or folder (.gz/.zst allowed), or an object-store URL such as s3://bucket/prefix "
        "(read through fsspec); relative paths resolve against the spec's folder. Optional for a builtin source "
        "(then written under data.dir/raw/).",
    )
    weight: float = Field(1.0, gt=0, description="Mixing weight (normalised over sources).")
    format: Literal["jsonl", "text", "parquet", "arrow", "chat", "preference"] = Field(
        "jsonl", description="Reader to use; arrow reads Arrow IPC files, e.g. a Hugging Face datasets "
        "save_to_disk folder; chat reads JSONL conversations ({messages: [{role, content}]} or {prompt, "
        "response}), trained on the assistant tokens only (docs/data.md); preference reads JSONL pairs "
        "({prompt, chosen, rejected} as strings or messages, or {chosen, rejected} conversations) for "
        "finetune.method: dpo (docs/finetune.md).",
    )
    kind: Literal["auto", "prose", "code"] = Field(
        "auto", description="What the quality filters expect: prose (Gopher rules; code-like lines are left "
        "out of the symbol, alphabetic-word and repetition rules), code (line-length, alphanumeric and "
        "repeated-long-line rules; indentation kept), or auto (code rules for a document whose lines mostly "
        "look like code). docs/data.md.",
    )
    text_field: str = Field("text", description="Field holding the text (jsonl, parquet).")
    id_field: str | None = Field("id", description="Field holding a document id (jsonl, parquet); else file:line.")
    text_unit: Literal["file", "line", "paragraph"] = Field(
        "file", description="format text: one document per file, per line, or per blank-line-separated paragraph."
    )
    builtin: Literal["demo-en", "demo-zh", "pydoc"] | None = Field(
        None, description="Generate this bundled demo corpus (jsonl) at `path` when the file is missing.",
    )

    @field_validator("path")
    @classmethod
    def _url_or_path(cls, value: str | Path | None) -> str | Path | None:
        if isinstance(value, str) and "://" not in value:
            return Path(value)  # only URLs stay strings
        return value

    @model_validator(mode="after")
    def _path_or_builtin(self) -> DataSource:
        if self.path is None and self.builtin is None:
            raise ValueError(f"source {self.name!r} needs a path (or a builtin corpus)")
        if self.builtin is not None and self.format != "jsonl":
            raise ValueError(f"builtin source {self.name!r} is jsonl; drop format: {self.format}")
        return self


class TokenizerSpec(Section):
    """Tokenizer: trained on the corpus (BPE), loaded from a tokenizer.json, or raw bytes."""

    kind: Literal["bpe", "file", "byte"] = Field("bpe", description="Train BPE, load a file, or bytes.")
    path: Path | None = Field(None, description="tokenizer.json to load when kind is 'file'.")
    vocab_size: PositiveInt = Field(32000, description="Target vocabulary when training BPE.")
    train_sample_bytes: PositiveInt = Field(
        200_000_000, description="Cleaned text (bytes, spread over sources) that BPE training reads at most."
    )
    eos_token: str = Field("<|endoftext|>", min_length=1, description="End-of-document token, added after each doc.")

    @model_validator(mode="after")
    def _file_needs_path(self) -> TokenizerSpec:
        if self.kind == "file" and self.path is None:
            raise ValueError("kind 'file' needs a path to a tokenizer.json")
        return self


class CleaningSpec(Section):
    """Text normalisation and Gopher/C4-style quality filters. CJK text is counted by characters, not spaces."""

    normalization: Literal["NFC", "NFKC", "none"] = Field(
        "NFC", description="Unicode normal form (NFKC also folds full-width forms, e.g. Chinese punctuation)."
    )
    min_words: int = Field(20, ge=0, description="Drop documents with fewer words (a CJK character is one word).")
    max_words: PositiveInt = Field(200_000, description="Drop documents with more words.")
    min_mean_word_length: float = Field(
        3.0, ge=0, description="Drop Latin-script documents whose mean word length is below this (Gopher: 3)."
    )
    max_mean_word_length: float = Field(10.0, gt=0, description="... or above this (Gopher: 10).")
    max_symbol_ratio: float = Field(
        0.1, ge=0, description="Drop if (#, …/..., and currency, modifier and other Unicode symbols; not code "
        "operators such as = + < > |) per word exceeds this (Gopher: 0.1 for # and …)."
    )
    max_duplicate_line_fraction: float = Field(
        0.3, ge=0, le=1, description="Drop if this fraction of lines repeat an earlier line (Gopher: 0.3)."
    )
    max_top_2gram_fraction: float = Field(
        0.2, ge=0, le=1, description="Drop if the most frequent word 2-gram covers this share of characters."
    )
    max_duplicate_5gram_fraction: float = Field(
        0.15, ge=0, le=1, description="Drop if repeated word 5-grams cover this share of characters (Gopher: 0.15)."
    )
    min_stop_words: int = Field(
        2, ge=0, description="Drop if fewer distinct stop words occur (English or Chinese list by script)."
    )
    max_bullet_line_fraction: float = Field(
        0.9, ge=0, le=1, description="Drop if more of the non-blank lines start with a bullet (•, ◦, ▪ …, or - * + "
        "– — before a space) (Gopher: 0.9); code-like lines are not counted.",
    )
    max_ellipsis_line_fraction: float = Field(
        0.3, ge=0, le=1, description="Drop if more of the non-blank lines end with an ellipsis (... or …) "
        "(Gopher: 0.3); code-like lines are not counted.",
    )
    min_alpha_word_fraction: float = Field(
        0.8, ge=0, le=1, description="Drop if fewer of the whitespace-separated words contain a letter (Gopher: "
        "80 %); code-like lines are not counted.",
    )
    max_code_line_chars: PositiveInt = Field(
        1000, description="Code documents: drop if a line is longer (minified or generated; StarCoder: 1000)."
    )
    max_code_mean_line_chars: float = Field(
        100.0, gt=0, description="Code documents: drop if the mean line length is above this (StarCoder: 100)."
    )
    min_code_alnum_fraction: float = Field(
        0.25, ge=0, le=1, description="Code documents: drop if fewer non-space characters are letters or digits "
        "(StarCoder: 0.25).",
    )
    max_code_duplicate_line_fraction: float = Field(
        0.5, ge=0, le=1, description="Code documents: drop if this share of the characters of long lines "
        "(>= 20 characters) repeats an earlier line; short lines (}, end, pass) do not count.",
    )


class DedupSpec(Section):
    """Exact and near-duplicate removal across all sources; the first occurrence (spec order) is kept."""

    exact: bool = Field(True, description="Drop documents whose normalised text hash was seen before.")
    near: bool = Field(True, description="Drop near duplicates (MinHash + LSH).")
    num_bands: PositiveInt = Field(
        20, description="LSH bands b. 20 × 5 finds a pair at Jaccard 0.85 with probability 0.99998 (datatrove's "
        "14 × 8: 0.988, so about 1 in 80 such pairs is missed); verify_jaccard removes the extra candidates.",
    )
    rows_per_band: PositiveInt = Field(5, description="MinHash rows per band r.")
    shingle_words: PositiveInt = Field(5, description="Word n-gram size of a shingle (Latin script).")
    shingle_chars: PositiveInt = Field(5, description="Character n-gram size of a shingle for CJK text.")
    verify_jaccard: float = Field(
        0.7, ge=0, le=1, description="A band hit counts only if the signatures agree on this share (0 = off)."
    )
    normalize_numbers: bool = Field(
        True, description="Near-dedup compares every digit run as 0 (as datatrove's simplify_text does; case, "
        "accents and punctuation are always normalised). Turn off for data whose numbers are the content "
        "(arithmetic problems, tables); chat and preference sources always keep their digits.",
    )
    seed: int = Field(42, ge=0, description="Seed of the MinHash permutations.")
    bucket_records: PositiveInt = Field(
        1 << 18, description="Hash records (LSH band keys, exact keys) one merge step holds in memory (about "
        "70 bytes each while it sorts: 18 MB at the default); the sorted per-shard files on disk are merged in "
        "hash ranges of at most this many records, so dedup memory does not grow with the corpus.",
    )


class PIISpec(Section):
    """Sensitive-information redaction: typed placeholders, counts per type, an audit file without values."""

    enabled: bool = Field(True, description="Detect and redact sensitive values.")
    types: list[Literal["email", "phone", "ip", "cn_id", "bank_card", "us_ssn", "secret"]] = Field(
        default_factory=lambda: ["email", "phone", "ip", "cn_id", "bank_card", "us_ssn", "secret"],
        description="Kinds to redact.",
    )
    salt_env: str = Field(
        "LEANTRAIN_PII_SALT", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Env var with the audit-hash salt; when unset a random salt is used and never stored.",
    )
    audit: bool = Field(True, description="Write pii_audit.jsonl (doc id, type, offsets, salted hash).")


class MixtureStageSpec(Section):
    """A curriculum stage: these source weights apply until `until_tokens` training tokens."""

    weights: dict[str, Annotated[float, Field(ge=0)]] = Field(
        description="Weight per source name, 0 or more (missing sources get 0).")
    until_tokens: float | None = Field(None, gt=0, description="End of the stage in training tokens; None: the end.")


class DataSpec(Section):
    """Training data: how much, how long each sequence is, where the raw and prepared data live."""

    tokens_total: float = Field(gt=0, description="Training tokens D (e.g. 2e12).")
    seq_len: PositiveInt = Field(4096, description="Tokens per training sequence.")
    dir: Path = Field(Path("data"), description="Prepared data dir that `prepare` writes and `train` reads.")
    sources: list[DataSource] = Field(default_factory=list, description="Raw corpora to prepare.")
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="Tokenizer settings.")
    bytes_per_token_raw: float = Field(4.0, gt=0, description="Raw text bytes per token, for storage estimates.")
    replicas: PositiveInt = Field(1, description="Copies of the prepared data kept (storage estimate).")
    cleaning: CleaningSpec = Field(default_factory=CleaningSpec, description="Normalisation and quality filters.")
    dedup: DedupSpec = Field(default_factory=DedupSpec, description="Exact and near-duplicate removal.")
    pii: PIISpec = Field(default_factory=PIISpec, description="Sensitive-information redaction.")
    stages: list[MixtureStageSpec] = Field(
        default_factory=list, description="Optional curriculum: source weights per stage (default: source weights)."
    )
    shard_size_tokens: PositiveInt = Field(2**27, description="Tokens per shard file (a document never spans two).")
    valid_fraction: float = Field(
        0.01, ge=0, lt=1, description="Share of each source's documents held out (by text hash) for evaluation."
    )
    workers: PositiveInt | None = Field(
        None, description="Parallel prepare tasks (processes with executor local; None: all cores of this "
        "machine, or the Ray cluster's CPUs). The output is identical for any number.",
    )
    executor: Literal["local", "ray"] = Field(
        "local", description="Where prepare's tasks run: local processes, or Ray (see data.ray_address).",
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join with executor ray (e.g. ray://head:10001 or auto); None starts "
        "an embedded local Ray for the run and stops it after.",
    )
    task_bytes: PositiveInt = Field(
        1 << 28, description="An uncompressed line-based input file (jsonl, chat, text with text_unit line) "
        "larger than this is split into byte-range tasks of about this size (cut at line ends); the output is "
        "the same as for one task per file.",
    )
    on_bad_input: Literal["error", "skip"] = Field(
        "error", description="A truncated or corrupt input file (.gz/.zst, parquet, arrow) or a table without "
        "text_field: error names the file and offset and stops; skip keeps the documents read before the damage, "
        "leaves the rest of that file out and reports where and how much in report.json (sources[].bad_inputs).",
    )
    max_doc_bytes: PositiveInt = Field(
        1 << 23, description="A line (jsonl, chat, text), paragraph, text file or table value longer than this "
        "many bytes is skipped while it is read (counted as doc_too_large), so one huge line never costs more "
        "memory than this.",
    )

    @model_validator(mode="after")
    def _stages_name_sources(self) -> DataSpec:
        names = {s.name for s in self.sources}
        for number, stage in enumerate(self.stages):
            unknown = sorted(set(stage.weights) - names)
            if unknown:
                raise ValueError(f"data.stages[{number}] names unknown sources {unknown}; sources: {sorted(names)}")
            if number < len(self.stages) - 1 and stage.until_tokens is None:
                raise ValueError(f"data.stages[{number}] needs until_tokens (only the last stage may omit it)")
        return self

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, sources: list[DataSource]) -> list[DataSource]:
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique; repeated: {', '.join(dupes)}")
        return sources
