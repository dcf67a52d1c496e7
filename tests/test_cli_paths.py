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
