"""leantrain eval: held-out loss per source and multiple-choice accuracy, checked against transformers' own numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer

from leantrain.cli import main
from leantrain.data.layout import write_token_data_dir
from leantrain.data.sampler import PackedBatchSampler
from leantrain.golive.eval import evaluate
from leantrain.model.tiny_hf import save_tiny_hf

transformers = pytest.importorskip("transformers")
SEQ = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("eval")
    hf_dir = save_tiny_hf(root / "hf", vocab_size=300)
    rng = np.random.default_rng(0)
    docs = {name: [[int(t) for t in rng.integers(1, 250, 50)] for _ in range(10)] for name in ("code", "prose")}
    write_token_data_dir(root / "data", docs, vocab_size=259, eos_id=256, valid_docs_by_source=docs)
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "task": "continue_pretrain", "model": {"init_from": "hf"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": "data"},
        "training": {"global_batch_tokens": 2 * SEQ, "micro_batch": 2, "device": "cpu", "eval_batches": 3},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1}, "run": {"dir": "run"},
    }))
    task = root / "arith.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in [
        {"question": "2+2", "choices": ["4", "5", "22"], "answer": 0},
        {"question": "capital of France", "choices": ["Rome", "Paris"], "answer": "Paris"},
        {"question": "color of the sky", "choices": ["green", "blue", "red", "black"], "answer": 1},
    ]) + "\n")
    return spec, hf_dir, task


def test_held_out_loss_and_choices_match_transformers(setup: tuple[Path, Path, Path]) -> None:
    spec_path, hf_dir, task = setup
    result = evaluate(spec_path, tasks=[task])
    assert json.loads((spec_path.parent / "run" / "eval.json").read_text())["held_out"] == result["held_out"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sampler = PackedBatchSampler(spec_path.parent / "data", seq_len=SEQ, micro_batch=2, dp_rank=0, dp_size=1,
                                 seed=1234, split="valid")
    sums, counts = {0: 0.0, 1: 0.0}, {0: 0, 1: 0}
    with torch.no_grad():
        for _ in range(3):
            batch = sampler.next_batch()
            logits = theirs(batch.tokens[:, :-1]).logits
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.tokens[:, 1:].flatten(),
                                                       reduction="none")
            for source, loss in zip(batch.source_ids[:, 1:].flatten().tolist(), losses.tolist(), strict=True):
                sums[source] += loss
                counts[source] += 1
    for index, name in enumerate(sampler.source_names):
        if counts[index]:
            assert result["held_out"][name]["loss"] == pytest.approx(sums[index] / counts[index], abs=1e-4)
    # Multiple choice, scored independently with transformers (context + " choice", summed log-probs).
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    items = [json.loads(line) for line in task.read_text().splitlines()]
    correct = 0
    for item in items:
        context = tokenizer.encode(f"Question: {item['question']}\nAnswer:", add_special_tokens=False).ids
        scores = []
        for choice in item["choices"]:
            cont = tokenizer.encode(f" {choice}", add_special_tokens=False).ids
            with torch.no_grad():
                logprobs = theirs(torch.tensor([context + cont])).logits.log_softmax(-1)[0]
            scores.append(sum(float(logprobs[len(context) - 1 + i, t]) for i, t in enumerate(cont)))
        answer = item["answer"] if isinstance(item["answer"], int) else item["choices"].index(item["answer"])
        correct += int(int(np.argmax(scores)) == answer)
    assert result["tasks"]["arith"]["acc"] == pytest.approx(correct / len(items))
    assert result["tasks"]["arith"]["num_questions"] == 3
    from leantrain.observe.report import render_html
    from leantrain.observe.report_data import load_run

    page = render_html(load_run(spec_path.parent / "run"))
    assert "Evaluation (step None)" in page and f"acc {correct / len(items):.3f}" in page


def test_bad_task_file_exits_2_naming_the_line(setup: tuple[Path, Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec_path, _, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"question": "q", "choices": ["a"]}\n')
    assert main(["eval", str(spec_path), "--tasks", str(bad)]) == 2
    assert "bad.jsonl:2: needs a string 'question' and a list 'choices'" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "message"), [
    (b"[1, 2]", 'bad.jsonl:2: expected a JSON object {"question", "choices", "answer"}, got [1, 2]'),
    (b'"q"', 'bad.jsonl:2: expected a JSON object'),
    (b'{"question": "caf\xe9", "choices": ["a", "b"], "answer": 0}', "bad.jsonl:2: not UTF-8 text"),
    (b"\xff\xfe{}", "bad.jsonl:2: not UTF-8 text"),
])
def test_a_task_line_that_is_not_a_utf8_json_object_exits_2_naming_the_line(
    setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], line: bytes, message: str
) -> None:
    spec_path, _, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "q", "choices": ["a", "b"], "answer": 0}\n' + line + b"\n")
    assert main(["eval", str(spec_path), "--tasks", str(bad)]) == 2
    err = capsys.readouterr()
    assert message in err.err and "Traceback" not in err.out + err.err


def test_task_lines_are_counted_at_newlines_only(tmp_path: Path) -> None:
    """A line separator inside a JSON string (allowed raw there) neither splits the line nor shifts the numbers."""
    from leantrain.errors import UserInputError
    from leantrain.golive.eval import read_task

    task = tmp_path / "task.jsonl"
    task.write_text('{"question": "one\u2028two\x85", "choices": ["a", "b"], "answer": "b"}\r\n[3]\n',
                    encoding="utf-8")
    with pytest.raises(UserInputError, match="task.jsonl:2: expected a JSON object"):
        read_task(task)
    task.write_text(task.read_text(encoding="utf-8").replace("[3]", ""), encoding="utf-8")
    (item,) = read_task(task)
    assert item.question == "one\u2028two\x85" and item.answer == 1
    # equal choices score equal: a question with two "Paris" was scored right whichever was the answer
    task.write_text('{"question": "capital?", "choices": ["Paris", "Lyon", "Paris"], "answer": 2}\n')
    with pytest.raises(UserInputError, match="task.jsonl:1: the answer \"Paris\" is listed more than once"):
        read_task(task)
    task.write_text('{"question": "capital?", "choices": ["Paris", "Lyon", "Lyon"], "answer": 0}\n')
    assert read_task(task)[0].answer == 0  # a repeated wrong choice (some benchmarks have them) is kept


def test_set_and_profile_apply_to_the_evaluated_spec(setup: tuple[Path, Path, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`eval` takes --set and --profile like every SPEC-taking command: one batch instead of three scores
    another held-out loss and writes it where the overridden run.dir points; a bad override exits 2 naming it."""
    spec_path, _, _ = setup
    assert main(["eval", str(spec_path), "--set", "training.eval_batches=1", "--set", "run.dir=run-one"]) == 0
    one = json.loads((spec_path.parent / "run-one" / "eval.json").read_text())["held_out"]
    three = evaluate(spec_path, tasks=[])["held_out"]
    assert one and set(one) <= set(three) and one != three
    assert main(["eval", str(spec_path), "--set", "training.eval_batches=-1"]) == 2
    assert "training.eval_batches" in capsys.readouterr().err
    assert main(["eval", str(spec_path), "--profile", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    # a data.dir typo scored nothing and overwrote eval.json with an empty held_out: now exit 2, the file kept
    before = (spec_path.parent / "run-one" / "eval.json").read_text()
    assert main(["eval", str(spec_path), "--set", "run.dir=run-one", "--set", "data.dir=/nowhere/typo"]) == 2
    assert "data.dir /nowhere/typo" in capsys.readouterr().err
    assert (spec_path.parent / "run-one" / "eval.json").read_text() == before


def test_acc_norm_is_per_character_and_acc_bytes_per_byte_of_the_choice() -> None:
    """lm-evaluation-harness, lm_eval/api/task.py (ConfigurableTask.process_results, multiple_choice):
    `completion_len = np.array([float(len(i)) for i in choices])`, `byte_length = ... len(i.encode("utf-8"))`,
    `pred_norm = np.argmax(lls / completion_len)`, `pred_byte = np.argmax(lls / byte_length)`: the choice's own
    length, not the length of the continuation " " + choice."""
    from leantrain.golive.eval import predictions

    # per character -2.0 vs -1.55 picks "bb"; per byte of " " + choice (-1.0 vs -1.03) would pick "a"
    assert predictions([-2.0, -3.1], ["a", "bb"]) == {"acc": 0, "acc_norm": 1, "acc_bytes": 1}
    # "é" is one character and two bytes: per character -1.5 vs -1.25, per byte -0.75 vs -1.25
    assert predictions([-1.5, -2.5], ["é", "ab"]) == {"acc": 0, "acc_norm": 1, "acc_bytes": 0}
    assert predictions([-1.0, -1.0], ["x", "y"]) == {"acc": 0, "acc_norm": 0, "acc_bytes": 0}  # ties: the first


def test_pair_split_moves_the_contexts_trailing_space_to_the_continuation(setup: tuple[Path, Path, Path]) -> None:
    from leantrain.golive.eval import encode_pair

    tokenizer = Tokenizer.from_file(str(setup[1] / "tokenizer.json"))
    ids = tokenizer.encode("Answer: yes", add_special_tokens=False).ids
    assert encode_pair(tokenizer, "Answer: ", "yes") == encode_pair(tokenizer, "Answer:", " yes") == (
        ids[:7], ids[7:])


MC_ITEMS = [
    {"question": "2+2", "choices": ["4", "five", "22"], "answer": 0},
    {"question": "capital of France", "choices": ["Rome", "Paris, the city of light"], "answer": 1},
    {"question": "color of the sky", "choices": ["green", "blue", "red", "a very dark black"], "answer": 1},
    {"question": "café or tea", "choices": ["café crème", "tea with lemon"], "answer": 0},
    {"question": "largest number", "choices": ["nine hundred", "9", "ninety"], "answer": 0},
    {"question": "naïve spelling", "choices": ["naïve", "naive", "nave"], "answer": 0},
]


@pytest.mark.slow
def test_scores_equal_lm_evaluation_harness_on_the_same_model_and_items(
        setup: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lm_eval itself (its HF model on the same checkpoint dir, a local JSONL task) against `leantrain eval`:
    per-choice log-likelihoods and per-question acc, acc_norm and acc_bytes."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task is a local file: nothing is fetched
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from leantrain.golive.eval import choice_log_likelihoods, read_task

    spec_path, hf_dir, _ = setup
    task = tmp_path / "mc.jsonl"
    task.write_text("".join(json.dumps(item) + "\n" for item in MC_ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "leantrain_mc.yaml").write_text(yaml.safe_dump({
        "task": "leantrain_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(task)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": " ",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                        for m in ("acc", "acc_norm", "acc_bytes")],
    }))
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf_dir},dtype=float32,device=cpu", tasks=["leantrain_mc"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")), log_samples=True, batch_size=1)
    ours = evaluate(spec_path, tasks=[task])["tasks"]["mc"]
    for metric in ("acc", "acc_norm", "acc_bytes"):
        assert ours[metric] == theirs["results"]["leantrain_mc"][f"{metric},none"]
    from leantrain.golive.eval import _load_model
    from leantrain.spec import load_spec

    model, _ = _load_model(load_spec(spec_path), None, step=None)
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    samples = sorted(theirs["samples"]["leantrain_mc"], key=lambda s: s["doc_id"])
    for item, sample in zip(read_task(task), samples, strict=True):
        lls = choice_log_likelihoods(model, item, tokenizer)
        assert lls == pytest.approx([ll for ll, _ in sample["filtered_resps"]], abs=1e-4)
    # the items tell the metrics apart (otherwise this test could not catch a wrong normalisation)
    assert len({(s["acc"], s["acc_norm"], s["acc_bytes"]) for s in samples}) > 1


