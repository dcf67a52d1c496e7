"""No silent data loss: truncated, corrupt or mislabelled compressed input is an error naming the file and
offset (CLI exit 2), or with `data.on_bad_input: skip` a counted skip of the rest of the file in the report."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import pytest
import zstandard

from leantrain.cli import main
from leantrain.data.demo_corpus import _document
from leantrain.data.inputs import BadInputError, open_binary
from leantrain.data.layout import write_token_data_dir
from leantrain.data.pipeline import prepare_data
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec

NUM_DOCS = 400
TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def _rows(seed: int = 1) -> bytes:
    rng = random.Random(seed)
    return b"".join((json.dumps({"id": i, "text": _document(rng, zh=False)}) + "\n").encode() for i in range(NUM_DOCS))


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    data = _rows()
    zst = zstandard.ZstdCompressor(write_checksum=True).compress(data)  # as the zstd tool writes
    gz = gzip.compress(data)
    files = {
        "truncated_zst": (zst[: len(zst) // 4], ".jsonl.zst"),
        "truncated_gz": (gz[: len(gz) // 4], ".jsonl.gz"),
        "corrupt_zst": (zst[:200] + bytes(b ^ 0x5A for b in zst[200:400]) + zst[400:], ".jsonl.zst"),
        "corrupt_gz": (gz[:200] + bytes(b ^ 0x5A for b in gz[200:400]) + gz[400:], ".jsonl.gz"),
        "mislabelled_zst": (data, ".jsonl.zst"),  # plain jsonl named .zst
        "gzip_named_zst": (gz, ".jsonl.zst"),
    }
    out = {}
    for name, (content, suffix) in files.items():
        out[name] = tmp_path / f"{name}{suffix}"
        out[name].write_bytes(content)
    return out


def test_every_bad_file_raises_naming_file_and_offset(tmp_path: Path) -> None:
    for name, path in _bad_files(tmp_path).items():
        with pytest.raises(BadInputError) as info, open_binary(str(path)) as stream:
            sum(1 for _ in stream)
        err = info.value
        assert err.path == str(path) and str(path) in str(err) and "compressed byte" in str(err), name
        assert 0 <= err.offset <= path.stat().st_size, name
    good = tmp_path / "good.jsonl.zst"
    frames = zstandard.ZstdCompressor().compress(b"a\n") + zstandard.ZstdCompressor().compress(b"b\n")
    good.write_bytes(frames)  # two frames back to back are one valid stream
    with open_binary(str(good)) as stream:
        assert stream.read() == b"a\nb\n"


def _spec(tmp_path: Path, path: Path, **kw: object) -> DataSpec:
    good = tmp_path / "good.jsonl"
    good.write_bytes(_rows()[: len(_rows()) // 2])
    return DataSpec(tokens_total=1e5, seq_len=32, tokenizer=TokenizerSpec(kind="byte"), workers=1,
                    cleaning=CleaningSpec(min_words=5),
                    sources=[DataSource(name="good", path=good), DataSource(name="bad", path=path)], **kw)


@pytest.mark.parametrize("kind", ["truncated_zst", "truncated_gz", "corrupt_zst", "mislabelled_zst"])
def test_prepare_errors_or_counts_a_skip(tmp_path: Path, kind: str) -> None:
    path = _bad_files(tmp_path)[kind]
    with pytest.raises(BadInputError, match=str(path)):
        prepare_data(_spec(tmp_path, path), data_dir=tmp_path / "data")
    assert not (tmp_path / "data" / "manifest.json").exists()
    folder = tmp_path / "folder"  # a folder with one bad file among good ones: only that file is skipped
    folder.mkdir()
    path.rename(folder / path.name)
    ok = _rows(seed=2)[:20_000]
    ok = ok[: ok.rindex(b"\n") + 1]
    (folder / "ok.jsonl").write_bytes(ok)
    result = prepare_data(_spec(tmp_path, folder, on_bad_input="skip"), data_dir=tmp_path / "skip")
    bad = result.report["sources"][1]
    assert [b["file"] for b in bad["bad_inputs"]] == [str(folder / path.name)]
    # the documents read before the damage are kept (gzip decodes any prefix, zstd whole blocks)
    assert bad["docs_in"] == ok.count(b"\n") + bad["bad_inputs"][0]["docs_before"] and bad["docs_out"] > 0
    assert result.manifest.sources[1]["bad_inputs"] == bad["bad_inputs"]


def test_cli_exit_2_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _bad_files(tmp_path)["truncated_gz"]
    spec = tmp_path / "job.yaml"
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "examples" / "tiny-cpu.yaml").read_text()
    spec.write_text(text.replace("{name: en, builtin: demo-en, weight: 0.5}", f"{{name: en, path: {path}}}"))
    code = main(["prepare", str(spec), "--out", str(tmp_path / "d")])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert path.name in (captured.out + captured.err).replace("\n", "")


def _damage(data_dir: Path, kind: str) -> list[str]:
    """Damage a data dir as `leantrain train` might find it; returns what the refusal must name."""
    manifest_path = data_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    shard = data_dir / manifest["shards"][0]["path"]
    if kind in ("truncated_shard", "odd_sized_shard"):  # a copy cut short: even, or mid-token
        os.truncate(shard, 200 if kind == "truncated_shard" else shard.stat().st_size - 1)
        return [str(shard), f"expected {manifest['shards'][0]['num_bytes']:,}"]
    if kind == "truncated_manifest":
        text = manifest_path.read_text()
        manifest_path.write_text(text[: len(text) // 2])
        return [str(manifest_path), "not valid JSON"]
    edits = {
        "missing_key": (lambda m: m.pop("eos_id"), "'eos_id'"),
        "string_for_number": (lambda m: m.update(vocab_size="lots"), "'vocab_size'"),
        "shard_string_for_number": (lambda m: m["shards"][0].update(num_tokens="many"), "'num_tokens'"),
        "bad_dtype": (lambda m: m.update(dtype="float32"), "'dtype'"),
    }
    edit, key = edits[kind]
    edit(manifest)
    manifest_path.write_text(json.dumps(manifest))
    return [str(manifest_path), key]


@pytest.mark.parametrize("kind", ["truncated_shard", "odd_sized_shard", "truncated_manifest", "missing_key",
                                  "string_for_number", "shard_string_for_number", "bad_dtype"])
def test_train_refuses_a_damaged_data_dir_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          kind: str) -> None:
    """A damaged prepared data dir is exit 2 naming the file (and the manifest's key), not a traceback; a refusal
    at start leaves no description of a run that never started."""
    rng = random.Random(0)
    docs = {"web": [[rng.randrange(1, 500) for _ in range(60)] for _ in range(40)]}
    write_token_data_dir(tmp_path / "data", docs, vocab_size=512, eos_id=0, shard_size_tokens=1000)
    names = _damage(tmp_path / "data", kind)
    run_dir = tmp_path / "run"
    code = main(["train", str(TINY), "--set", f"data.dir={tmp_path / 'data'}", "--run-dir", str(run_dir),
                 "--max-steps", "1"])
    captured = capsys.readouterr()
    message = (captured.out + captured.err).replace("\n", "")
    assert code == 2, message
    assert "Traceback" not in message and all(name in message for name in names), (names, message)
    if kind not in ("truncated_shard", "odd_sized_shard"):  # refused at start (a shard: when first opened)
        assert not (run_dir / "spec.yaml").exists() and not (run_dir / "lineage.json").exists()


def test_train_refuses_token_ids_beyond_the_models_vocabulary_at_start(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Data tokenized with a larger vocabulary than model.vocab_size (here a tokenizer whose vocab_size, 512,
    undercounts its ids, as one with gaps in its id range does) is refused before the first step, from the
    largest id prepare recorded per shard, naming both numbers and both fields; an older data dir that has no
    such record still trains."""
    rng = random.Random(0)
    docs = {"web": [[rng.randrange(1, 700) for _ in range(60)] for _ in range(40)]}
    write_token_data_dir(tmp_path / "data", docs, vocab_size=512, eos_id=0, shard_size_tokens=1000)
    top = max(max(doc) for doc in docs["web"])
    assert top >= 512
    argv = ["train", str(TINY), "--set", f"data.dir={tmp_path / 'data'}", "--max-steps", "1", "--run-dir"]
    code = main([*argv, str(tmp_path / "run")])
    message = capsys.readouterr().err.replace("\n", "")
    assert code == 2, message
    for part in (str(tmp_path / "data" / "manifest.json"), "max_token_id", str(top), "model.vocab_size", "512"):
        assert part in message, (part, message)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
    # a data dir written before max_token_id was recorded (and within the model's vocabulary) still trains
    old = write_token_data_dir(tmp_path / "old", {"web": [[i % 500 + 1 for i in range(60)]] * 40}, vocab_size=512,
                               eos_id=0, shard_size_tokens=1000)
    raw = json.loads((tmp_path / "old" / "manifest.json").read_text())
    for shard in raw["shards"]:
        del shard["max_token_id"]
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(raw))
    assert old.shards and main(["train", str(TINY), "--set", f"data.dir={tmp_path / 'old'}", "--max-steps", "1",
                                "--run-dir", str(tmp_path / "old-run")]) == 0


