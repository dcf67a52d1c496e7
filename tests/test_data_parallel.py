"""Parallel prepare: byte-identical data dirs for any worker count, after a kill and re-run, and on Ray;
the preparation modules import without torch."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leantrain.data.demo_corpus import _document
from leantrain.data.pipeline import prepare_data
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec

REPO = Path(__file__).resolve().parents[1]


def _write_corpus(root: Path, *, files: int = 5, docs_per_file: int = 60) -> DataSpec:
    """Two sources over several files, with exact and near duplicates planted across files and sources."""
    rng = random.Random(11)
    earlier: list[str] = []
    for source, zh in (("en", False), ("zh", True)):
        (root / source).mkdir(parents=True, exist_ok=True)
        for number in range(files if source == "en" else 2):
            rows = []
            for i in range(docs_per_file):
                if earlier and i % 7 == 3:
                    rows.append(rng.choice(earlier))  # exact copy from any earlier file
                elif earlier and i % 7 == 5:
                    words = rng.choice(earlier).split(" ")
                    words[rng.randrange(len(words))] = "changed"
                    rows.append(" ".join(words))  # near copy
                else:
                    rows.append(_document(rng, zh=zh))
                earlier.append(rows[-1])
            with open(root / source / f"part-{number:03d}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in rows)
    return DataSpec(tokens_total=1e5, seq_len=32, tokenizer=TokenizerSpec(vocab_size=400), shard_size_tokens=3000,
                    valid_fraction=0.1, cleaning=CleaningSpec(min_words=10),
                    sources=[DataSource(name="en", path=root / "en"), DataSource(name="zh", path=root / "zh")])


def _contents(data_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.rglob("*"))
            if p.is_file() and p.name != "report.json"}  # report.json holds timings


def test_identical_data_dirs_for_1_2_4_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEANTRAIN_PII_SALT", "salt")
    spec = _write_corpus(tmp_path / "raw")
    dirs = {}
    for workers in (1, 2, 4):
        result = prepare_data(spec.model_copy(update={"workers": workers}), data_dir=tmp_path / f"w{workers}")
        dirs[workers] = _contents(tmp_path / f"w{workers}")
    drops = result.report["sources"][0]["drops"]
    assert drops["exact_duplicate"] > 0 and drops["near_duplicate"] > 0
    assert len(result.manifest.shards) > 4
    assert dirs[1] == dirs[2] == dirs[4]


def test_a_killed_run_resumes_to_the_same_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEANTRAIN_PII_SALT", "salt")
    spec = _write_corpus(tmp_path / "raw", files=8, docs_per_file=150)
    prepare_data(spec, data_dir=tmp_path / "ref")
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    data_dir = tmp_path / "data"
    code = ("import sys; from pathlib import Path; from leantrain.spec.schema import DataSpec; "
            "from leantrain.data.pipeline import prepare_data; "
            "spec = DataSpec.model_validate_json(Path(sys.argv[1]).read_text()); "
            "prepare_data(spec.model_copy(update={'workers': 1}), data_dir=Path(sys.argv[2]))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "spec.json"), str(data_dir)], env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(data_dir.glob("_work/tasks/*/encode.json")):  # killed in the middle of encoding
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it could be killed"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (data_dir / "manifest.json").exists()
    prepare_data(spec, data_dir=data_dir)
    assert _contents(data_dir) == _contents(tmp_path / "ref")


def test_preparation_imports_and_runs_without_torch(tmp_path: Path) -> None:
    spec = _write_corpus(tmp_path / "raw", files=2, docs_per_file=30)
    (tmp_path / "spec.json").write_text(spec.model_copy(update={"workers": 2}).model_dump_json())
    code = ("import sys; sys.modules['torch'] = None  # any `import torch` now fails\n"
            "from pathlib import Path\n"
            "import leantrain.data, leantrain.data.command, leantrain.data.readers, leantrain.data.dedup\n"
            "from leantrain.data.pipeline import prepare_data\n"
            "from leantrain.spec.schema import DataSpec\n"
            "spec = DataSpec.model_validate_json(Path(sys.argv[1]).read_text())\n"
            "print(len(prepare_data(spec, data_dir=Path(sys.argv[2])).manifest.shards))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spec.json"), str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


@pytest.mark.slow
def test_ray_executor_gives_the_same_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    monkeypatch.setenv("LEANTRAIN_PII_SALT", "salt")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    spec = _write_corpus(tmp_path / "raw")
    prepare_data(spec.model_copy(update={"workers": 1}), data_dir=tmp_path / "local")
    # an embedded local Ray with 2 CPUs, started and stopped by prepare
    prepare_data(spec.model_copy(update={"executor": "ray", "workers": 2}), data_dir=tmp_path / "ray")
    import ray

    assert not ray.is_initialized()
    assert _contents(tmp_path / "ray") == _contents(tmp_path / "local")


def test_progress_shows_each_stage_with_rates(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    spec = _write_corpus(tmp_path / "raw", files=2, docs_per_file=30)
    out = io.StringIO()
    prepare_data(spec.model_copy(update={"workers": 2}), data_dir=tmp_path / "d",
                 console=Console(file=out, width=160, force_terminal=False))
    text = out.getvalue()
    for stage in ("clean", "dedup merge", "train tokenizer", "encode", "shards train/en"):
        assert stage in text, stage
    assert "docs/s" in text and "MB/s" in text


def test_byte_range_tasks_give_the_same_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.data.readers import line_spans
    from leantrain.data.tasks import plan_tasks

    monkeypatch.setenv("LEANTRAIN_PII_SALT", "salt")
    spec = _write_corpus(tmp_path / "raw", files=2, docs_per_file=80)  # jsonl without ids: ids are file:line
    lines = (tmp_path / "raw" / "en" / "part-000.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "raw" / "en" / "part-000.jsonl").write_bytes(b"".join(lines[:40]) + b"{broken\n" + b"".join(lines[40:]))
    path = str(tmp_path / "raw" / "en" / "part-000.jsonl")
    spans = line_spans(path, task_bytes=4000)
    assert len(spans) > 5 and [s[0] for s in spans[1:]] == [s[1] for s in spans[:-1]]
    split = spec.model_copy(update={"task_bytes": 4000})
    assert len(plan_tasks(split.sources, {"en": [path], "zh": []}, task_bytes=4000)) == len(spans)
    whole = prepare_data(spec, data_dir=tmp_path / "whole")
    ranged = prepare_data(split.model_copy(update={"workers": 2}), data_dir=tmp_path / "ranged")
    assert _contents(tmp_path / "whole") == _contents(tmp_path / "ranged")
    problems = ranged.report["sources"][0]["read_problem_examples"]
    assert problems == whole.report["sources"][0]["read_problem_examples"] == {"broken_json": [f"{path}:41"]}
    assert ranged.report["sources"][0]["files"] == 2
