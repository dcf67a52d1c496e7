"""The prepare pipeline end to end: shards decode to the cleaned, redacted documents; crash-resume; CLI."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console
from tokenizers import Tokenizer

from leantrain.cli import main
from leantrain.data import probe as data_probe
from leantrain.data.clean import normalize
from leantrain.data.command import demo_stage
from leantrain.data.demo_corpus import _document
from leantrain.data.layout import load_manifest
from leantrain.data.pii import PLACEHOLDERS, find_pii
from leantrain.data.pipeline import prepare_data
from leantrain.data.sampler import PackedBatchSampler
from leantrain.data.shards import ShardInfo, ShardReader
from leantrain.errors import UserInputError
from leantrain.spec import load_spec
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec

REPO = Path(__file__).resolve().parents[1]
EMAIL_DOC = "Please write to the team at ops.team@example.com and they will answer the question with the details " \
            "of the cluster, the schedule and the data that the job needs to run."


def _corpus(tmp_path: Path) -> tuple[DataSpec, list[str]]:
    """Two sources; returns the spec and the normalised texts that must survive, redacted."""
    rng = random.Random(3)
    en = [_document(rng, zh=False) for _ in range(40)]
    zh = [_document(rng, zh=True) for _ in range(30)]
    en_rows = [*en, EMAIL_DOC, "Click here.", en[0]]  # + redaction case, junk, exact duplicate
    for name, rows in (("en", en_rows), ("zh", [*zh, zh[1], en[2]])):  # dedup works across sources too
        with open(tmp_path / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": f"{name}-{i}", "text": t}, ensure_ascii=False) + "\n"
                         for i, t in enumerate(rows))
    spec = DataSpec(
        tokens_total=1e5, seq_len=32,
        sources=[DataSource(name="en", path=tmp_path / "en.jsonl", weight=0.6),
                 DataSource(name="zh", path=tmp_path / "zh.jsonl", weight=0.4)],
        tokenizer=TokenizerSpec(vocab_size=400), shard_size_tokens=1500, valid_fraction=0.2,
        cleaning=CleaningSpec(min_words=10),
    )
    expected = [normalize(t, form="NFC") for t in en + zh if not find_pii(t)]
    expected.append(EMAIL_DOC.replace("ops.team@example.com", "<EMAIL>"))
    return spec, expected


def _decoded(data_dir: Path) -> list[str]:
    manifest = load_manifest(data_dir)
    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    docs = []
    for shard in manifest.shards:
        reader = ShardReader(data_dir / shard.path)
        for i in range(reader.num_docs):
            ids = reader.doc(i).tolist()
            assert ids[-1] == manifest.eos_id and manifest.eos_id not in ids[:-1]
            docs.append(tokenizer.decode(ids[:-1], skip_special_tokens=False))
    return docs


def test_shards_decode_to_the_cleaned_redacted_documents(tmp_path: Path) -> None:
    spec, expected = _corpus(tmp_path)
    result = prepare_data(spec, data_dir=tmp_path / "data")
    decoded = _decoded(tmp_path / "data")
    # the generator's own planted PII is redacted too; those documents are compared by count below
    plain = [d for d in decoded if not any(p in d for p in PLACEHOLDERS.values()) or d == expected[-1]]
    assert sorted(plain) == sorted(expected)
    assert len(decoded) == 40 + 1 + 30
    en = result.report["sources"][0]
    assert en["drops"] == {"exact_duplicate": 1, "too_short": 1} and en["pii"].get("email", 0) >= 1
    assert result.report["sources"][1]["drops"] == {"exact_duplicate": 2}
    assert {s.split for s in result.manifest.shards} == {"train", "valid"} and len(result.manifest.shards) > 4
    audit = [json.loads(line) for line in (tmp_path / "data" / "pii_audit.jsonl").read_text().splitlines()]
    assert any(a["type"] == "email" for a in audit) and "ops.team" not in str(audit)
    assert not (tmp_path / "data" / "_work").exists()
    sampler = PackedBatchSampler(tmp_path / "data", seq_len=32, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    assert sampler.source_names == ["en", "zh"] and sampler.vocab_size == result.manifest.vocab_size <= 400


class Crash(RuntimeError):
    pass


def test_crash_resume_keeps_finished_shards_and_matches_a_clean_run(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEANTRAIN_PII_SALT", "test-salt")
    spec, _ = _corpus(tmp_path)
    reference = prepare_data(spec, data_dir=tmp_path / "ref").manifest
    written: list[ShardInfo] = []

    def crash_after_three(info: ShardInfo) -> None:
        written.append(info)
        if len(written) == 3:
            raise Crash

    data_dir = tmp_path / "data"
    with pytest.raises(Crash):
        prepare_data(spec, data_dir=data_dir, on_shard=crash_after_three)
    assert not (data_dir / "manifest.json").exists()
    stamps = {s.path: (data_dir / s.path).stat().st_mtime_ns for s in written}
    (data_dir / written[2].path).write_bytes(b"torn")  # the third shard is damaged: it must be redone
    resumed = prepare_data(spec, data_dir=data_dir)
    assert resumed.reused_shards == 2
    for shard in written[:2]:
        assert (data_dir / shard.path).stat().st_mtime_ns == stamps[shard.path]  # kept, not rewritten
    assert [s.to_json() for s in resumed.manifest.shards] == [s.to_json() for s in reference.shards]
    assert resumed.manifest.tokenizer["sha256"] == reference.tokenizer["sha256"]
    again = prepare_data(spec.model_copy(update={"sources": [
        spec.sources[0].model_copy(update={"weight": 0.9}), spec.sources[1]]}), data_dir=data_dir)
    assert again.up_to_date and load_manifest(data_dir).sources[0]["weight"] == 0.9


def test_cli_prepare_demo_spec_then_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "data"
    assert main(["prepare", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dropped documents by reason" in text and "S-curve" in text
    report = json.loads((out / "report.json").read_text())
    names = [s["name"] for s in report["sources"]]
    assert names == ["en", "zh", "pydoc"]
    for reason in ("exact_duplicate", "near_duplicate", "too_short", "symbol_ratio"):
        assert sum(s["drops"].get(reason, 0) for s in report["sources"]) > 0, reason
    assert set(report["pii"]) >= {"email", "phone", "ip", "cn_id", "bank_card", "us_ssn", "secret"}
    decoded = _decoded(out)
    assert len(decoded) == sum(s["docs_out"] for s in report["sources"])
    assert any("<EMAIL>" in d for d in decoded) and not any("ops.team@example.com" in d for d in decoded)
    assert any("数据" in d for d in decoded)
    assert main(["prepare", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(out), "--probe"]) == 0
    probe = json.loads((out / "probe.json").read_text())
    assert probe["passed"] and probe["measured_tokens_per_s"] > 0 and np.isfinite(probe["needed_tokens_per_s"])
    # when the GPUs need more than the loader gives, the verdict fails with exit 1
    monkeypatch.setattr(data_probe, "needed_tokens_per_s", lambda spec: (1e15, "test: an impossible rate"))
    assert main(["prepare", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(out), "--probe"]) == 1
    assert not json.loads((out / "probe.json").read_text())["passed"]
    ctx = SimpleNamespace(spec=lambda: load_spec(REPO / "examples" / "tiny-cpu.yaml", overrides=[f"data.dir={out}"]),
                          console=Console(file=io.StringIO()))
    monkeypatch.undo()
    line = demo_stage(ctx)  # up to date: reuses the shards, then trial-reads
    assert "docs kept" in line and "PII redacted" in line


def test_tokenizer_kinds_byte_and_file(tmp_path: Path) -> None:
    spec, _ = _corpus(tmp_path)
    byte = prepare_data(spec.model_copy(update={"tokenizer": TokenizerSpec(kind="byte")}), data_dir=tmp_path / "b")
    assert byte.manifest.vocab_size == 256 + 1 + len(PLACEHOLDERS)
    assert _decoded(tmp_path / "b")[0] == _decoded(tmp_path / "b")[0].encode().decode()
    given = TokenizerSpec(kind="file", path=tmp_path / "b" / "tokenizer.json")
    loaded = prepare_data(spec.model_copy(update={"tokenizer": given}), data_dir=tmp_path / "f")
    assert loaded.manifest.tokenizer["sha256"] == byte.manifest.tokenizer["sha256"]
    assert [s.sha256 for s in loaded.manifest.shards] == [s.sha256 for s in byte.manifest.shards]


def test_cli_errors_are_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(tmp_path), "--probe"]) == 2
    captured = capsys.readouterr()
    assert "manifest.json not found" in captured.out + captured.err


def test_refuses_to_clear_folders_it_did_not_write(tmp_path: Path) -> None:
    spec, _ = _corpus(tmp_path)
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train" / "precious.txt").write_text("keep me")
    with pytest.raises(UserInputError, match="did not write"):
        prepare_data(spec, data_dir=tmp_path / "data")
    assert (tmp_path / "data" / "train" / "precious.txt").read_text() == "keep me"


def test_needed_rate_falls_back_to_peak_times_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.hardware import get_accelerator
    from leantrain.plan import planner
    from leantrain.plan.flops import flops_per_token
    from leantrain.spec.shapes import resolve_shape

    spec = load_spec(REPO / "examples" / "tiny-cpu.yaml")

    def no_plan(_: object) -> None:
        raise ValueError("planner unavailable")

    monkeypatch.setattr(planner, "make_plan", no_plan)
    needed, source = data_probe.needed_tokens_per_s(spec)
    per_token = flops_per_token(resolve_shape(spec.model), seq_len=spec.data.seq_len).model
    assert needed == pytest.approx(get_accelerator("cpu").peak_for("fp32") * 0.3 / per_token)
    assert "planner unavailable: ValueError" in source


def test_a_finished_data_dir_is_not_rebuilt_from_other_inputs_without_force(tmp_path: Path) -> None:
    spec, _ = _corpus(tmp_path)
    data_dir = tmp_path / "data"
    first = prepare_data(spec, data_dir=data_dir)
    changed = spec.model_copy(update={"cleaning": spec.cleaning.model_copy(update={"min_words": 3})})
    with pytest.raises(UserInputError, match="finished data dir built from other inputs.*--force"):
        prepare_data(changed, data_dir=data_dir)
    assert load_manifest(data_dir).to_json() == first.manifest.to_json()  # untouched
    rebuilt = prepare_data(changed, data_dir=data_dir, force=True)
    assert not rebuilt.up_to_date


@pytest.mark.parametrize(("sets", "named"), [
    ([], "data.sources: every one of the 4 documents read was dropped (no_stop_words 4)"),
    (["data.cleaning.min_stop_words=0", "data.valid_fraction=0.9999"],
     "data.valid_fraction 0.9999: all 4 kept documents"),
])
def test_a_data_dir_without_training_tokens_is_exit_2_naming_why(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  sets: list[str], named: str) -> None:
    """A tiny corpus whose documents are all filtered out, or all land in the validation split, crashed the
    summary line with a ZeroDivisionError; it is exit 2 naming the field, and the data dir written is kept."""
    rng = random.Random(0)
    words = ["quick", "brown", "fox", "jumps", "over", "lazy", "dog", "forest", "animals", "river", "stone"]
    rows = [{"text": " ".join(rng.choice(words) for _ in range(80)) + f" doc {i}."} for i in range(4)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "spec.yaml"
    spec.write_text("task: pretrain\nmodel: {n_layers: 2, d_model: 64, n_heads: 4, vocab_size: 512}\n"
                    "data: {tokens_total: 1.0e+5, seq_len: 32, dir: out, valid_fraction: 0.5, tokenizer: {kind: byte},"
                    " sources: [{name: c, path: c.jsonl}]}\n"
                    "training: {global_batch_tokens: 64, micro_batch: 2, device: cpu}\n")
    assert main(["prepare", str(spec), *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_a_source_store_that_cannot_be_reached_is_exit_2_naming_the_source(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A remote source that cannot be listed (no credentials, a bad host, a refused connection) was a traceback
    from fsspec; it is exit 2 naming data.sources[name].path and the cause."""
    out = tmp_path / "data"
    assert main(["prepare", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(out), "--set",
                 "data.sources=[{name: web, path: 'http://127.0.0.1:9/x.jsonl'}]"]) == 2
    err = capsys.readouterr().err
    assert "data.sources[web].path: http://127.0.0.1:9/x.jsonl cannot be listed" in err and "Traceback" not in err