def test_qlora_eval_and_export_with_the_base_as_trained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--base-as-trained`: a QLoRA run is evaluated and exported on its NF4-rounded base — the held-out loss equals
    the trainer's own evaluation, and transformers' logits from the export equal that model's; the stored base
    gives other numbers. Non-QLoRA runs and adapter-only exports are refused (exit 2)."""
    pytest.importorskip("torchao")
    from leantrain.ckpt.export import export_run
    from leantrain.golive.eval import _load_model
    from leantrain.spec import load_spec, spec_from_dict
    from leantrain.train.command import train

    hf_dir = save_tiny_hf(tmp_path / "hf", vocab_size=300, hidden_size=128, intermediate_size=256)
    rng = np.random.default_rng(1)
    docs = [[int((s + i) % 200) + 1 for i in range(60)] for s in rng.integers(0, 200, 30)]
    write_token_data_dir(tmp_path / "data", {"counting": docs}, vocab_size=259, eos_id=256,
                         valid_docs_by_source={"counting": docs[:6]})
    raw = {
        "task": "finetune", "finetune": {"method": "qlora", "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0}},
        "model": {"init_from": str(hf_dir)}, "precision": {"compute": "fp32", "optimizer_state": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(tmp_path / "data")},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1, "max_steps": 3,
                     "device": "cpu", "log_every": 1, "eval_every": 3, "eval_batches": 2},
        "checkpoint": {"interval_steps": 3}, "hardware": {"accelerator": "cpu", "gpus_per_node": 1},
        "budget": {"num_gpus": 1, "target_days": None}, "monitoring": {"tensorboard": False},
    }
    run_dir = tmp_path / "run"
    train(spec_from_dict(raw), run_dir=run_dir, max_steps=None, console=None)
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "eval_loss" in line][-1]["eval_loss"]
    as_trained = evaluate(run_dir, tasks=[], base_as_trained=True)
    stored = evaluate(run_dir, tasks=[])
    assert as_trained["base_as_trained"] and not stored["base_as_trained"]
    assert as_trained["held_out"]["counting"]["loss"] == pytest.approx(trained, abs=1e-5)
    assert abs(stored["held_out"]["counting"]["loss"] - trained) > 1e-4  # the stored base is another model
    model, _ = _load_model(load_spec(run_dir / "spec.yaml"), run_dir, step=None, base_as_trained=True)
    tokens = torch.tensor([docs[0][:SEQ]])
    with torch.no_grad():
        ours = model(tokens)
    for flag in (True, False):
        out = tmp_path / f"export_{flag}"
        export_run(run_dir, out, base_as_trained=flag)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            gap = float((theirs(tokens).logits - ours).abs().max())
        assert (gap < 1e-4) if flag else (gap > 1e-3), (flag, gap)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x"), "--adapter-only", "--base-as-trained"]) == 2
    assert "a PEFT adapter (--adapter-only) carries no base" in capsys.readouterr().err
    lora_run = tmp_path / "lora_run"
    raw["finetune"]["method"] = "lora"
    raw["training"]["max_steps"] = 1
    train(spec_from_dict(raw), run_dir=lora_run, max_steps=None, console=None)
    assert main(["eval", str(lora_run), "--base-as-trained"]) == 2
    assert "is not a QLoRA run (finetune weights lora)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained from scratch for 4 steps: checkpoints at steps 2 and 4."""
    from leantrain.spec import spec_from_dict
    from leantrain.train.command import train

    root = tmp_path_factory.mktemp("trained")
    rng = np.random.default_rng(2)
    docs = {"prose": [[int(t) for t in rng.integers(1, 60, 40)] for _ in range(10)]}
    write_token_data_dir(root / "data", docs, vocab_size=64, eos_id=63, valid_docs_by_source=docs)
    train(spec_from_dict({
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "vocab_size": 64},
        "data": {"tokens_total": 1e4, "seq_len": 16, "dir": str(root / "data")},
        "training": {"global_batch_tokens": 32, "micro_batch": 2, "max_steps": 4, "device": "cpu",
                     "eval_batches": 1},
        "checkpoint": {"interval_steps": 2}, "hardware": {"accelerator": "cpu", "gpus_per_node": 1},
        "budget": {"num_gpus": 1, "target_days": None}, "monitoring": {"tensorboard": False},
    }), run_dir=root / "run", max_steps=None, console=None)
    return root / "run"


def _damage(folder: Path, how: str) -> str:
    """Damage a checkpoint folder; the file the error must name."""
    shard = folder / "__0_0.distcp"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "zeroed":  # same size: only the bytes are wrong
        shard.write_bytes(bytes(shard.stat().st_size))
    elif how == "missing_shard":
        shard.unlink()
    elif how == "missing_metadata":
        (folder / ".metadata").unlink()
        return ".metadata"
    elif how == "bad_commit":
        marker = json.loads((folder / "COMMIT").read_text())
        (folder / "COMMIT").write_text(json.dumps({**marker, "manifest_sha256": "0" * 64}))
        return "manifest does not match the hash in its commit marker"
    return "__0_0.distcp"


@pytest.mark.parametrize("how", ["truncated", "zeroed", "missing_shard", "missing_metadata", "bad_commit"])
def test_damaged_checkpoint_is_exit_2_naming_the_step_folder_and_file(
        trained_run: Path, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    """export and eval read the newest checkpoint: a damaged one is one line and exit 2 naming the checkpoint
    folder and the damaged file, with the other steps to choose from (EOFError/IntegrityError tracebacks
    before); nothing is written; --step picks an intact one."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    what = _damage(run_dir / "checkpoints" / "step-00000004", how)
    for argv in (["export", str(run_dir), "--out", str(tmp_path / "hf")], ["eval", str(run_dir)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"checkpoint step 4 ({run_dir / 'checkpoints' / 'step-00000004'})" in err, err
        assert what in err and "other steps: 2" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists() and not (run_dir / "eval.json").exists()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf"), "--step", "2"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_eval_and_export_refuse_a_spec_of_another_model_naming_the_fields(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eval RUN_DIR --set model.vocab_size=N` (or a spec.yaml edited after training) describes another model
    than the checkpoint holds: refused before the model is built, naming each differing field, with the
    fingerprint check a resume uses (a size-mismatch RuntimeError from deep inside the load before)."""
    import shutil

    assert main(["eval", str(trained_run), "--set", "model.vocab_size=128"]) == 2
    err = capsys.readouterr().err
    assert "holds another model than the spec describes: model.vocab_size 64 in the checkpoint, 128 in the spec" \
        in err and str(trained_run / "checkpoints" / "step-00000004") in err
    assert main(["eval", str(trained_run), "--set", "model.d_model=32", "--set", "model.n_heads=4"]) == 2
    err = capsys.readouterr().err
    assert "model.d_model 16 in the checkpoint, 32 in the spec; model.n_heads 2 in the checkpoint, 4" in err
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    spec["model"]["ffn_hidden"] = 48
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 2
    assert "model.ffn_hidden 32 in the checkpoint, 48 in the spec" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_transient_read_error_is_said_as_it_is_without_hashing_the_checkpoint(
        trained_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A dropped connection while export reads was followed by a sha256 pass over every file of the checkpoint
    (terabytes at 405B) before the error was said."""
    from leantrain.ckpt import export

    def dropped(*args: object, **kwargs: object) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(export.dcp, "load", dropped)
    monkeypatch.setattr(export.DcpTensors, "_damaged_file", lambda self: pytest.fail("hashed the checkpoint"))
    assert main(["eval", str(trained_run)]) == 1  # not the user's input: a failed read that may pass next time
    err = capsys.readouterr().err
    assert "reading checkpoint step 4" in err and "Connection reset by peer" in err and "try again" in err


