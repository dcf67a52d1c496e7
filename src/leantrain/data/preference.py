"""Preference pairs (`data.sources[].format: preference`) for `finetune.method: dpo`: records → a chosen and a
rejected sequence with loss masks on their responses, laid out so the sampler hands out whole pairs.

Records (JSONL, one pair per line), TRL's three layouts:
- strings: `{"prompt": "...", "chosen": "...", "rejected": "..."}` (a user turn, then one assistant answer each);
- messages: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`;
- conversations: `{"chosen": [messages], "rejected": [messages]}`: the messages both share from the start are the
  prompt, the rest are the responses.
Each response ends with an assistant turn with content; a bad record is an error naming file:line and the field.

Cleaning (data/chat_prepare.py): every message normalised and PII-redacted on its own, exact and near dedup on
the pair's joined text, as for chat sources.

Encoding: prompt + chosen and prompt + rejected are rendered with the chat template (data/chat.py, the
tokenizer's own BOS/EOS); the mask is 1 on the response's assistant tokens only (its end token included,
never an earlier answer of a multi-turn prompt). A pair longer than `seq_len + 1` tokens loses the start of
its prompt first (the same tokens on both sides, down to half the window: the turn before the response
stays), then the end of its longer response; each sequence is padded with EOS (mask 0) to exactly
`seq_len + 1`: one pair is one document of `2 (seq_len + 1)` tokens, chosen then rejected. The manifest's
source entry says `preference: true`, `pair_seq_len` and `pad_multiple` = 2 (seq_len + 1).

Sampling (`PairBatchSampler`): the packed sampler with windows of 2 (seq_len + 1) tokens starts every
window at a pair's first token (documents are whole multiples of the window), so each window is one pair;
a micro-batch of `micro_batch` rows is micro_batch / 2 pairs, their chosen rows first, then their rejected
rows, each row seq_len + 1 tokens (inputs `[:-1]`, targets `[1:]`). The position is the packed sampler's
global sample index (one per pair): resumes and world-size changes work as for every other source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from leantrain.data.chat import ROLES, ChatRenderer, parse_record
from leantrain.data.layout import Manifest, load_manifest
from leantrain.errors import UserInputError

if TYPE_CHECKING:  # the pair sampler is the trainer's (torch); `prepare` imports this module without torch
    import torch

    from leantrain.data.sampler import Batch

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Pair:
    """A prompt and its two responses, as messages."""

    prompt: Messages
    chosen: Messages
    rejected: Messages

    def to_json(self) -> dict[str, Messages]:
        return {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected}

    def messages(self) -> Messages:
        """Every message (prompt, chosen, rejected), in that order: what cleaning and PII redaction walk over."""
        return [*self.prompt, *self.chosen, *self.rejected]


def pair_window(seq_len: int) -> int:
    """Tokens of one pair on disk: chosen and rejected, each seq_len + 1 (seq_len inputs and targets)."""
    return 2 * (seq_len + 1)


def masked_source_entry(fmt: str, *, seq_len: int) -> dict[str, Any]:
    """What a manifest's source entry says about a masked source (chat or preference)."""
    if fmt == "preference":
        return {"loss_mask": True, "pad_multiple": pair_window(seq_len), "preference": True, "pair_seq_len": seq_len}
    return {"loss_mask": True, "pad_multiple": seq_len}


