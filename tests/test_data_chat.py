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
    # Together the pieces are the whole rendered conversation (+ EOS), nothing lost or added.
    assert tokenizer.decode(ids[:-1].tolist(), skip_special_tokens=False) == chat.render(CONVERSATION)
    assert ids[-1] == chat.eos_id and mask[-1] == 0
    learned = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    if template == CHATML_TEMPLATE:
        assert learned == "4.<|im_end|>\n6, of course.<|im_end|>\n"
    else:
        assert learned == " 4.<|endoftext|> 6, of course.<|endoftext|>"
    prompt_side = tokenizer.decode(ids[:-1][mask[:-1] == 0].tolist(), skip_special_tokens=False)
    assert "What is 2+2?" in prompt_side and "And 3+3?" in prompt_side and "of course" not in prompt_side
    if template == CHATML_TEMPLATE:  # the generation prompt (the assistant header) is not learned
        assert prompt_side.count("<|im_start|>assistant\n") == 2


def test_template_comes_from_tokenizer_config_else_the_default(tokenizer_dir: Path, tmp_path: Path) -> None:
    assert template_for(tokenizer_dir / "tokenizer.json") == CHATML_TEMPLATE
    save_tokenizer(tmp_path, chat_template=None)
    assert template_for(tmp_path / "tokenizer.json") == DEFAULT_TEMPLATE


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
