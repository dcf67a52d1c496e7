"""Chat / instruction data (`data.sources[].format: chat`): records → rendered tokens + a loss mask on assistant tokens.

Records (JSONL, one conversation per line):
- OpenAI style: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}`;
- pairs: `{"prompt": "...", "response": "..."}` (a user turn, then an assistant turn).
A record without an assistant turn with content is an error naming the file, the line and the field.

Rendering: the model's chat template (`chat_template` in the tokenizer_config.json beside the tokenizer, a
Jinja template as transformers uses), else `DEFAULT_TEMPLATE` (ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n`),
with the tokenizer's own `bos_token` and `eos_token` (from the same tokenizer_config.json), so a Llama-2 or
Mistral template that ends each answer with `{{ eos_token }}` trains that end token and starts with its BOS.
The assistant part of the render (what the model must produce; mask 1) is found in one of two ways:
- the template marks it with `{% generation %}…{% endgeneration %}` (transformers' convention for
  `return_assistant_tokens_mask`): exactly the text inside the markers;
- otherwise turn by turn: for each assistant turn the text up to and including the generation prompt (e.g.
  `<|im_start|>assistant\\n`) is prompt, and what the full render adds after it (the content and the
  end-of-turn marker or EOS) is the assistant part.
Each part is tokenized on its own (no special tokens added: the template writes BOS/EOS) and the mask is 1
exactly on the assistant parts' tokens: the model learns to write answers and to end them, never the user's
words or the template's headers.

Packing: padding, not cross-document attention. Each conversation (EOS appended, mask 0 there, unless the
render already ends with EOS) is padded with EOS to a multiple of `pad_multiple` = data.seq_len, mask 0 on
the padding. The sampler's windows start at multiples of seq_len of each source's stream, so every window's
inputs lie inside one conversation: no attention mask is needed and no conversation sees another. A
conversation longer than seq_len spans several windows (as a long pre-training document does).

On disk: beside each shard's `.bin`/`.idx` a `.mask` file holds one byte per token (1: the token is a loss
target), in the same order; docs/data.md describes it. The manifest's source entry says `loss_mask: true`
and `pad_multiple`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension

from leantrain.data.layout import Manifest, shard_prefix
from leantrain.data.shards import ShardInfo, ShardWriter, token_dtype
from leantrain.errors import UserInputError

DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")
MASKED_FORMATS = ("chat", "preference")  # sources rendered with the chat template, with a loss mask per token
MASK_SUFFIX = ".mask"


def parse_record(record: Any, *, where: str) -> list[dict[str, str]]:
    """The messages of one chat record; UserInputError names `where` (file:line) and the field."""
    if not isinstance(record, dict):
        raise UserInputError(f"{where}: a chat record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserInputError(f"{where}: field 'messages' must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                    message.get("content"), str):
                raise UserInputError(f"{where}: field 'messages[{i}]' needs a role in {', '.join(ROLES)} and a "
                                     "string content")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    elif "prompt" in record or "response" in record:
        prompt, response = record.get("prompt"), record.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise UserInputError(f"{where}: fields 'prompt' and 'response' must both be strings")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        raise UserInputError(f"{where}: a chat record needs field 'messages' (or 'prompt' and 'response')")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise UserInputError(f"{where}: field 'messages' has no assistant turn with content (nothing to learn)")
    return messages


class ChatTemplate(NamedTuple):
    """A chat template with the special-token strings it is rendered with (a tuple: JSON- and pickle-friendly)."""

    template: str
    bos_token: str = ""
    eos_token: str = ""


def _token_text(value: Any) -> str:
    """A tokenizer_config.json special token: a string or transformers' AddedToken dict (its `content`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def template_for(tokenizer_path: Path | None) -> ChatTemplate:
    """The chat template of the tokenizer beside `tokenizer_path`, found as transformers finds it: the files
    `chat_template.jinja` (the default) and `additional_chat_templates/NAME.jinja` first (what `save_pretrained`
    writes since transformers 4.50), else tokenizer_config.json's `chat_template` (a string, or a list of named
    ones); of several, the one named "default". BOS/EOS strings come from tokenizer_config.json. Without any
    template there, the default (ChatML). Several templates and none named default is refused (transformers
    refuses it too), naming the folder and the names; so is a tokenizer_config.json that is not JSON."""
    if tokenizer_path is None:
        return ChatTemplate(DEFAULT_TEMPLATE)
    folder = Path(tokenizer_path).parent
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise UserInputError(f"{config_path}: not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise UserInputError(f"{config_path}: expected a JSON object")
    templates = {path.stem: path for path in sorted((folder / "additional_chat_templates").glob("*.jinja"))}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = folder / "chat_template.jinja"
    named: dict[str, str] = {name: path.read_text(encoding="utf-8") for name, path in templates.items()}
    if not named:  # the files take priority over the config's entries, as in transformers
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t["name"]: t["template"] for t in template
                     if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        elif isinstance(template, str):
            named = {"default": template}
    if not named:
        return ChatTemplate(DEFAULT_TEMPLATE)
    if "default" not in named:
        raise UserInputError(f"{folder}: the tokenizer has chat templates {', '.join(sorted(named))} and none named "
                             "default: write the one to train with as chat_template.jinja there")
    chat = ChatTemplate(named["default"], bos_token=_token_text(config.get("bos_token")),
                        eos_token=_token_text(config.get("eos_token")))
    try:  # a template that does not compile is said before prepare cleans and deduplicates the corpus
        ChatRenderer(None, template=chat, eos_id=0)
    except UserInputError as err:
        source = templates.get("default", config_path)
        raise UserInputError(f"{source}: {err}") from None
    return chat


# Private-use code points that wrap the output of a `{% generation %}` block while the mask is computed.
GEN_START, GEN_END = "\ue000", "\ue001"


class _GenerationBlocks(Extension):
    """`{% generation %}…{% endgeneration %}`: renders its body; when the render sets `leantrain_mark_generation`,
    wrapped in GEN_START/GEN_END so the assistant text can be cut out of the rendered conversation."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        mark = nodes.Name("leantrain_mark_generation", "load")
        return nodes.CallBlock(self.call_method("_wrap", [mark]), [], [], body).set_lineno(lineno)

    def _wrap(self, mark: Any, caller: Any) -> str:
        text = caller()
        return f"{GEN_START}{text}{GEN_END}" if mark is True else text


class ChatRenderer:
    """Renders conversations with a Jinja chat template and tokenizes them with the loss mask."""

    def __init__(self, tokenizer: Any, *, template: str | ChatTemplate = DEFAULT_TEMPLATE, eos_id: int) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise UserInputError(f"chat template: {message}")

        def strftime_now(format: str) -> str:  # some templates (Llama 3.1) print today's date
            return datetime.now().strftime(format)

        chat = template if isinstance(template, ChatTemplate) else ChatTemplate(template)
        # transformers' settings for chat templates (trim/lstrip blocks, loop controls, its two globals)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlocks, loopcontrols])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            self.template = env.from_string(chat.template)
        except TemplateSyntaxError as err:
            raise UserInputError(f"chat template: line {err.lineno}: {err.message}") from None
        self.marks_generation = "{% generation" in chat.template or "{%- generation" in chat.template
        self.bos_token, self.eos_token = chat.bos_token, chat.eos_token
        self.tokenizer, self.eos_id = tokenizer, eos_id

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False,
               mark_generation: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token,
                                        leantrain_mark_generation=mark_generation)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:  # the template's own code
            raise UserInputError(f"chat template: failed on this record: {type(err).__name__}: {err}") from None

    def segments(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        """The rendered text cut into (text, is_assistant) pieces, in order."""
        if self.marks_generation:
            return self._marked_segments(messages)
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[: i + 1])
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise UserInputError("chat template: rendering is not incremental (a turn changes earlier text); "
                                     "use a template whose output only grows with each message, or mark the "
                                     "answers with {% generation %}…{% endgeneration %}")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        rest = self.render(messages)[len(done):]
        return [p for p in [*pieces, (rest, False)] if p[0]]

    def _marked_segments(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        if any(GEN_START in m["content"] or GEN_END in m["content"] for m in messages):
            raise UserInputError("chat record: a message holds a private-use character U+E000/U+E001")
        pieces: list[tuple[str, bool]] = []
        for i, chunk in enumerate(self.render(messages, mark_generation=True).split(GEN_START)):
            inside, _, after = chunk.rpartition(GEN_END) if i else ("", "", chunk)
            pieces += [(inside, True), (after, False)]
        return [p for p in pieces if p[0]]

    def encode(self, messages: list[dict[str, str]], *, skip_answers: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(token ids ending in EOS, mask uint8 with 1 on assistant tokens), both (n,): EOS (mask 0) is
        appended unless the render already ends with it. The first `skip_answers` assistant turns are not
        targets (a preference pair's prompt)."""
        ids: list[int] = []
        mask: list[int] = []
        segments = self.segments(messages)
        if skip_answers and sum(a for _, a in segments) != sum(m["role"] == "assistant" for m in messages):
            raise UserInputError("chat template: its {% generation %} blocks do not mark each assistant turn "
                                 "once, so a multi-turn prompt's answers cannot be told from the response")
        answer = 0
        for text, assistant in segments:
            piece = self.tokenizer.encode(text, add_special_tokens=False).ids
            ids += piece
            mask += [int(assistant and answer >= skip_answers)] * len(piece)
            answer += int(assistant)
        if not ids or ids[-1] != self.eos_id:
            ids.append(self.eos_id)
            mask.append(0)
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def pad_to_multiple(ids: np.ndarray, mask: np.ndarray, *, multiple: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad a conversation with `pad_id` (mask 0) to a multiple of `multiple` tokens."""
    extra = (-len(ids)) % multiple
    return (np.concatenate([ids, np.full(extra, pad_id, dtype=ids.dtype)]),
            np.concatenate([mask, np.zeros(extra, dtype=np.uint8)]))


def mask_path(bin_path: Path) -> Path:
    return Path(bin_path).with_suffix(MASK_SUFFIX)


def load_mask(bin_path: Path) -> np.ndarray | None:
    """The memory-mapped mask of a shard (None for a shard without one: every token is a target)."""
    path = mask_path(bin_path)
    if not path.is_file():
        return None
    return np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, dtype=np.uint8)


@dataclass
class MaskedShardWriter:
    """A ShardWriter plus the `.mask` file beside it (same documents, one byte per token)."""

    writer: ShardWriter

    @property
    def bin_path(self) -> Path:
        return self.writer.bin_path

    @property
    def num_tokens(self) -> int:
        return self.writer.num_tokens

    @property
    def num_docs(self) -> int:
        return self.writer.num_docs

    @property
    def max_token_id(self) -> int | None:
        """The shard's largest token id, for the manifest (the trainer checks it against the model at start)."""
        return self.writer.max_token_id

    def __post_init__(self) -> None:
        self._mask_tmp = mask_path(self.writer.bin_path).with_suffix(".mask.tmp")
        self._mask = open(self._mask_tmp, "wb")  # noqa: SIM115 - closed in finish/abort

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        assert len(ids) == len(mask), "one mask byte per token"
        self.writer.add(ids)
        self._mask.write(np.asarray(mask, dtype=np.uint8).tobytes())

    def finish(self) -> tuple[str, str, int]:
        """Publish the mask first, then the shard (whose .idx is the shard's commit point)."""
        self._mask.flush()
        os.fsync(self._mask.fileno())
        self._mask.close()
        os.replace(self._mask_tmp, mask_path(self.writer.bin_path))
        return self.writer.finish()

    def abort(self) -> None:
        self._mask.close()
        self._mask_tmp.unlink(missing_ok=True)
        self.writer.abort()


def write_chat_split(
    data_dir: Path, *, split: str, source: str, docs: Iterable[tuple[np.ndarray, np.ndarray]],
    dtype: type[np.number], first_number: int = 0,
) -> list[ShardInfo]:
    """One shard of (already padded) conversations with its mask; returns its ShardInfo (none when empty)."""
    items = list(docs)
    if not items:
        return []
    prefix = data_dir / shard_prefix(split, source, first_number)
    writer = MaskedShardWriter(ShardWriter(prefix, dtype=dtype))
    try:
        for ids, mask in items:
            writer.add(ids, mask)
        bin_sha, idx_sha, num_bytes = writer.finish()
    except BaseException:
        writer.abort()
        raise
    inner = writer.writer
    return [ShardInfo(path=inner.bin_path.relative_to(data_dir).as_posix(), split=split, source=source,
                      sha256=bin_sha, idx_sha256=idx_sha, num_tokens=inner.num_tokens, num_docs=inner.num_docs,
                      num_bytes=num_bytes, max_token_id=inner.max_token_id)]


def write_chat_data_dir(
    path: Path, conversations_by_source: Mapping[str, Sequence[list[dict[str, str]]]], *, renderer: ChatRenderer,
    vocab_size: int, seq_len: int, valid_by_source: Mapping[str, Sequence[list[dict[str, str]]]] | None = None,
    weights: Mapping[str, float] | None = None,
) -> Manifest:
    """A data dir of chat sources straight from conversations (for tests and tools: no cleaning)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    shards: list[ShardInfo] = []
    sources: list[dict[str, Any]] = []
    for name, conversations in conversations_by_source.items():
        tokens: dict[str, int] = {}
        for split, convs in (("train", conversations), ("valid", (valid_by_source or {}).get(name, []))):
            docs = [pad_to_multiple(*renderer.encode(c), multiple=seq_len, pad_id=renderer.eos_id) for c in convs]
            shards += write_chat_split(path, split=split, source=name, docs=docs, dtype=dtype)
            tokens[split] = sum(len(ids) for ids, _ in docs)
        sources.append({"name": name, "weight": float((weights or {}).get(name, 1.0)), "tokens": tokens,
                        "loss_mask": True, "pad_multiple": seq_len})
    manifest = Manifest(vocab_size=vocab_size, eos_id=renderer.eos_id, dtype=np.dtype(dtype).name,
                        sources=sources, shards=shards, stages=[])
    manifest.write(path)
    return manifest

