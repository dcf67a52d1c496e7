"""A path that is not what a command needs (a folder where a file goes, a file where a folder goes, a missing
input) is exit 2 naming the path, not a traceback, whichever command meets it."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_an_output_path_that_is_a_folder_is_exit_2_naming_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "rules"
    folder.mkdir()
    assert main(["alert-rules", str(EXAMPLES / "tiny-cpu.yaml"), "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "Traceback" not in err


def test_an_output_folder_that_is_a_file_is_exit_2_naming_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text((EXAMPLES / "tiny-cpu.yaml").read_text())
    assert main(["prepare", str(EXAMPLES / "tiny-cpu.yaml"), "--out", str(spec / "data")]) == 2
    err = capsys.readouterr().err
    assert str(spec) in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["doctor"], ["runs"], ["validate"], ["report"], ["export", "--out", "hf"]])
def test_a_run_dir_argument_that_is_a_file_is_exit_2_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """A file where a run dir goes is named as a file, not reported as missing (or as a run dir without
    metrics.jsonl / spec.yaml)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("{}\n")
    assert main([command[0], str(path), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{path} is a file, not a run dir" in err and "does not exist" not in err and "Traceback" not in err
    if command == ["runs"]:  # a registry file given where the run dir goes: the flag that takes it
        assert f"--registry {path}" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", ["slurm", "k8s"])
def test_an_emit_out_that_is_a_folder_is_refused_before_any_file_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """`launch --emit k8s --out FOLDER` wrote FOLDER.setup.yaml, then failed naming a hidden temp file
    (`.FOLDER.tmp-PID → FOLDER: Is a directory`) that it left behind."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    code = main(["launch", str(EXAMPLES / "seed-10b.yaml"), "--profile", "rehearsal", "--dry-run", "--emit", kind,
                 "--out", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {folder}: is a directory" in err and ".tmp-" not in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["jobs"] and not any(folder.iterdir())
