"""Chat data: records parsed (messages or prompt/response), rendered with the chat template, a loss mask that covers
exactly the assistant tokens, written beside the shards, carried by the sampler to the loss, and a LoRA run on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from leantrain.data.chat import (
    DEFAULT_TEMPLATE,
    ChatRenderer,
    ChatTemplate,
    parse_record,
    template_for,
    write_chat_data_dir,
)
from leantrain.data.sampler import PackedBatchSampler
from leantrain.errors import UserInputError
from leantrain.model.tiny_hf import CHATML_TEMPLATE, save_tokenizer

SEQ = 64
LLAMA_LIKE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
              "{% elif m['role'] == 'assistant' %} {{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(out)
    return out


def renderer(tokenizer_dir: Path, template: str = CHATML_TEMPLATE) -> ChatRenderer:
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return ChatRenderer(tokenizer, template=template, eos_id=tokenizer.token_to_id("<|endoftext|>"))


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]


def test_records_in_both_forms_and_without_an_assistant_turn() -> None:
    assert parse_record({"prompt": "hi", "response": "hello"}, where="f:1") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert parse_record({"messages": CONVERSATION}, where="f:1") == CONVERSATION
    with pytest.raises(UserInputError, match=r"chat.jsonl:3: field 'messages' has no assistant turn"):
        parse_record({"messages": [{"role": "user", "content": "hi"}]}, where="chat.jsonl:3")
    with pytest.raises(UserInputError, match=r"f:2: field 'messages\[0\]' needs a role"):
        parse_record({"messages": [{"role": "robot", "content": "x"}]}, where="f:2")
    with pytest.raises(UserInputError, match="needs field 'messages'"):
        parse_record({"text": "plain"}, where="f:4")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA_LIKE], ids=["chatml", "inst"])
def test_mask_covers_exactly_the_assistant_tokens(tokenizer_dir: Path, template: str) -> None:
    chat = renderer(tokenizer_dir, template)
    ids, mask = chat.encode(CONVERSATION)
    tokenizer = chat.tokenizer
    # Together the pieces are the whole rendered conversation (+ EOS unless it ends with one), nothing lost or added.
    rendered = chat.render(CONVERSATION)
    appended = "" if rendered.endswith("<|endoftext|>") else "<|endoftext|>"
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == rendered + appended
    assert ids[-1] == chat.eos_id and mask[-1] == (0 if appended else 1)
    learned = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    if template == CHATML_TEMPLATE:
        assert learned == "4.<|im_end|>\n6, of course.<|im_end|>\n"
    else:
        assert learned == " 4.<|endoftext|> 6, of course.<|endoftext|>"
    prompt_side = tokenizer.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
    assert "What is 2+2?" in prompt_side and "And 3+3?" in prompt_side and "of course" not in prompt_side
    if template == CHATML_TEMPLATE:  # the generation prompt (the assistant header) is not learned
        assert prompt_side.count("<|im_start|>assistant\n") == 2


def test_template_comes_from_tokenizer_config_else_the_default(tokenizer_dir: Path, tmp_path: Path) -> None:
    assert template_for(tokenizer_dir / "tokenizer.json") == ChatTemplate(CHATML_TEMPLATE, bos_token="",
                                                                          eos_token="<|endoftext|>")
    save_tokenizer(tmp_path, chat_template=None)
    assert template_for(tmp_path / "tokenizer.json") == ChatTemplate(DEFAULT_TEMPLATE)


def test_template_saved_by_transformers_as_jinja_files_is_the_one_used(tmp_path: Path) -> None:
    """transformers (≥ 4.50) saves a tokenizer's template as chat_template.jinja, not in tokenizer_config.json;
    it was ignored and every record silently rendered in ChatML. The files win over the config (as in
    transformers), several templates without a default are refused naming them, as is one that does not compile."""
    transformers = pytest.importorskip("transformers")
    save_tokenizer(tmp_path / "base", chat_template=None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    mine = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    tokenizer.chat_template = mine
    tokenizer.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    chat = template_for(tmp_path / "saved" / "tokenizer.json")
    assert chat == ChatTemplate(mine, eos_token="<|endoftext|>")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == mine
    named = tmp_path / "named"
    save_tokenizer(named, chat_template=CHATML_TEMPLATE)  # the config's entry loses to the files
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "rag.jinja").write_text(mine)
    (named / "additional_chat_templates" / "tool_use.jinja").write_text(mine)
    with pytest.raises(UserInputError, match=r"chat templates rag, tool_use and none named default"):
        template_for(named / "tokenizer.json")
    (named / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(UserInputError, match=r"chat_template.jinja: chat template: line 1: .*endfor"):
        template_for(named / "tokenizer.json")
    (named / "chat_template.jinja").write_text(mine)
    assert template_for(named / "tokenizer.json").template == mine


# The templates as their models ship them (tokenizer_config.json), and the same with `{% generation %}` markers
# around what the model writes (transformers' return_assistant_tokens_mask needs those), with (BOS, EOS, the token
# that ends an answer).
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
TEMPLATES = {
    "chatml": (CHATML_TEMPLATE, CHATML_TEMPLATE.replace(
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n",
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ message['content'] }}"
        "<|im_end|>\n{% endif %}"), "", "<|im_end|>", "<|im_end|>"),
    "llama2": (LLAMA2, LLAMA2.replace(
        "{{ ' '  + content.strip() + ' ' + eos_token }}",
        "{% generation %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endgeneration %}"),
               "<s>", "</s>", "</s>"),
    "llama3": (LLAMA3, LLAMA3.replace(
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
        "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}",
        "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
        "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"), "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "mistral": (MISTRAL, MISTRAL.replace("{{ message['content'] + eos_token}}",
                                         "{% generation %}{{ message['content'] + eos_token}}{% endgeneration %}"),
                "<s>", "</s>", "</s>"),
}
TEMPLATE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|begin_of_text|>",
                     "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _template_tokenizer(out: Path, *, template: str, bos: str, eos: str) -> Path:
    """A byte-level tokenizer.json with every template's special tokens, and its tokenizer_config.json."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TEMPLATE_SPECIALS])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos or None, "eos_token": eos,
              "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out / "tokenizer.json"


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_templates_train_their_end_token_and_match_transformers_assistant_mask(name: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    official, marked, bos, eos, end = TEMPLATES[name]
    conversation = CONVERSATION[1:] if name == "mistral" else CONVERSATION  # Mistral's template has no system role
    answers = sum(m["role"] == "assistant" for m in conversation)
    encoded = {}
    for kind, template in (("official", official), ("marked", marked)):
        path = _template_tokenizer(tmp_path / kind, template=template, bos=bos, eos=eos)
        chat = template_for(path)
        assert chat == ChatTemplate(template, bos_token=bos, eos_token=eos)  # BOS/EOS from tokenizer_config.json
        tokenizer = Tokenizer.from_file(str(path))
        eos_id = tokenizer.token_to_id(eos)
        encoded[kind] = ChatRenderer(tokenizer, template=chat, eos_id=eos_id).encode(conversation)
    ids, mask = encoded["marked"]
    # The official template (cut turn by turn) and its marked twin (cut at the markers) agree token for token.
    assert np.array_equal(encoded["official"][0], ids) and np.array_equal(encoded["official"][1], mask)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "marked").apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    count = len(theirs["input_ids"])
    assert ids[:count].tolist() == list(theirs["input_ids"]) and mask[:count].tolist() == theirs["assistant_masks"]
    assert mask[count:].sum() == 0  # at most the EOS appended for packing follows, never a target
    tokenizer = Tokenizer.from_file(str(tmp_path / "marked" / "tokenizer.json"))
    end_id = tokenizer.token_to_id(end)
    assert int(((ids == end_id) & (mask == 1)).sum()) == answers  # every answer's end token is trained
    # ... and the other turns' end markers (ChatML, Llama 3 close every turn) are not
    rendered_ids, rendered_mask = ids[:count], mask[:count]
    assert int(((rendered_ids == end_id) & (rendered_mask == 0)).sum()) == (
        0 if name in ("llama2", "mistral") else len(conversation) - answers)
    if bos:
        assert ids[0] == tokenizer.token_to_id(bos) and mask[0] == 0
    learned = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert "4." in learned and "6, of course." in learned and "2+2" not in learned


