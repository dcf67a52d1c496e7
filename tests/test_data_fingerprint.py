"""prepare's input fingerprint: resolved paths and content, so the same inputs named differently or rewritten
with the same bytes do not look like other inputs; digests are cached by stat."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import leantrain.data.fingerprint as fp


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fp.CACHE_ENV, str(tmp_path / "cache.db"))


def test_same_content_same_version_whatever_the_path_or_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    data = tmp_path / "corpus" / "en.jsonl"
    data.parent.mkdir()
    data.write_text('{"text": "hello"}\n')
    absolute = fp.content_version(str(data))
    monkeypatch.chdir(tmp_path)
    assert fp.content_version("corpus/en.jsonl") == absolute  # relative or absolute: one file
    assert fp.content_version("corpus/../corpus/en.jsonl") == absolute
    os.utime(data, ns=(1, 1))  # rewritten with the same bytes (a builtin corpus materialised again)
    assert fp.content_version(str(data)) == absolute
    data.write_text('{"text": "hullo"}\n')  # same size, other bytes
    assert fp.content_version(str(data)) != absolute


def test_digests_are_cached_by_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "big.bin"
    data.write_bytes(b"x" * 1000)
    reads: list[Path] = []
    real = fp._sha256
    monkeypatch.setattr(fp, "_sha256", lambda path: reads.append(path) or real(path))
    first = fp.content_version(str(data))
    assert fp.content_version(str(data)) == first and len(reads) == 1  # not read again
    os.utime(data, ns=(5, 5))
    assert fp.content_version(str(data)) == first and len(reads) == 2  # stat changed: read, same content


def test_prepare_twice_with_absolute_then_relative_paths_is_up_to_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's order: the demo prepares with an absolute path, the user then with a relative one."""
    from leantrain.cli import main

    spec = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"
    assert main(["prepare", str(spec), "--out", str(tmp_path / "data")]) == 0
    manifest = (tmp_path / "data" / "manifest.json").read_bytes()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["prepare", str(spec), "--out", "data"]) == 0, capsys.readouterr().err
    assert (tmp_path / "data" / "manifest.json").read_bytes() == manifest


def test_unfinished_work_of_another_task_split_is_not_reused(tmp_path: Path) -> None:
    """Task folders are named by their place in the plan (t000000, ...): a resume after another `task_bytes`
    reused the old split's finished folders for other byte ranges (one file's second range stood in for another
    file, ~200 of 500 documents gone, exit 0). Unfinished work of another split is cleared; of the same, kept."""
    import json

    from leantrain.data.pipeline import _start
    from leantrain.spec.data_schema import DataSpec

    def spec(task_bytes: int) -> DataSpec:
        return DataSpec(tokens_total=1e5, seq_len=16, dir=tmp_path / "out", task_bytes=task_bytes,
                        sources=[{"name": "a", "path": tmp_path / "a.jsonl"}])

    data_dir = tmp_path / "out"
    _start(spec(20_000), data_dir=data_dir, inputs="abc", force=False)
    done = data_dir / "_work" / "clean" / "t000001"
    done.mkdir(parents=True)
    _start(spec(20_000), data_dir=data_dir, inputs="abc", force=False)  # the same split: resumed
    assert done.is_dir()
    _start(spec(1_000_000), data_dir=data_dir, inputs="abc", force=False)  # another split: started over
    assert not done.exists()
    assert json.loads((data_dir / "_work" / "inputs.json").read_text()) == {"sha256": "abc", "task_bytes": 1_000_000}