def test_a_damaged_manifest_is_named_not_taken_for_no_validation_split(
        setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A data dir whose manifest.json was damaged was said to have "no prepared validation split (a typo, or
    data.valid_fraction 0)"; with --tasks its held-out loss was skipped without a word (exit 0)."""
    import shutil

    spec_path, _, task = setup
    data = tmp_path / "data"
    shutil.copytree(spec_path.parent / "data", data)
    (data / "manifest.json").write_text("[1]")
    for tasks in ([], ["--tasks", str(task)]):
        code = main(["eval", str(spec_path), "--set", f"data.dir={data}", "--set", f"run.dir={tmp_path / 'run'}",
                     *tasks])
        err = capsys.readouterr().err
        assert code == 2 and f"{data / 'manifest.json'}: expected a JSON object" in err.replace("\n", "")
        assert "no prepared validation split" not in err and not (tmp_path / "run" / "eval.json").exists()


def test_a_validation_split_the_sampler_refuses_is_named_not_skipped(
        setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any refusal of the valid split's sampler (here a chat source prepared for another seq_len) was taken for
    "no validation split": with --tasks the held-out loss was skipped without a word (exit 0)."""
    import json
    import shutil

    spec_path, _, task = setup
    data = tmp_path / "data"
    shutil.copytree(spec_path.parent / "data", data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["sources"][0].update(loss_mask=True, pad_multiple=7)  # the run's seq_len does not divide 7
    (data / "manifest.json").write_text(json.dumps(manifest))
    code = main(["eval", str(spec_path), "--set", f"data.dir={data}", "--set", f"run.dir={tmp_path / 'run'}",
                 "--tasks", str(task)])
    err = capsys.readouterr().err.replace("\n", "")
    assert code == 2 and "prepared for data.seq_len 7" in err, err
