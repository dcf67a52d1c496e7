"""The data dir contract: file names, `manifest.json` reading/writing, and a builder from token lists.

A data dir holds `manifest.json`, `tokenizer.json`, `report.json`, `pii_audit.jsonl` and the shards
`train/<source>_<NNNNN>.{bin,idx}` and `valid/<source>_<NNNNN>.{bin,idx}`. `manifest.json` is the only file
the trainer needs to open first; everything else is found through it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leantrain.data.shards import TOKEN_DTYPES, ShardInfo, ShardWriter, atomic_write_bytes, token_dtype
from leantrain.errors import NUMBER, UserInputError, json_field, read_json_object

MANIFEST = "manifest.json"
REPORT = "report.json"
TOKENIZER = "tokenizer.json"
PII_AUDIT = "pii_audit.jsonl"
SPLITS = ("train", "valid")
FORMAT_NAME = "leantrain-data"
FORMAT_VERSION = 1
_MANIFEST_KEYS = {"format", "version", "vocab_size", "eos_id", "dtype", "tokenizer", "sources", "mixture", "shards"}


def shard_prefix(split: str, source: str, number: int) -> str:
    """Shard path (without suffix) relative to the data dir."""
    return f"{split}/{source}_{number:05d}"


@dataclass
class MixtureStage:
    """Curriculum stage: these weights apply to samples until `until_tokens` training tokens (None: to the end)."""

    weights: dict[str, float]
    until_tokens: float | None = None


@dataclass
class Manifest:
    """Parsed `manifest.json`. Extra sections (dedup, pii, sources' statistics) ride along in `extra`."""

    vocab_size: int
    eos_id: int
    dtype: str
    sources: list[dict[str, Any]]
    shards: list[ShardInfo]
    stages: list[MixtureStage]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # "<split>/<source>" → the sampler index's bucket totals (data.sample_index), when the reader of the manifest
    # loaded them for the ranks it hands the manifest to; not part of manifest.json
    bucket_totals: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def source_names(self) -> list[str]:
        return [s["name"] for s in self.sources]

    def shards_for(self, *, split: str, source: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split and s.source == source]

    def has_tokens(self, split: str) -> bool:
        """Whether any shard of `split` holds tokens (a data dir without a held-out split has no "valid" ones)."""
        return any(s.split == split and s.num_tokens > 0 for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "dtype": self.dtype,
            "tokenizer": self.tokenizer,
            "sources": self.sources,
            "mixture": {
                "weights": {s["name"]: s["weight"] for s in self.sources},
                "stages": [{"weights": st.weights, "until_tokens": st.until_tokens} for st in self.stages],
            },
            "shards": [s.to_json() for s in self.shards],
            **self.extra,
        }

    def write(self, data_dir: Path) -> None:
        """Write `manifest.json` and the sampler's document index of its shards (`index/`, data.sample_index)."""
        from leantrain.data.sample_index import write_sample_index  # it reads this module's Manifest

        write_sample_index(data_dir, self)
        text = json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"
        atomic_write_bytes(data_dir / MANIFEST, text.encode("utf-8"))


def load_manifest(data_dir: Path) -> Manifest:
    """Read and check `manifest.json`: a missing, foreign or damaged file (not JSON, a key missing, a value of the
    wrong type, a dtype that is not an integer type) is a user error naming the path and the key."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserInputError(f"{path} not found: run `leantrain prepare SPEC` to build the data dir first")
    raw = read_json_object(path)
    if raw.get("format") != FORMAT_NAME or raw.get("version") != FORMAT_VERSION:
        raise UserInputError(f"{path}: not a {FORMAT_NAME} v{FORMAT_VERSION} manifest; re-run `leantrain prepare`")
    field = functools.partial(json_field, raw, source=path)
    vocab_size, eos_id, dtype = field("vocab_size", int), field("eos_id", int), field("dtype", str)
    if vocab_size < 1:
        raise UserInputError(f"{path}: key 'vocab_size': expected a number of tokens ≥ 1, got {vocab_size}")
    if not 0 <= eos_id < vocab_size:
        raise UserInputError(f"{path}: key 'eos_id': expected a token id from 0 to vocab_size - 1 "
                             f"({vocab_size - 1}), got {eos_id}")
    if dtype not in TOKEN_DTYPES:
        raise UserInputError(f"{path}: key 'dtype': expected an integer type, one of {list(TOKEN_DTYPES)}; "
                             f"got {dtype!r}")
    for number in range(len(field("sources", list))):
        field(f"sources.{number}.name", str)
        field(f"sources.{number}.weight", NUMBER)
        field(f"sources.{number}.pad_multiple", int, default=0)
    field("mixture", dict)
    stages = []
    for number in range(len(field("mixture.stages", list, default=[]))):
        weights = field(f"mixture.stages.{number}.weights", dict)
        for name in weights:
            field(("mixture", "stages", str(number), "weights", name), NUMBER)
        stages.append(MixtureStage(weights=dict(weights),
                                   until_tokens=field(f"mixture.stages.{number}.until_tokens", NUMBER, default=None)))
    return Manifest(
        vocab_size=vocab_size, eos_id=eos_id, dtype=dtype, sources=list(raw["sources"]),
        shards=_shards(raw, path=path), stages=stages, tokenizer=dict(field("tokenizer", dict, default={})),
        extra={k: v for k, v in raw.items() if k not in _MANIFEST_KEYS},
    )


def _shards(raw: dict[str, Any], *, path: Path) -> list[ShardInfo]:
    shards = []
    for number, entry in enumerate(json_field(raw, "shards", list, source=path)):
        try:
            shards.append(ShardInfo.from_json(entry))
        except TypeError as err:
            name = f" ({entry['path']})" if isinstance(entry, dict) and isinstance(entry.get("path"), str) else ""
            raise UserInputError(f"{path}: key 'shards.{number}'{name}: {err}; re-run `leantrain prepare`") from None
    return shards


def write_split_shards(
    data_dir: Path,
    *,
    split: str,
    source: str,
    docs: Iterable[Sequence[int] | np.ndarray | tuple[np.ndarray, ...]],
    dtype: type[np.number],
    shard_size_tokens: int,
    first_number: int = 0,
    on_shard: Callable[[ShardInfo], None] | None = None,
    open_writer: Callable[[Path], Any] | None = None,
) -> list[ShardInfo]:
    """Write documents (EOS already appended) into shards of about `shard_size_tokens` each.

    A shard is closed after the document that reaches the size, so a document never spans shards and the
    cut points depend only on the documents (a resumed run cuts the same shards). `on_shard` is called after
    each shard is published (the pipeline logs it for crash-resume). Numbering starts at `first_number`.
    `open_writer(prefix)` makes the writer of one shard (default: a ShardWriter of `dtype`); a tuple document
    is passed to its `add` as separate arrays (the chat path's (ids, mask) pairs and its MaskedShardWriter).
    """
    infos: list[ShardInfo] = []
    writer: Any = None
    opener = open_writer or (lambda prefix: ShardWriter(prefix, dtype=dtype))
    try:
        for doc in docs:
            if writer is None:
                writer = opener(data_dir / shard_prefix(split, source, first_number + len(infos)))
            if isinstance(doc, tuple):
                writer.add(*(np.asarray(part) for part in doc))
            else:
                writer.add(np.asarray(doc))
            if writer.num_tokens >= shard_size_tokens:
                infos.append(_close(writer, data_dir=data_dir, split=split, source=source, on_shard=on_shard))
                writer = None
        if writer is not None:
            infos.append(_close(writer, data_dir=data_dir, split=split, source=source, on_shard=on_shard))
            writer = None
    finally:
        if writer is not None:
            writer.abort()
    return infos


def _close(
    writer: Any, *, data_dir: Path, split: str, source: str, on_shard: Callable[[ShardInfo], None] | None
) -> ShardInfo:
    bin_sha, idx_sha, num_bytes = writer.finish()
    info = ShardInfo(
        path=writer.bin_path.relative_to(data_dir).as_posix(), split=split, source=source, sha256=bin_sha,
        idx_sha256=idx_sha, num_tokens=writer.num_tokens, num_docs=writer.num_docs, num_bytes=num_bytes,
        max_token_id=getattr(writer, "max_token_id", None),  # a ShardWriter's; a writer that does not track it: none
    )
    if on_shard is not None:
        on_shard(info)
    return info


def write_token_data_dir(
    path: Path,
    docs_by_source: Mapping[str, Sequence[Sequence[int]]],
    *,
    vocab_size: int,
    eos_id: int,
    weights: Mapping[str, float] | None = None,
    valid_docs_by_source: Mapping[str, Sequence[Sequence[int]]] | None = None,
    stages: Sequence[MixtureStage] = (),
    shard_size_tokens: int = 1 << 20,
) -> Manifest:
    """Build a data dir straight from token lists (for tests and tools; no cleaning, no tokenizer file).

    Each document is a list of token ids *without* EOS; EOS (`eos_id`) is appended after every document,
    as `prepare` does. `weights` defaults to 1 per source. Returns the manifest it wrote.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    shards: list[ShardInfo] = []
    sources: list[dict[str, Any]] = []
    for name, docs in docs_by_source.items():
        splits = {"train": docs, "valid": (valid_docs_by_source or {}).get(name, [])}
        tokens_by_split = {}
        for split, split_docs in splits.items():
            with_eos = [[*doc, eos_id] for doc in split_docs]
            shards += write_split_shards(
                path, split=split, source=name, docs=with_eos, dtype=dtype, shard_size_tokens=shard_size_tokens
            )
            tokens_by_split[split] = sum(len(d) for d in with_eos)
        weight = float((weights or {}).get(name, 1.0))
        sources.append({"name": name, "weight": weight, "tokens": tokens_by_split})
    manifest = Manifest(
        vocab_size=vocab_size, eos_id=eos_id, dtype=np.dtype(dtype).name, sources=sources, shards=shards,
        stages=list(stages),
    )
    manifest.write(path)
    return manifest


def check_not_data_dir(run_dir: Path, *, given: bool) -> None:
    """Refuse, before anything is written, a run dir that `prepare` wrote (its manifest.json): the run's files
    would mix with the data's. `given`: named by --run-dir (else the spec's run.dir)."""
    if (Path(run_dir) / MANIFEST).is_file():
        raise UserInputError(f"{'--run-dir' if given else 'run.dir'} {run_dir} holds prepared data ({MANIFEST}): "
                             "give the run a dir of its own")