GAP_WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "quick", "brown", "jumps", "over", "lazy", "dog",
             "river", "stone", "forest", "animals"]


def _gapped_tokenizer(path: Path) -> set[int]:
    """A word-level tokenizer.json of 21 tokens whose word "fox" has id 70000 (its ids have a gap); its ids."""
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(GAP_WORDS)}, "fox": 70000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return set(vocab.values())


@pytest.mark.parametrize("fmt", ["jsonl", "chat"])
def test_a_tokenizer_whose_ids_have_gaps_keeps_its_ids_and_is_checked_against_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    """A tokenizer whose ids have gaps (21 tokens, ids up to 70000): the shards' dtype and the manifest's vocab_size
    come from its largest id, so every id is written as it is (uint16 from its token count made text a numpy
    OverflowError and silently wrapped chat ids, 70000 to 4464); with a model too small for its ids, `prepare`
    is exit 2 naming both numbers, data.tokenizer and model.vocab_size."""
    import yaml

    ids = _gapped_tokenizer(tmp_path / "tok.json")
    rng = random.Random(0)
    text = [" ".join(rng.choice([*GAP_WORDS, "fox"]) for _ in range(80)) + f" doc {i}." for i in range(12)]
    rows = [{"text": t} for t in text] if fmt == "jsonl" else [{"prompt": t, "response": f"the fox {i}"}
                                                              for i, t in enumerate(text)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"tokens_total": 1e5, "seq_len": 32, "valid_fraction": 0.0, "workers": 1,
            "tokenizer": {"kind": "file", "path": str(tmp_path / "tok.json")}, "cleaning": {"min_stop_words": 0},
            "sources": [{"name": "c", "path": str(tmp_path / "c.jsonl"), "format": fmt}]}
    manifest = prepare_data(DataSpec(**data), data_dir=tmp_path / "data").manifest
    assert manifest.vocab_size == 70001 and manifest.dtype == "int32"
    written = np.concatenate([ShardReader(tmp_path / "data" / s.path).tokens for s in manifest.shards])
    assert 70000 in written and set(written.tolist()) <= ids
    assert max(s.max_token_id or 0 for s in manifest.shards) == 70000
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "task": "pretrain", "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 512}, "data": data,
        "training": {"global_batch_tokens": 64, "micro_batch": 2, "device": "cpu"}}))
    assert main(["prepare", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "small")]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    for part in ("data.tokenizer", str(tmp_path / "small" / "tokenizer.json"), "up to 70000", "70001",
                 "model.vocab_size is 512"):
        assert part in err, (part, err)
    assert "Traceback" not in err