def test_a_message_cannot_smuggle_the_generation_markers(tmp_path: Path) -> None:
    official, marked, bos, eos, _ = TEMPLATES["mistral"]
    path = _template_tokenizer(tmp_path, template=marked, bos=bos, eos=eos)
    tokenizer = Tokenizer.from_file(str(path))
    chat = ChatRenderer(tokenizer, template=template_for(path), eos_id=tokenizer.token_to_id(eos))
    with pytest.raises(UserInputError, match="private-use character"):
        chat.encode([{"role": "user", "content": "a\ue000b"}, {"role": "assistant", "content": "c"}])


def test_mask_flows_from_shards_through_the_sampler_and_windows_stay_in_one_conversation(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    chat = renderer(tokenizer_dir)
    conversations = [[{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} " * (i % 5 + 1)}]
                     for i in range(20)]
    write_chat_data_dir(tmp_path, {"chat": conversations}, renderer=chat, vocab_size=512, seq_len=SEQ)
    masks, bins = sorted(tmp_path.rglob("*.mask")), sorted(tmp_path.rglob("*.bin"))
    assert masks and [m.with_suffix(".bin") for m in masks] == bins  # one mask beside each shard
    expected = {tuple(chat.encode(c)[0].tolist()): chat.encode(c)[1] for c in conversations}
    sampler = PackedBatchSampler(tmp_path, seq_len=SEQ, micro_batch=4, dp_rank=0, dp_size=1, seed=0)
    for _ in range(5):
        batch = sampler.next_batch()
        assert batch.loss_mask is not None and batch.loss_mask.shape == batch.tokens.shape
        for tokens, mask in zip(batch.tokens.numpy(), batch.loss_mask.numpy(), strict=True):
            inputs = tokens[:-1]
            eos_positions = np.flatnonzero(inputs == chat.eos_id)
            real = inputs[: eos_positions[0] + 1] if len(eos_positions) else inputs
            match = expected[tuple(real.tolist())]  # the window starts at a conversation's first token
            assert np.array_equal(mask[: len(real)], match.astype(bool))
            assert not mask[len(real): -1].any()  # padding is never a target
    with pytest.raises(UserInputError, match="prepared for data.seq_len 64"):
        PackedBatchSampler(tmp_path, seq_len=48, micro_batch=1, dp_rank=0, dp_size=1, seed=0)


def test_loss_is_the_mean_over_assistant_tokens_only() -> None:
    from leantrain.train.step_metrics import IGNORE_INDEX, SourceLoss

    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    stacked = torch.stack([targets.masked_fill(~keep, IGNORE_INDEX), torch.zeros_like(targets)], dim=-1)
    recorder = SourceLoss(1, device=torch.device("cpu"), masked=True)
    loss = recorder(logits, stacked)
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)
    assert recorder.tokens.tolist() == [3.0]


def test_lora_on_a_small_chat_set_learns_the_answers(tokenizer_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from leantrain.model.tiny_hf import save_tiny_hf
    from leantrain.spec import spec_from_dict
    from leantrain.train.trainer import Trainer

    hf_dir = save_tiny_hf(tmp_path / "hf", vocab_size=320, hidden_size=128, intermediate_size=256)
    chat = renderer(hf_dir)
    conversations = [[{"role": "user", "content": f"Repeat {i % 4}"}, {"role": "assistant", "content": "ok ok ok"}]
                     for i in range(40)]
    write_chat_data_dir(tmp_path / "data", {"chat": conversations}, renderer=chat, vocab_size=320, seq_len=SEQ)
    spec = spec_from_dict({
        "task": "finetune", "finetune": {"method": "lora", "lora": {"rank": 4, "alpha": 16.0, "dropout": 0.0}},
        "model": {"init_from": str(hf_dir)}, "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(tmp_path / "data")},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1,
                     "max_steps": 10, "device": "cpu", "log_every": 1, "eval_every": 0},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1}, "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
    })
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    try:
        records = [r for r in trainer.train() if "loss" in r]
    finally:
        trainer.close()
    assert records[0]["trainable_params"] < 0.05 * records[0]["params"]
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]


