"""`prepare` for chat and preference sources (`format: chat | preference`): cleaning, encoding with the loss
mask, shards with masks.

The parallel pipeline (data/pipeline.py, data/tasks.py) calls these where a chat source differs from text
(reading is data/readers.py's `chat` reader):
- `chat_candidate`: each message normalised and PII-redacted on its own; exact and near dedup over the
  conversation's joined text, like any document. The quality filters are not applied: they are calibrated
  for web text, and short answers or code replies are what chat data is made of.
- `encode_rows`: rendered with the chat template, masked, padded to a multiple of data.seq_len (chat.py); a
  preference pair as one chosen + rejected document (preference.py).
- `task_masked_docs` / `write_masked_split_shards`: like the text path, with the `.mask` beside each shard.
- `with_model_tokenizer`: with `model.init_from` and no `data.tokenizer` in the spec, prepare uses the
  checkpoint's tokenizer.json (its EOS from tokenizer_config.json), after checking it fits the embedding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from leantrain.data.chat import ChatRenderer, MaskedShardWriter, pad_to_multiple
from leantrain.data.clean import normalize, text_stats
from leantrain.data.dedup import MinHasher, Signatures, add_candidate_hashes
from leantrain.data.layout import write_split_shards
from leantrain.data.pii import PIIRedactor
from leantrain.data.preference import encode_pair, pair_from_messages
from leantrain.data.shards import ShardInfo, ShardWriter
from leantrain.errors import UserInputError
from leantrain.spec.schema import DataSpec, JobSpec


def chat_candidate(
    text: str, *, spec: DataSpec, counts: dict[str, Any], hasher: MinHasher, keys: list[bytes],
    signatures: Signatures, redactor: PIIRedactor | None, valid_cut: int,
) -> dict[str, Any] | None:
    """The row of one conversation (a JSON list of messages) or preference pair (a JSON object: prompt, chosen,
    rejected): normalised, redacted messages; its hashes appended to keys/signatures."""
    record = json.loads(text)
    pair = isinstance(record, dict)
    messages = [*record["prompt"], *record["chosen"], *record["rejected"]] if pair else record
    messages = [{"role": m["role"], "content": normalize(m["content"], form=spec.cleaning.normalization)}
                for m in messages]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        counts["drops"]["empty"] += 1
        return None
    if pair and messages[len(record["prompt"]):][:len(record["chosen"])] == messages[
            len(record["prompt"]) + len(record["chosen"]):]:
        counts["drops"]["tied_pair"] += 1  # chosen == rejected: DPO's loss is constant on it, its gradient zero
        return None
    stats = text_stats("\n".join(m["content"] for m in messages))
    split = add_candidate_hashes(stats, near=spec.dedup.near, hasher=hasher, keys=keys, signatures=signatures,
                                 valid_cut=valid_cut)
    pii: dict[str, int] = {}
    audit: list[list[Any]] = []
    if redactor is not None:
        before = redactor.counts.copy()
        for index, message in enumerate(messages):
            message["content"], rows = redactor(message["content"], doc_id="", source="")
            audit += [[r["type"], r["start"], r["end"], r["value_sha256"], index] for r in rows]
        pii = dict(redactor.counts - before)
    chars = sum(len(m["content"]) for m in messages)
    row = {"split": split, "messages": messages, "text": "", "chars": chars, "pii": pii, "audit": audit}
    if pair:  # the messages in pair order; the sizes cut them back into prompt, chosen, rejected
        row["pair_sizes"] = [len(record["prompt"]), len(record["chosen"]), len(record["rejected"])]
    return row


def encode_rows(rows: list[dict[str, Any]], *, renderer: ChatRenderer, pad_multiple: int
                ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) per chat row, padded to a multiple of `pad_multiple` = data.seq_len (EOS included, mask 0 on
    padding); a preference row is its pair laid out for that seq_len (data/preference.py)."""
    out = []
    for row in rows:
        try:
            if "pair_sizes" in row:
                pair = pair_from_messages(row["messages"], sizes=tuple(row["pair_sizes"]))
                out.append(encode_pair(renderer, pair, seq_len=pad_multiple))
            else:
                out.append(pad_to_multiple(*renderer.encode(row["messages"]), multiple=pad_multiple,
                                           pad_id=renderer.eos_id))
        except UserInputError as err:  # the template refused the record (raise_exception) or failed on it
            raise UserInputError(f"{row.get('id', 'a record')}: {err}") from None
    return out


def task_masked_docs(folder: Path, *, split: str, dtype: type[np.number]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One encode task's (tokens, mask) documents in order, read by memory map."""
    lengths = np.load(folder / f"{split}.len.npy")
    if not len(lengths):
        return
    tokens = np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r")
    masks = np.memmap(folder / f"{split}.mask", dtype=np.uint8, mode="r")
    ends = np.cumsum(lengths)
    for end, length in zip(ends.tolist(), lengths.tolist(), strict=True):
        yield tokens[end - length : end], masks[end - length : end]


def write_masked_split_shards(
    data_dir: Path, *, split: str, source: str, docs: Iterable[tuple[np.ndarray, np.ndarray]],
    dtype: type[np.number], shard_size_tokens: int, first_number: int = 0,
    on_shard: Callable[[ShardInfo], None] | None = None,
) -> list[ShardInfo]:
    """As layout.write_split_shards, writing each shard's `.mask` beside it."""
    return write_split_shards(
        data_dir, split=split, source=source, docs=docs, dtype=dtype, shard_size_tokens=shard_size_tokens,
        first_number=first_number, on_shard=on_shard,
        open_writer=lambda prefix: MaskedShardWriter(ShardWriter(prefix, dtype=dtype)),
    )


def _eos_token(config_path: Path) -> str | None:
    if not config_path.is_file():
        return None
    eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def with_model_tokenizer(spec: JobSpec) -> JobSpec:
    """The spec with data.tokenizer = init_from's tokenizer.json when the spec names none (else unchanged)."""
    init_from = spec.model.init_from
    if init_from is None or "tokenizer" in spec.data.model_fields_set:
        return spec
    path = Path(init_from) / "tokenizer.json"
    if not path.is_file():
        raise UserInputError(f"{path}: not found; model.init_from has no tokenizer, so name one in data.tokenizer")
    from tokenizers import Tokenizer

    from leantrain.data.tokenizer import id_range

    tokenizer = Tokenizer.from_file(str(path))
    num_ids = id_range(tokenizer)  # its largest id + 1: more than its token count when its ids have gaps
    if num_ids > spec.model.vocab_size:  # type: ignore[operator] # filled from config.json
        gaps = f" (ids up to {num_ids - 1})" if num_ids != tokenizer.get_vocab_size() else ""
        raise UserInputError(f"{path}: vocabulary of {tokenizer.get_vocab_size()} tokens{gaps} exceeds the embedding "
                             f"(vocab_size {spec.model.vocab_size} in {Path(init_from) / 'config.json'}): every "
                             "token id must be below it")
    eos = _eos_token(Path(init_from) / "tokenizer_config.json") or spec.data.tokenizer.eos_token
    tokenizer = spec.data.tokenizer.model_copy(update={"kind": "file", "path": path, "eos_token": eos})
    return spec.model_copy(update={"data": spec.data.model_copy(update={"tokenizer": tokenizer})})