def test_a_damaged_report_of_an_up_to_date_data_dir_is_refused_naming_it(tmp_path: Path) -> None:
    """An up-to-date data dir whose report.json was hand-edited (cut short, not an object, keys wrong) was a
    traceback (JSONDecodeError, TypeError); a report.json that is a folder was called "built from other
    inputs". It is refused naming the file, and --force rebuilds it."""
    spec, _ = _corpus(tmp_path)
    data_dir = tmp_path / "data"
    first = prepare_data(spec, data_dir=data_dir)
    report = data_dir / "report.json"
    for text, said in (("{cut", "not valid JSON"), ("[1]", "expected a JSON object"),
                       ('{"sources": 5}', "not the report prepare writes")):
        report.write_text(text)
        with pytest.raises(UserInputError, match=f"{report}: {said}.*--force"):
            prepare_data(spec, data_dir=data_dir)
        assert report.read_text() == text  # left as it was
    report.unlink()
    report.mkdir()
    with pytest.raises(UserInputError, match=f"{report}: cannot be read"):
        prepare_data(spec, data_dir=data_dir)
    report.rmdir()
    report.write_text("{cut")
    rebuilt = prepare_data(spec, data_dir=data_dir, force=True)
    assert not rebuilt.up_to_date and json.loads(report.read_text())["sources"] == first.report["sources"]
    assert load_manifest(data_dir).shards == first.manifest.shards