def _chat_spec(tmp_path: Path, hf_dir: Path, chat_file: Path) -> Path:
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "task": "finetune", "finetune": {"method": "lora"}, "model": {"init_from": str(hf_dir)},
        "data": {"tokens_total": 1e4, "seq_len": SEQ, "dir": str(tmp_path / "data"), "valid_fraction": 0.0,
                 "workers": 1, "sources": [{"name": "chat", "path": str(chat_file), "format": "chat"}]},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "device": "cpu"},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1},
    }))
    return spec


def test_prepare_reads_chat_with_the_models_tokenizer_redacts_dedups_and_writes_masks(tmp_path: Path) -> None:
    import json

    pytest.importorskip("transformers")
    from leantrain.cli import main
    from leantrain.data.layout import load_manifest
    from leantrain.data.shards import ShardReader
    from leantrain.model.tiny_hf import save_tiny_hf

    hf_dir = save_tiny_hf(tmp_path / "hf", vocab_size=320)
    records = [{"messages": [{"role": "user", "content": f"Question number {i}: what do you think?"},
                             {"role": "assistant", "content": f"Answer {i}: mail me at bob{i}@example.com"}]}
               for i in range(6)]
    records.append(records[0])  # an exact duplicate
    records.append({"prompt": "Say hi", "response": "hi there"})
    chat_file = tmp_path / "chat.jsonl"
    chat_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["prepare", str(_chat_spec(tmp_path, hf_dir, chat_file))]) == 0
    manifest = load_manifest(tmp_path / "data")
    entry = manifest.sources[0]
    assert entry["loss_mask"] and entry["pad_multiple"] == SEQ and entry["docs"]["train"] == 7
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert manifest.tokenizer["kind"] == "file"  # the model's tokenizer, not one trained on the chat text
    assert Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json")).get_vocab() == tokenizer.get_vocab()
    learned = []
    for shard in manifest.shards:
        reader = ShardReader(tmp_path / "data" / shard.path)
        mask = np.fromfile((tmp_path / "data" / shard.path).with_suffix(".mask"), dtype=np.uint8)
        assert len(mask) == len(reader.tokens) and all(length % SEQ == 0 for length in reader.doc_lengths)
        learned.append(tokenizer.decode(np.asarray(reader.tokens)[mask == 1].tolist(), skip_special_tokens=False))
    text = "".join(learned)
    assert "Answer 3: mail me at <EMAIL><|im_end|>" in text and "example.com" not in text
    assert "Question number" not in text and "hi there<|im_end|>" in text


def test_prepare_refuses_a_chat_record_without_an_assistant_turn(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from leantrain.cli import main
    from leantrain.model.tiny_hf import save_tiny_hf

    hf_dir = save_tiny_hf(tmp_path / "hf", vocab_size=320)
    chat_file = tmp_path / "chat.jsonl"
    chat_file.write_text('{"prompt": "a", "response": "b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["prepare", str(_chat_spec(tmp_path, hf_dir, chat_file))]) == 2
    assert f"{chat_file}:2: field 'messages' has no assistant turn" in capsys.readouterr().err
    assert not (tmp_path / "data" / "manifest.json").exists()
