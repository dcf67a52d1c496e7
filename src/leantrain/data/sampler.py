"""The training sampler: a deterministic sequence of packed samples over a GLOBAL sample index.

Definitions (docs/data.md has the worked example):
- Source stream. Per source, each epoch is a seeded permutation of its documents (EOS-terminated; a keyed
  permutation evaluated pointwise, data.shuffle, so no rank holds a per-document order), laid end to end;
  epochs follow each other without a gap. Sample k of the source is the window
  [k·seq_len, k·seq_len + seq_len + 1) of that endless stream (inputs `[:-1]`, targets `[1:]`; neighbouring
  samples share one token, as in Megatron's GPTDataset). Documents are packed: a window may hold the end of
  one document, EOS, and the start of the next.
- Mixture. Global samples are cut into blocks of `BLOCK_SAMPLES`. A block holds a fixed count per source
  (largest-remainder rounding of the weights of the curriculum stage the block falls in), in a seeded order.
  So global index g maps to (source, source-local index) in O(number of stages), with no state.
- Ranks. Every `next_batch` consumes micro_batch × dp_size global samples; rank r takes the r-th block of
  micro_batch. The state is one integer (the next global index), so a resume at another dp_size continues
  the same global sequence.
Shards are read through np.memmap, opened when a sample first touches them; the document index is the data
dir's memory-mapped `index/` (data.sample_index). The only Python loop is over the few documents a window touches.
"""

from __future__ import annotations

import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from leantrain.data.chat import load_mask, mask_path
from leantrain.data.layout import MANIFEST, Manifest, MixtureStage, load_manifest
from leantrain.data.sample_index import load_buckets, load_index
from leantrain.data.shards import ShardInfo, check_token_file, map_tokens
from leantrain.data.shuffle import BLOCK_DOCS, EpochOrder
from leantrain.errors import UserInputError

BLOCK_SAMPLES = 1024  # granularity of the mixture: weights are honoured exactly per block, to 1/1024


@dataclass
class Batch:
    """One rank's micro-batch."""

    tokens: torch.Tensor  # (micro_batch, seq_len + 1) int64: inputs are [:, :-1], targets [:, 1:]
    source_ids: torch.Tensor  # (micro_batch, seq_len + 1) int64: index into sampler.source_names per token
    # (micro_batch, seq_len + 1) bool: the token is a loss target (chat: assistant tokens); None: all are
    loss_mask: torch.Tensor | None = None


