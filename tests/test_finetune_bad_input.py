"""Bad starting checkpoints and bad export requests: a clear error naming the file and the field, exit 2, nothing
written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from leantrain.cli import main
from leantrain.errors import UserInputError
from leantrain.model.hf import args_from_hf_config
from leantrain.model.hf_load import check_hf_dir
from leantrain.model.tiny_hf import save_tiny_hf

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny", vocab_size=300)


def spec_file(tmp_path: Path, init_from: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "task": "continue_pretrain", "model": {"init_from": str(init_from)},
        "data": {"tokens_total": 1e5, "seq_len": 16, "dir": str(tmp_path / "data")},
        "training": {"global_batch_tokens": 64, "micro_batch": 4, "device": "cpu"},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1}, "run": {"dir": str(tmp_path / "run")},
    }))
    return path


def copy_with_config(hf_dir: Path, dest: Path, **changes: object) -> Path:
    shutil.copytree(hf_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2"}, r"config.json: field 'model_type' 'gpt2' is not a supported architecture"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, r"field 'rope_scaling.rope_type' 'dynamic'"),
    ({"hidden_act": "gelu"}, r"field 'hidden_act' 'gelu'"),
    ({"num_key_value_heads": 3}, r"field 'num_key_value_heads' \(3\) must divide"),
])
def test_unsupported_configs_exit_2_naming_file_and_field(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, message: str
) -> None:
    bad = copy_with_config(hf_dir, tmp_path / "bad", **change)
    assert main(["check", str(spec_file(tmp_path, bad))]) == 2
    err = capsys.readouterr()
    assert re.search(message, err.err), err.err
    assert "Traceback" not in err.out + err.err
    assert not (tmp_path / "run").exists()


def test_missing_and_malformed_config_json(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["check", str(spec_file(tmp_path, empty))]) == 2
    assert "config.json: not found" in capsys.readouterr().err
    broken = copy_with_config(hf_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    assert main(["check", str(spec_file(tmp_path, broken))]) == 2
    assert "config.json: not valid JSON" in capsys.readouterr().err


def test_safetensors_names_and_shapes_must_match_config(hf_dir: Path, tmp_path: Path) -> None:
    args = args_from_hf_config(hf_dir)
    check_hf_dir(hf_dir, args=args)  # the good one passes
    renamed = copy_with_config(hf_dir, tmp_path / "renamed")
    tensors = load_file(str(renamed / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weightx"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, str(renamed / "model.safetensors"))
    with pytest.raises(UserInputError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weightx'"):
        check_hf_dir(renamed, args=args)
    reshaped = copy_with_config(hf_dir, tmp_path / "reshaped")
    tensors = load_file(str(reshaped / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, str(reshaped / "model.safetensors"))
    with pytest.raises(UserInputError, match=r"'model.norm.weight' has shape \[65\], but config.json implies \[64\]"):
        check_hf_dir(reshaped, args=args)


def test_export_refuses_a_dir_that_is_not_a_run_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no spec.yaml" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_prepare_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = save_tiny_hf(tmp_path / "small", vocab_size=200)  # the byte tokenizer has 259 tokens
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": "a", "response": "b"}\n')
    spec = spec_file(tmp_path, small)
    raw = yaml.safe_load(spec.read_text())
    raw["data"]["sources"] = [{"name": "chat", "path": str(chat), "format": "chat"}]
    spec.write_text(yaml.safe_dump(raw))
    assert main(["prepare", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json: vocabulary of 259 tokens exceeds the embedding (vocab_size 200" in err
    assert not (tmp_path / "data").exists()


def test_a_sliding_window_shorter_than_seq_len_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mistral = save_tiny_hf(tmp_path / "mistral", model_type="mistral", vocab_size=300)
    windowed = copy_with_config(mistral, tmp_path / "windowed", sliding_window=8)
    assert main(["check", str(spec_file(tmp_path, windowed))]) == 2
    assert "data.seq_len (16) exceeds the sliding_window (8)" in capsys.readouterr().err
    assert main(["check", str(spec_file(tmp_path, mistral))]) == 0  # no window: full attention, as ours


@pytest.mark.parametrize("keep", [1000, 0.9], ids=["cut-in-header", "cut-in-data"])
def test_a_cut_short_safetensors_file_exits_2_naming_it_in_train_and_eval(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], keep: float
) -> None:
    """A download cut short: the header check (rank 0, before the model is built) names the file; train writes
    no run description and eval no eval.json."""
    from leantrain.data.layout import write_token_data_dir

    cut = copy_with_config(hf_dir, tmp_path / "cut")
    weights = cut / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    message = f"{weights}: not a readable safetensors file"
    with pytest.raises(UserInputError, match="download it again"):
        check_hf_dir(cut, args=args_from_hf_config(cut))
    spec = spec_file(tmp_path, cut)
    docs = {"web": [list(range(1, 60))] * 4}
    write_token_data_dir(tmp_path / "data", docs, vocab_size=259, eos_id=256, valid_docs_by_source=docs)
    assert main(["train", str(spec), "--max-steps", "1"]) == 2
    err = capsys.readouterr()
    assert message in err.err and "Traceback" not in err.out + err.err
    assert not [name for name in ("spec.yaml", "plan.json", "lineage.json", "metrics.jsonl")
                if (tmp_path / "run" / name).exists()]
    task = tmp_path / "task.jsonl"
    task.write_text('{"question": "1+1", "choices": ["2", "3"], "answer": 0}\n')
    assert main(["eval", str(spec), "--tasks", str(task)]) == 2
    err = capsys.readouterr()
    assert message in err.err and "Traceback" not in err.out + err.err
    assert not (tmp_path / "run" / "eval.json").exists()


def test_a_chat_template_that_refuses_a_record_names_the_record_and_a_broken_one_stops_prepare_first(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A template's raise_exception (Mistral's "roles must alternate" on a system turn) stopped prepare with no
    file or line; one that failed in its own code was a traceback; one that does not compile was found only at the
    encode stage, after cleaning and deduplication. Now: the record's file:line, and a syntax error first."""
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('roles must alternate') }}"
        "{% endif %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    chat = tmp_path / "chat.jsonl"
    good = [{"prompt": f"q{i} " * 5, "response": f"answer {i} " * 5} for i in range(6)]
    bad = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                        {"role": "assistant", "content": "hello to you"}]}
    chat.write_text("".join(json.dumps(r) + "\n" for r in [*good[:3], bad, *good[3:]]))
    spec = spec_file(tmp_path, model)
    raw = yaml.safe_load(spec.read_text())
    raw["data"]["sources"] = [{"name": "chat", "path": str(chat), "format": "chat"}]
    spec.write_text(yaml.safe_dump(raw))
    assert main(["prepare", str(spec)]) == 2
    captured = capsys.readouterr()
    assert "chat.jsonl:4: chat template: roles must alternate" in captured.err and "Traceback" not in captured.err
    assert "dedup" in captured.out  # this one is found at the encode stage, after cleaning and deduplication
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    assert main(["prepare", str(spec)]) == 2
    captured = capsys.readouterr()
    assert f"{model / 'chat_template.jinja'}: chat template: line 1:" in captured.err
    assert "clean" not in captured.out and "dedup" not in captured.out


