"""The command line: command list, exit codes, messages without tracebacks, the demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leantrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ["plan", "prepare", "train", "launch", "report", "validate", "drill", "doctor", "demo"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "leantrain.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_help_lists_every_contract_command() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for command in CONTRACT:
        assert command in out.stdout


@pytest.mark.parametrize("command", [c for c in CONTRACT if c != "demo"])
def test_every_command_has_help_saying_what_it_reads(command: str) -> None:
    out = run_cli(command, "--help")
    assert out.returncode == 0
    assert "Reads" in out.stdout or "reads" in out.stdout


def test_bad_spec_exits_2_without_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: {size_billion: 1, architecture: sparse}\ndata: {tokens_total: 1e9}\n")
    out = run_cli("check", str(spec))
    assert out.returncode == 2
    assert "model.architecture" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_set_override_reaches_validation(tmp_path: Path) -> None:
    out = run_cli("check", "examples/tiny-cpu.yaml", "--set", "training.lr=-1")
    assert out.returncode == 2 and "training.lr" in out.stderr


def test_main_returns_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "examples/tiny-cpu.yaml")]) == 0
    assert main(["check", str(ROOT / "examples/missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2


def test_demo_runs_and_reports_each_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "spec valid" in out
    for stage in ("plan", "prepare", "train", "validate", "report"):
        assert stage in out
    drill = json.loads((tmp_path / "demo" / "run" / "drill.json").read_text())
    assert drill["passed"] and drill["reference_reused"]  # the train stage's run is the drill's reference
    assert drill["reference_dir"] == str((tmp_path / "demo" / "run").resolve())


def test_alert_rules_command_writes_prometheus_rules(tmp_path: Path) -> None:
    import yaml

    out = tmp_path / "rules.yaml"
    assert main(["alert-rules", str(ROOT / "examples/tiny-cpu.yaml"), "--out", str(out)]) == 0
    names = [rule["alert"] for rule in yaml.safe_load(out.read_text())["groups"][0]["rules"]]
    assert "LeantrainNoProgress" in names and "LeantrainLossSpike" in names


def test_typo_suggests_the_field_and_set_errors_name_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(ROOT / "examples/tiny-cpu.yaml")
    assert main(["check", tiny, "--set", "training.warmup_step=5", "--set", "training.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert "training.warmup_step: unknown field; did you mean `warmup_steps`?" in err
    assert "from --set training.warmup_step=5" in err and "from --set training.lr=abc" in err
    assert main(["check", tiny, "--set", "fault.zzz=1"]) == 2
    assert "allowed: auto_restart" in capsys.readouterr().err  # no close name: the section's fields


def test_batch_error_proposes_values_that_divide(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(ROOT / "examples/tiny-cpu.yaml")  # micro_batch 4 × seq_len 128 × dp 2 = 1024 tokens a micro-step
    assert main(["check", tiny, "--set", "training.global_batch_tokens=5000"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "set training.global_batch_tokens to 4096 or 5120" in err
    assert main(["check", tiny, "--set", "training.global_batch_tokens=1536"]) == 2
    assert "or training.micro_batch to 1, 2, 3, 6" in " ".join(capsys.readouterr().err.split())


def test_plot_without_what_if_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", str(ROOT / "examples/tiny-cpu.yaml"), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--what-if" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["plan", "{spec}", "--json", "{dir}"], ["plan", "{spec}", "--json", "{file}/x.json"],
                                  ["plan", "{spec}", "--what-if", "gpus=8,plot={dir}"],
                                  ["rehearse", "{spec}", "--json", "{dir}"], ["validate", "{dir}", "--json", "{dir}"]])
def test_an_output_path_that_is_no_file_is_refused_before_any_work(
        args: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A directory, or a path under a file, given for an output file: exit 2 naming the flag, no traceback."""
    (tmp_path / "afile").write_text("kept\n")
    subs = {"spec": str(ROOT / "examples/tiny-cpu.yaml"), "dir": str(tmp_path), "file": str(tmp_path / "afile")}
    assert main([a.format(**subs) for a in args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err and ("is a directory" in err or "is a file, not a directory" in err), err
    assert (tmp_path / "afile").read_text() == "kept\n"


def test_human_units() -> None:
    from leantrain.render import human_count, human_days, human_money, plural

    assert human_count(131_000) == "0.131M" and human_count(9.99e9) == "9.99B" and human_count(12) == "12"
    assert human_money(0.00031) == "0.00031 USD" and human_money(208_333.3) == "208,333 USD"
    assert human_money(0) == "0 USD" and human_money(12.5, "EUR") == "12.50 EUR"
    assert plural(1, "node") == "1 node" and plural(16, "node") == "16 nodes"
    assert human_days(30.2) == "30.2 days" and human_days(20 / 86400) == "20 s" and human_days(0.02) == "29 min"


def test_version_short_help_and_completion() -> None:
    from importlib.metadata import version

    assert run_cli("--version").stdout.strip() == f"leantrain {version('leantrain')}"
    short = run_cli("train", "-h")
    assert short.returncode == 0 and "--max-steps" in short.stdout
    assert run_cli("completion", "zsh").stdout.startswith("#compdef leantrain")
    assert "complete -o default -F _leantrain_completion leantrain" in run_cli("completion", "bash").stdout
    assert run_cli("completion", "tcsh").returncode == 2
    # What the bash script asks the program when the user presses TAB after `leantrain pl`.
    env = {**__import__("os").environ, "_LEANTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": "leantrain pl",
           "COMP_CWORD": "1"}
    done = subprocess.run([sys.executable, "-m", "leantrain.cli"], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.split() == ["plan"]


BEFORE_HEAVY_IMPORTS = """
import sys
from leantrain.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "numpy", "matplotlib", "tokenizers") if m in sys.modules)
print("exit", code, "heavy", ",".join(heavy) or "none")
"""


@pytest.mark.parametrize("args, names", [
    (["train", "examples/tiny-cpu.yaml", "--max-steps", "-5"], "--max-steps"),
    (["launch", "examples/tiny-cpu.yaml", "--max-steps", "-1"], "--max-steps"),
    (["check", "examples/tiny-cpu.yaml", "--set", "model.size_billion=0.0001"], "model.size_billion"),
    (["train", "examples/tiny-cpu.yaml", "--set", "training.max_steps=-3"], "training.max_steps"),
    (["launch", "examples/seed-10b.yaml", "--emit", "k8s", "--out", "/nonexistent/job.yaml"], "cluster.image"),
    (["launch", "examples/seed-10b.yaml", "--emit", "slurm", "--out", "/nonexistent/job.sbatch"],
     "cluster.slurm_venv"),
])
def test_bad_numbers_are_refused_before_heavy_imports(args: list[str], names: str) -> None:
    done = subprocess.run([sys.executable, "-c", BEFORE_HEAVY_IMPORTS, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.split()[-4:] == ["exit", "2", "heavy", "none"], done.stdout + done.stderr
    assert names in done.stderr and "Traceback" not in done.stderr


def test_a_sized_model_its_vocabulary_cannot_reach_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "small.yaml"
    spec.write_text("model: {size_billion: 0.01}\ndata: {tokens_total: 1e9}\n")
    out = run_cli("check", str(spec))  # the 128K-token embedding alone is 66M parameters
    assert out.returncode == 2 and "model.size_billion: 0.01 resolves to" in out.stderr
    assert "model.vocab_size" in out.stderr
    spec.write_text("model: {size_billion: 0.01, vocab_size: 4096}\ndata: {tokens_total: 1e9}\n")
    assert run_cli("check", str(spec)).returncode == 0


def test_qlora_example_is_sized_as_the_one_gpu_it_is_billed_as(tmp_path: Path) -> None:
    import json

    out = tmp_path / "plan.json"
    assert main(["plan", str(ROOT / "examples/qlora-70b.yaml"), "--json", str(out)]) == 0
    resources = json.loads(out.read_text())["resources"]
    assert (resources["num_gpus_with_spare"], resources["num_nodes"]) == (1, 1)
    assert json.loads(out.read_text())["memory"]["fits"]


def test_third_party_noise_is_quiet() -> None:
    """torchao's list of CUDA kernels it cannot load here and torch's note on torchao's enum registration read as
    errors in a LoRA/QLoRA job's console; importing the CLI first (as every command and script does) hides them."""
    code = "import leantrain.cli, torchao.quantization, torchao.float8, torchao.optim; print('imported')"
    done = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr
    assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr, done.stderr


def test_the_source_entry_per_format_in_docs_data_md_is_a_valid_spec() -> None:
    """docs/data.md shows one source entry per reader; the block must stay a valid `data.sources` list."""
    import re

    import yaml

    from leantrain.spec import spec_from_dict

    text = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    section = text.split("## A source entry per format", 1)[1].split("\n## ", 1)[0]
    sources = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, flags=re.S).group(1))["data"]["sources"]
    shown = {s.get("format", "jsonl") for s in sources}
    assert shown == {"jsonl", "text", "parquet", "arrow", "chat", "preference"}
    # A pretraining spec takes all but the preference pairs (those need a DPO fine-tune: docs/finetune.md).
    spec = spec_from_dict({"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 512},
                           "data": {"tokens_total": 1e6,
                                    "sources": [s for s in sources if s.get("format") != "preference"]}})
    assert len(spec.data.sources) == len(sources) - 1


def test_a_parquet_source_without_pyarrow_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """`make demo` leaves pyarrow out (extra `parquet`): a parquet or Arrow source then fails up front, naming it."""
    import importlib.util

    from leantrain.data.readers import list_source
    from leantrain.errors import UserInputError
    from leantrain.spec.schema import DataSource

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    for fmt in ("parquet", "arrow"):
        with pytest.raises(UserInputError, match=rf"data.sources\[wiki\].format: {fmt} reads through pyarrow"):
            list_source(DataSource(name="wiki", format=fmt, path=tmp_path))
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    assert list_source(DataSource(name="web", format="jsonl", path=tmp_path))[0]  # other readers need nothing