def test_a_damaged_work_note_is_refused_naming_it(tmp_path: Path) -> None:
    """An unfinished prepare's _work/inputs.json that is not a JSON object was a traceback (JSONDecodeError,
    UnicodeDecodeError, AttributeError)."""
    spec, _ = _corpus(tmp_path)
    note = tmp_path / "data" / "_work" / "inputs.json"
    note.parent.mkdir(parents=True)
    for content, said in ((b"{cut", "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
                          (b"[1]", "expected a JSON object")):
        note.write_bytes(content)
        with pytest.raises(UserInputError, match=f"{note}: {said}.*remove {note.parent}"):
            prepare_data(spec, data_dir=tmp_path / "data")
        assert note.read_bytes() == content


@pytest.mark.parametrize("command", ["prepare", "prepare-below", "demo"])
def test_an_output_dir_that_is_a_file_is_one_line_naming_the_option(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prepare --out FILE` (or a path under a file) and `demo --dir FILE`: exit 2 naming the option and the file,
    not mkdir's "File exists"; the file is left as it was."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    spec = str(REPO / "examples" / "tiny-cpu.yaml")
    argv = {"prepare": ["prepare", spec, "--out", str(afile)],
            "prepare-below": ["prepare", spec, "--out", str(afile / "sub")],
            "demo": ["demo", "--dir", str(afile)]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    option = "--dir" if command == "demo" else "--out"
    assert f"{option} {argv[-1]}: " in err and "is a file, not a directory" in err and "File exists" not in err
    assert afile.read_text() == "keep"