def test_train_refuses_chat_token_ids_beyond_the_models_vocabulary_at_start(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Fine-tuning data is checked as text data is: a chat data dir's shards (with their loss masks) record
    their largest token id too, so ids the model's embedding has no row for (the ChatML specials, 256-258, of a
    tokenizer whose vocab_size was given as 257, its EOS's id + 1) are refused before the first step, naming the
    manifest and the shard."""
    from tokenizers import Tokenizer

    from leantrain.data.chat import ChatRenderer, write_chat_data_dir
    from leantrain.model.tiny_hf import CHATML_TEMPLATE, save_tokenizer

    save_tokenizer(tmp_path / "tok")
    tokenizer = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    chat = ChatRenderer(tokenizer, template=CHATML_TEMPLATE, eos_id=tokenizer.token_to_id("<|endoftext|>"))
    conversations = [[{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} {i}"}]
                     for i in range(20)]
    manifest = write_chat_data_dir(tmp_path / "data", {"chat": conversations}, renderer=chat, vocab_size=257,
                                   seq_len=128)
    assert [s.max_token_id for s in manifest.shards] == [tokenizer.token_to_id("<|im_end|>")]
    code = main(["train", str(TINY), "--set", f"data.dir={tmp_path / 'data'}", "--set", "model.vocab_size=257",
                 "--max-steps", "1", "--run-dir", str(tmp_path / "run")])
    message = capsys.readouterr().err.replace("\n", "")
    assert code == 2, message
    for part in (str(tmp_path / "data" / "manifest.json"), manifest.shards[0].path, "max_token_id", "258",
                 "model.vocab_size is 257"):
        assert part in message, (part, message)
    assert "Traceback" not in message and not (tmp_path / "run" / "metrics.jsonl").exists()
