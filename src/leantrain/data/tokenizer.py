"""The tokenizer: byte-level BPE trained with HF `tokenizers`, a given tokenizer.json, or plain bytes.

Byte-level BPE (GPT-2 style pre-tokenizer, no normaliser) round-trips any UTF-8 text exactly, Chinese
included, which is what lets a test decode the shards back to the cleaned documents. The EOS token is a
special token; the redaction placeholders (<EMAIL>, ...) are added as whole tokens so a placeholder never
splits into pieces that the model could learn to complete.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from leantrain.data.pii import PLACEHOLDERS
from leantrain.data.shards import atomic_write_bytes
from leantrain.errors import UserInputError
from leantrain.spec.schema import TokenizerSpec

NUM_BYTES = 256


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    path: str
    sha256: str
    vocab_size: int  # the ids it can emit: its largest id + 1 (`id_range`), what the embedding needs and dtype holds
    eos_id: int
    eos_token: str
    kind: str


def _byte_level(spec: TokenizerSpec, texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[spec.eos_token], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2, show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(p, normalized=False, single_word=False) for p in PLACEHOLDERS.values()])
    return tokenizer


def id_range(tokenizer: Tokenizer) -> int:
    """How many ids the tokenizer can emit: its largest id (vocabulary or added token) + 1. That is its token
    count unless its ids have gaps (a tokenizer.json with tokens removed: 512 tokens with ids up to 1104); the
    model's embedding needs this many rows, and the shards' dtype must hold the largest id."""
    return max(tokenizer.get_vocab_size(), max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1)


def build_tokenizer(spec: TokenizerSpec, texts: Iterator[str], *, out_path: Path) -> TokenizerInfo:
    """Train (bpe), copy (file) or build (byte) the tokenizer, write it atomically to `out_path`."""
    if spec.kind == "file":
        assert spec.path is not None, "validated by the spec"
        try:
            tokenizer = Tokenizer.from_file(str(spec.path))
        except Exception as err:  # tokenizers raises plain Exception subclasses for bad files
            raise UserInputError(f"data.tokenizer.path: cannot load {spec.path}: {err}") from None
    elif spec.kind == "byte":
        tokenizer = _byte_level(spec, iter([""]), vocab_size=NUM_BYTES + 1)
    else:
        if spec.vocab_size < NUM_BYTES + 1 + len(PLACEHOLDERS):
            raise UserInputError(
                f"data.tokenizer.vocab_size ({spec.vocab_size}) must exceed the 256 byte tokens, EOS and "
                f"{len(PLACEHOLDERS)} placeholders ({NUM_BYTES + 1 + len(PLACEHOLDERS)})"
            )
        tokenizer = _byte_level(spec, texts, vocab_size=spec.vocab_size - len(PLACEHOLDERS))
    eos_id = tokenizer.token_to_id(spec.eos_token)
    if eos_id is None:
        raise UserInputError(f"data.tokenizer.eos_token {spec.eos_token!r} is not in the tokenizer's vocabulary")
    data = tokenizer.to_str().encode("utf-8")
    atomic_write_bytes(out_path, data)
    return TokenizerInfo(path=out_path.name, sha256=hashlib.sha256(data).hexdigest(),
                         vocab_size=id_range(tokenizer), eos_id=eos_id, eos_token=spec.eos_token,
                         kind=spec.kind)


def load_info(path: Path, spec: TokenizerSpec) -> tuple[Tokenizer, TokenizerInfo]:
    """Reopen a tokenizer.json written by `build_tokenizer` (resume) with its manifest record."""
    data = path.read_bytes()
    tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    eos_id = tokenizer.token_to_id(spec.eos_token)
    assert eos_id is not None, "a tokenizer we wrote has its EOS"
    info = TokenizerInfo(path=path.name, sha256=hashlib.sha256(data).hexdigest(),
                         vocab_size=id_range(tokenizer), eos_id=eos_id, eos_token=spec.eos_token,
                         kind=spec.kind)
    return tokenizer, info
