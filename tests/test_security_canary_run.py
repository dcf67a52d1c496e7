"""A secret canary in the environment never appears in any file of a real training run dir or its logs."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from leantrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_canary_secret_never_lands_in_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    monkeypatch.setenv("LEANTRAIN_WEBHOOK_TOKEN", canary)
    # a webhook nobody listens on: alert deliveries fail and are logged, with the token in the request
    monkeypatch.setenv("LEANTRAIN_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    spec = str(EXAMPLES / "tiny-cpu.yaml")
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    assert main(["prepare", spec, "--out", str(data_dir)]) == 0
    overrides = [
        "--set", f"data.dir={data_dir}", "--set", "checkpoint.secret_key=${AWS_SECRET_ACCESS_KEY}",
        "--set", "monitoring.webhook_url_env=LEANTRAIN_WEBHOOK_URL",
        "--set", "monitoring.webhook_token=${LEANTRAIN_WEBHOOK_TOKEN}",
        "--set", "checkpoint.interval_steps=2", "--set", "training.log_every=1",
    ]
    assert main(["train", spec, *overrides, "--run-dir", str(run_dir), "--max-steps", "4"]) == 0
    assert main(["report", str(run_dir)]) == 0
    main(["validate", str(run_dir), "--json", str(run_dir / "verdict.json")])
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 10 and any(p.name == "spec.yaml" for p in files)
    leaked = [str(p.relative_to(run_dir)) for p in files if canary.encode() in p.read_bytes()]
    assert not leaked, f"the canary secret was written to {leaked}"
    out = capsys.readouterr()
    assert canary not in out.out + out.err