def _messages(value: Any, *, where: str, field: str, role: str | None) -> Messages:
    """A field that is a string (one message of `role`) or a list of {role, content} messages."""
    if isinstance(value, str) and role is not None:
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise UserInputError(f"{where}: field '{field}' must be a string or a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            raise UserInputError(f"{where}: field '{field}[{i}]' needs a role in {', '.join(ROLES)} and a string "
                                 "content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_preference(record: Any, *, where: str) -> Pair:
    """The pair of one preference record (module docstring); UserInputError names `where` and the field."""
    if not isinstance(record, dict):
        raise UserInputError(f"{where}: a preference record must be a JSON object, got {type(record).__name__}")
    if "chosen" not in record or "rejected" not in record:
        raise UserInputError(f"{where}: a preference record needs fields 'chosen' and 'rejected' (and 'prompt' "
                             "unless they are whole conversations)")
    if "prompt" in record:
        prompt = _messages(record["prompt"], where=where, field="prompt", role="user")
        chosen = _messages(record["chosen"], where=where, field="chosen", role="assistant")
        rejected = _messages(record["rejected"], where=where, field="rejected", role="assistant")
    else:
        full_chosen = _messages(record["chosen"], where=where, field="chosen", role=None)
        full_rejected = _messages(record["rejected"], where=where, field="rejected", role=None)
        # The common first messages are the prompt, but each side keeps at least its last message: a pair whose
        # conversations are equal is a tie (dropped as tied_pair when prepared), not a pair without responses.
        shared, limit = 0, min(len(full_chosen), len(full_rejected)) - 1
        while shared < limit and full_chosen[shared] == full_rejected[shared]:
            shared += 1
        if shared == 0:
            raise UserInputError(f"{where}: fields 'chosen' and 'rejected' share no prompt (no common first "
                                 "message); give a 'prompt' field")
        prompt, chosen, rejected = full_chosen[:shared], full_chosen[shared:], full_rejected[shared:]
    for field, response in (("chosen", chosen), ("rejected", rejected)):
        if not response or response[-1]["role"] != "assistant" or not response[-1]["content"].strip():
            raise UserInputError(f"{where}: field '{field}' must end with an assistant turn with content")
    parse_record({"messages": [*prompt, *chosen]}, where=where)  # the same message rules as a chat record
    return Pair(prompt=prompt, chosen=chosen, rejected=rejected)


def pair_from_messages(messages: Messages, *, sizes: tuple[int, int, int]) -> Pair:
    """The Pair whose `messages()` is `messages`, cut at (prompt, chosen, rejected) lengths."""
    prompt, chosen = sizes[0], sizes[0] + sizes[1]
    return Pair(prompt=messages[:prompt], chosen=messages[prompt:chosen], rejected=messages[chosen:])


def _fit(ids: np.ndarray, mask: np.ndarray, *, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut to `length` tokens (keeping the start) or pad with `pad_id` (mask 0) to it."""
    ids, mask = ids[:length], mask[:length]
    extra = length - len(ids)
    return (np.concatenate([ids, np.full(extra, pad_id, dtype=ids.dtype)]),
            np.concatenate([mask, np.zeros(extra, dtype=np.uint8)]))


def encode_pair(renderer: ChatRenderer, pair: Pair, *, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask), both (2 (seq_len + 1),): chosen then rejected, masks on the responses' assistant tokens.

    A sequence longer than seq_len + 1 first loses the start of the prompt (the same tokens in both, so the
    prompts stay equal; at least half the window stays prompt), then the end of its response."""
    answers_before = sum(m["role"] == "assistant" for m in pair.prompt)
    encoded = [renderer.encode([*pair.prompt, *response], skip_answers=answers_before)
               for response in (pair.chosen, pair.rejected)]
    length = seq_len + 1
    overflow = max(len(ids) for ids, _ in encoded) - length
    if overflow > 0:
        prompt = min(int(np.argmax(mask)) if mask.any() else len(mask) for _, mask in encoded)
        cut = min(overflow, max(0, prompt - length // 2))  # the prompt keeps at least half the window
        encoded = [(ids[cut:], mask[cut:]) for ids, mask in encoded]
    halves = [_fit(ids, mask, length=length, pad_id=renderer.eos_id) for ids, mask in encoded]
    return np.concatenate([halves[0][0], halves[1][0]]), np.concatenate([halves[0][1], halves[1][1]])


class PairBatchSampler:
    """Micro-batches of whole preference pairs: `micro_batch` rows = micro_batch / 2 pairs, chosen rows first.

    The same constructor and state as PackedBatchSampler (whose global sample index counts pairs here)."""

    def __init__(self, data_dir: Path, *, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int,
                 split: str = "train", manifest: Manifest | None = None) -> None:
        if micro_batch % 2:
            raise UserInputError(f"training.micro_batch ({micro_batch}) must be even under finetune.method dpo: "
                                 "each pair is a chosen and a rejected sequence")
        given = {} if manifest is None else {"manifest": manifest}  # the trainer's copy, read once (rank 0)
        manifest = manifest if manifest is not None else load_manifest(Path(data_dir))
        for entry in manifest.sources:
            if not entry.get("preference"):
                raise UserInputError(f"{data_dir}: source {entry['name']} is not preference data (format: "
                                     "preference); finetune.method dpo trains on preference pairs only")
            if entry.get("pair_seq_len") != seq_len:
                raise UserInputError(f"{data_dir}: source {entry['name']} was prepared for data.seq_len "
                                     f"{entry.get('pair_seq_len')}, the run has {seq_len}; re-run `leantrain prepare`")
        from leantrain.data.sampler import PackedBatchSampler

        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.pairs = PackedBatchSampler(data_dir, seq_len=pair_window(seq_len), micro_batch=micro_batch // 2,
                                        dp_rank=dp_rank, dp_size=dp_size, seed=seed, split=split, **given)
        self.source_names, self.vocab_size, self.eos_id = (self.pairs.source_names, self.pairs.vocab_size,
                                                           self.pairs.eos_id)
        self.has_loss_mask = True

    @property
    def global_sample_index(self) -> int:
        return self.pairs.global_sample_index

    def tokens_per_epoch(self) -> dict[str, int]:
        return self.pairs.tokens_per_epoch()

    def next_batch(self) -> Batch:
        import torch

        from leantrain.data.sampler import Batch

        batch = self.pairs.next_batch()  # (pairs, 2 (seq_len + 1) + 1): one pair and the next pair's first token
        half = self.seq_len + 1

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            return torch.cat([tensor[:, :half], tensor[:, half:2 * half]])

        assert batch.loss_mask is not None, "preference sources carry masks"
        return Batch(tokens=rows(batch.tokens), source_ids=rows(batch.source_ids), loss_mask=rows(batch.loss_mask))

    def state_dict(self) -> dict:
        return self.pairs.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pairs.load_state_dict(state)