def largest_remainder_counts(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (Hamilton's method, ties to lower index)."""
    share = weights / weights.sum() * total
    counts = np.floor(share).astype(np.int64)
    remainder = share - counts
    order = np.lexsort((np.arange(len(weights)), -remainder))
    counts[order[: total - int(counts.sum())]] += 1
    return counts


class SourceStream:
    """One source's endless, epoch-shuffled, packed token stream over its shards.

    Where each document lies comes from the data dir's memory-mapped index (`data.sample_index`); a shard's
    tokens (and loss mask) are opened on first use, so a rank opens only the shards its samples touch, and their
    sizes are checked against the manifest then (one stat each: a truncated shard is an error naming it).
    """

    def __init__(self, data_dir: Path, shards: list[ShardInfo], index: np.ndarray, *, name: str, seed: int,
                 seq_len: int, dtype: np.dtype, totals: np.ndarray, masked: bool = False) -> None:
        """`totals`: the index's bucket totals (`data.sample_index.load_buckets`)."""
        self.name = name
        self.seq_len = seq_len
        self._paths = [Path(data_dir) / s.path for s in shards]
        self._num_tokens = [s.num_tokens for s in shards]
        self._dtype = dtype
        self._tokens: dict[int, np.ndarray] = {}
        self._masked = masked  # chat sources: one mask byte per token, beside each shard
        self._masks: dict[int, np.ndarray] = {}
        self._seed = [seed, zlib.crc32(name.encode("utf-8"))]
        self.doc_shard, self.doc_start, self.doc_len = index[0], index[1], index[2]
        self._totals = totals
        self.tokens_per_epoch = int(self._totals.sum())
        self._epochs: OrderedDict[int, EpochOrder] = OrderedDict()

    def _shard_tokens(self, shard: int) -> np.ndarray:
        if shard not in self._tokens:
            self._tokens[shard] = map_tokens(self._paths[shard], dtype=self._dtype, num_tokens=self._num_tokens[shard])
        return self._tokens[shard]

    def _shard_mask(self, shard: int) -> np.ndarray:
        if shard not in self._masks:
            check_mask_file(self._paths[shard], num_tokens=self._num_tokens[shard], source=self.name)
            self._masks[shard] = load_mask(self._paths[shard])
        return self._masks[shard]

    def _epoch(self, epoch: int) -> EpochOrder:
        """One epoch's document order (data.shuffle: a keyed permutation and one offset per block of documents,
        not a per-document array), cached (two newest)."""
        if epoch not in self._epochs:
            self._epochs[epoch] = EpochOrder(self.doc_len, self._totals, [*self._seed, epoch])
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def sample(self, index: int, out: np.ndarray, mask_out: np.ndarray | None = None) -> None:
        """Fill `out` (seq_len + 1,) with source sample `index` (and `mask_out` with its loss mask: 1 everywhere
        for a source without masks)."""
        offset = index * self.seq_len
        epoch, within = divmod(offset, self.tokens_per_epoch)
        filled = 0
        need = len(out)
        while filled < need:
            order = self._epoch(epoch)
            block, pos = order.find(within)
            while block < order.blocks and filled < need:
                docs, ends = order.block(block)
                while pos < len(docs) and filled < need:
                    doc = int(docs[pos])
                    length = int(self.doc_len[doc])
                    skip = within - (int(ends[pos]) - length)
                    take = min(length - skip, need - filled)
                    start = int(self.doc_start[doc]) + skip
                    shard = int(self.doc_shard[doc])
                    out[filled : filled + take] = self._shard_tokens(shard)[start : start + take]
                    if mask_out is not None:
                        mask_out[filled : filled + take] = self._shard_mask(shard)[start : start + take] if (
                            self._masked) else 1
                    filled += take
                    within += take
                    pos += 1
                block, pos = block + 1, 0
            epoch, within = epoch + 1, 0


class MixtureSchedule:
    """Maps a global sample index to (source, source-local sample index); pure function of seed and stages."""

    def __init__(self, stages: list[tuple[int | None, np.ndarray]], *, seed: int) -> None:
        # stages: (end block exclusive or None, counts per source per block)
        self._stages = stages
        self._seed = seed
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source per slot, rank of the slot within its source, samples per source before this block)."""
        before = np.zeros(len(self._stages[0][1]), dtype=np.int64)
        start = 0
        for end, counts in self._stages:
            if end is None or block < end:
                break
            before += (end - start) * counts
            start = end
        if block not in self._blocks:
            labels = np.random.default_rng([self._seed, 0x5EED, block]).permutation(
                np.repeat(np.arange(len(counts)), counts)
            )
            ranks = np.zeros(len(labels), dtype=np.int64)
            for source in range(len(counts)):
                mask = labels == source
                ranks[mask] = np.arange(int(mask.sum()))
            self._blocks[block] = (labels, ranks)
            while len(self._blocks) > 4:
                self._blocks.popitem(last=False)
        labels, ranks = self._blocks[block]
        return labels, ranks, before + (block - start) * counts

    def locate(self, global_index: int) -> tuple[int, int]:
        block, slot = divmod(global_index, BLOCK_SAMPLES)
        labels, ranks, before = self._block(block)
        source = int(labels[slot])
        return source, int(before[source] + ranks[slot])


def _stage_counts(
    manifest: Manifest, *, names: list[str], available: np.ndarray, seq_len: int
) -> list[tuple[int | None, np.ndarray]]:
    stages = manifest.stages or [MixtureStage(weights={s["name"]: s["weight"] for s in manifest.sources})]
    out: list[tuple[int | None, np.ndarray]] = []
    for number, stage in enumerate(stages):
        unknown = sorted(set(stage.weights) - set(names))
        if unknown:
            raise UserInputError(f"mixture stage {number} names unknown sources {unknown}; sources: {names}")
        weights = np.array([float(stage.weights.get(n, 0.0)) for n in names]) * available
        if weights.sum() <= 0:
            raise UserInputError(f"mixture stage {number}: no source with data has a positive weight")
        end = None
        if stage.until_tokens is not None:
            end = int(np.ceil(stage.until_tokens / seq_len / BLOCK_SAMPLES))
        out.append((end, largest_remainder_counts(weights, BLOCK_SAMPLES)))
    ends = [e for e, _ in out[:-1]]
    if any(e is None for e in ends) or ends != sorted(ends):
        raise UserInputError("mixture stages: every stage but the last needs an increasing until_tokens")
    return out


class PackedBatchSampler:
    """This rank's view of the global packed-sample sequence (see the module docstring)."""

    def __init__(
        self, data_dir: Path, *, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int,
        split: str = "train", manifest: Manifest | None = None,
    ) -> None:
        """`manifest`: the data dir's, when the caller has it already (the trainer's rank 0 reads it once and
        hands it to the other ranks); else read from `data_dir`."""
        if not 0 <= dp_rank < dp_size:
            raise UserInputError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        manifest = manifest if manifest is not None else load_manifest(Path(data_dir))
        self.data_dir = Path(data_dir)
        self.seq_len, self.micro_batch, self.dp_rank, self.dp_size = seq_len, micro_batch, dp_rank, dp_size
        self.split = split
        self.source_names: list[str] = manifest.source_names
        self.vocab_size: int = manifest.vocab_size
        self.eos_id: int = manifest.eos_id
        self._streams: list[SourceStream | None] = []
        self.has_loss_mask = False  # some source (chat) trains only on masked tokens
        dtype = np.dtype(manifest.dtype)
        for name in self.source_names:
            shards = manifest.shards_for(split=split, source=name)
            masked = has_loss_mask(manifest, name=name, seq_len=seq_len, data_dir=self.data_dir)
            self.has_loss_mask = self.has_loss_mask or masked
            stream = None
            if shards:
                index = load_index(self.data_dir, split=split, shards=shards)
                totals = manifest.bucket_totals.get(f"{split}/{name}")  # rank 0's, with the manifest
                if totals is None or len(totals) != -(-index.shape[1] // BLOCK_DOCS):
                    totals = load_buckets(self.data_dir, split=split, shards=shards, index=index)
                stream = SourceStream(self.data_dir, shards, index, name=name, seed=seed, seq_len=seq_len,
                                      dtype=dtype, masked=masked, totals=totals)
            self._streams.append(stream if stream is not None and stream.tokens_per_epoch > 0 else None)
        available = np.array([s is not None for s in self._streams], dtype=np.float64)
        if not available.any():
            raise UserInputError(f"{self.data_dir}: no {split} tokens in any source; re-run `leantrain prepare`")
        counts = _stage_counts(manifest, names=self.source_names, available=available, seq_len=seq_len)
        self._schedule = MixtureSchedule(counts, seed=seed)
        self._position = 0

    @property
    def global_sample_index(self) -> int:
        """The next global sample index that the next `next_batch` (on rank 0) starts from."""
        return self._position

    def tokens_per_epoch(self) -> dict[str, int]:
        """Tokens of each source in this split (0 for a source without data here)."""
        return {n: (s.tokens_per_epoch if s else 0) for n, s in zip(self.source_names, self._streams, strict=True)}

    def sample(self, global_index: int) -> tuple[np.ndarray, int]:
        """Global sample `global_index`: its (seq_len + 1,) int64 tokens and its source id."""
        source, local = self._schedule.locate(global_index)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        stream = self._streams[source]
        assert stream is not None, "schedule gave a slot to a source without data"
        stream.sample(local, out)
        return out, source

    def next_batch(self) -> Batch:
        first = self._position + self.dp_rank * self.micro_batch
        tokens = np.empty((self.micro_batch, self.seq_len + 1), dtype=np.int64)
        sources = np.empty(self.micro_batch, dtype=np.int64)
        mask = np.empty(tokens.shape, dtype=np.uint8) if self.has_loss_mask else None
        for row in range(self.micro_batch):
            source, local = self._schedule.locate(first + row)
            stream = self._streams[source]
            assert stream is not None, "schedule gave a slot to a source without data"
            stream.sample(local, tokens[row], None if mask is None else mask[row])
            sources[row] = source
        self._position += self.micro_batch * self.dp_size
        source_ids = np.broadcast_to(sources[:, None], tokens.shape).copy()
        return Batch(tokens=torch.from_numpy(tokens), source_ids=torch.from_numpy(source_ids),
                     loss_mask=None if mask is None else torch.from_numpy(mask).bool())

    def state_dict(self) -> dict:
        return {"global_sample_index": self._position}

    def load_state_dict(self, state: dict) -> None:
        position = int(state["global_sample_index"])
        if position < 0:
            raise UserInputError(f"sampler state global_sample_index must be ≥ 0, got {position}")
        self._position = position


def check_token_ids(manifest: Manifest, data_dir: Path, *, model_vocab_size: int) -> None:
    """Refuse, once at start, data holding token ids that the model's embedding has no row for, from the largest
    id each shard's manifest entry records (`max_token_id`; no shard is read). A data dir written before that
    was recorded passes here; the trainer still compares its manifest's vocab_size with the model's."""
    recorded = [(s.max_token_id, s.path) for s in manifest.shards if s.max_token_id is not None]
    top, path = max(recorded, default=(-1, ""))
    if top >= model_vocab_size:
        raise UserInputError(
            f"{Path(data_dir) / MANIFEST}: shard {path} holds token ids up to {top} (its max_token_id), but "
            f"model.vocab_size is {model_vocab_size} and every id must be below it: the data was tokenized with a "
            f"larger vocabulary than the model has (the manifest's vocab_size: {manifest.vocab_size}). Raise "
            f"model.vocab_size to at least {top + 1}, or prepare the data with the model's tokenizer")


def check_mask_file(bin_path: Path, *, num_tokens: int, source: str) -> None:
    """A chat shard's `.mask` exists and holds one byte per token (one stat); else a user error naming it."""
    path = mask_path(bin_path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise UserInputError(f"{bin_path}: the source {source!r} has a loss mask but this shard's .mask is missing; "
                             "prepare the data dir again") from None
    if size != num_tokens:
        raise UserInputError(f"{path}: {size:,} bytes, expected one per token of the shard ({num_tokens:,}); prepare "
                             "the data dir again")


def check_shard_files(manifest: Manifest, data_dir: Path) -> None:
    """One stat of every shard (and loss mask) the manifest lists, against its counts: what the trainer's rank 0
    runs once at start beside reading the manifest (`train.shared_reads`), so that a damaged shard fails every
    rank there with its name, instead of the one rank whose batch first touches it mid-run while the others
    wait in the step's collectives. Nothing is opened or read; the sampler repeats the check when it maps a shard."""
    masked = {s["name"] for s in manifest.sources if s.get("loss_mask")}
    for shard in manifest.shards:
        bin_path = Path(data_dir) / shard.path
        check_token_file(bin_path, dtype=np.dtype(manifest.dtype), num_tokens=shard.num_tokens)
        if shard.source in masked:
            check_mask_file(bin_path, num_tokens=shard.num_tokens, source=shard.source)


def has_loss_mask(manifest: Manifest, *, name: str, seq_len: int, data_dir: Path) -> bool:
    """Does the source train on masked tokens only (a chat source: a `.mask` beside each shard, data/chat.py)?

    Chat conversations are padded to a multiple of `pad_multiple` tokens so that every window of seq_len
    tokens lies inside one conversation; that holds only when pad_multiple is a multiple of seq_len.
    """
    entry = next(s for s in manifest.sources if s["name"] == name)
    if not entry.get("loss_mask"):
        return False
    pad = int(entry.get("pad_multiple", 0))
    if pad % seq_len:
        raise UserInputError(f"{data_dir}/manifest.json: source {name!r} was prepared for data.seq_len {pad}, which "
                             f"is not a multiple of this run's data.seq_len {seq_len}; prepare it again")
    return True