def test_a_tied_pair_of_whole_conversations_is_dropped_as_a_tie_not_refused(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """{chosen, rejected} as two equal conversations (hh-rlhf has such ties) refused the whole corpus with "field
    'chosen' must end with an assistant turn with content"; the prompt layout dropped the same tie as tied_pair."""
    from leantrain.data.preference import parse_preference

    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    pair = parse_preference({"chosen": turns, "rejected": turns}, where="f:1")
    assert pair.prompt == turns[:1] and pair.chosen == pair.rejected == turns[1:]
    longer = [*turns, {"role": "user", "content": "more"}, {"role": "assistant", "content": "b"}]
    pair = parse_preference({"chosen": turns, "rejected": longer}, where="f:2")
    assert pair.prompt == turns[:1] and pair.chosen == turns[1:] and pair.rejected == longer[1:]
    prefs = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"question {i} " * 3, "chosen": f"good answer {i} " * 3, "rejected": f"bad answer {i} " * 3}
            for i in range(6)]
    rows.insert(2, {"chosen": [{"role": "user", "content": "same question"},
                               {"role": "assistant", "content": "same answer"}],
                    "rejected": [{"role": "user", "content": "same question"},
                                 {"role": "assistant", "content": "same answer"}]})
    prefs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = spec_file(tmp_path, hf_dir)
    raw = yaml.safe_load(spec.read_text())
    raw["task"], raw["finetune"] = "finetune", {"method": "dpo"}
    raw["data"]["sources"] = [{"name": "prefs", "path": str(prefs), "format": "preference"}]
    spec.write_text(yaml.safe_dump(raw))
    assert main(["prepare", str(spec)]) == 0
    assert "tied_pair" in capsys.readouterr().out
