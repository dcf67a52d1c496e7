"""A secret canary set in the environment never appears in any file the run-dir writers produce: logs through
the redacting filter, the audit log, lineage, node health, preflight report, registry and job files."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path

import pytest

from leantrain.launch.health import record_failure
from leantrain.launch.k8s import k8s_documents, k8s_yaml
from leantrain.launch.preflight_report import analyze, write_report
from leantrain.launch.resources import TrainCommand, write_job_file
from leantrain.launch.slurm import slurm_script
from leantrain.provenance.lineage import write_lineage
from leantrain.provenance.registry import register_run
from leantrain.security import AuditLog, RedactingFilter, install_log_redaction, redact, secret_values
from leantrain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed-10b.yaml"


def test_redact_replaces_env_secrets_and_credential_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-1234567890")
    monkeypatch.setenv("UNRELATED_SETTING", "tok-visible-value")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to redact without mangling text
    text = ("token tok-1234567890 setting tok-visible-value key AKIAIOSFODNN7EXAMPLE "
            "url s3://user:hunter22@minio:9000/b Authorization: Bearer eyJhbGciOi.JIUzI1 abc")
    out = redact(text)
    assert "tok-1234567890" not in out and "tok-visible-value" in out
    assert "AKIAIOSFODNN7EXAMPLE" not in out and "hunter22" not in out and "eyJhbGciOi" not in out
    assert "s3://user:***@minio:9000/b" in out and out.endswith(" abc")


def test_spec_references_name_the_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_BEARER", "value-of-a-var-not-named-like-a-secret")
    spec = load_spec(SEED, overrides=["monitoring.webhook_token=${HOOK_BEARER}", "security.secret_env=[EXTRA_ONE]"])
    monkeypatch.setenv("EXTRA_ONE", "another-unusually-named-secret")
    found = secret_values(spec=spec)
    assert {"value-of-a-var-not-named-like-a-secret", "another-unusually-named-secret"} <= set(found)
    assert "value-of-a-var-not-named-like-a-secret" not in secret_values()


def test_logging_filter_redacts_message_args_and_exceptions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("LEANTRAIN_WEBHOOK_TOKEN", canary)
    logger = logging.getLogger(f"leantrain.test.{uuid.uuid4().hex[:6]}")
    handler = logging.FileHandler(tmp_path / "train.log")
    logger.addHandler(handler)
    logger.propagate = False
    install_log_redaction(logger=logger)
    assert any(isinstance(f, RedactingFilter) for f in handler.filters)
    logger.warning("posting with token %s", canary)
    try:
        raise RuntimeError(f"webhook rejected {canary}")
    except RuntimeError:
        logger.exception("alert failed")
    handler.close()
    text = (tmp_path / "train.log").read_text()
    assert canary not in text and text.count("***") == 2 and "webhook rejected ***" in text


def test_canary_never_reaches_any_file_written_by_the_ops_and_security_helpers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", f"AKIA{uuid.uuid4().hex[:16].upper()}")
    monkeypatch.setattr(sys, "argv", ["leantrain", "train", "--set", f"note={canary}"])  # a careless command line
    spec = load_spec(SEED, profile="rehearsal")
    run_dir = tmp_path / "run"

    lineage = write_lineage(run_dir, spec, spec_path=SEED)
    register_run(lineage, registry=tmp_path / "registry" / "runs.db")
    audit = AuditLog(run_dir / "audit.log", spec=spec)
    audit.append("command", argv=sys.argv, env_dump={"AWS_SECRET_ACCESS_KEY": canary})
    audit.append("checkpoint.save", step=10, error=f"upload failed with key {canary}")
    record_failure(run_dir, host="node1", kind="crash", reason=f"worker env had {canary}")
    joined = {0: {"host": "node1", "torch": canary, "resolves": True, "data": {"ok": True},
                  "disk": {"ok": True, "free_bytes": 1, "need_bytes": 1, "path": "/"}}}
    write_report(analyze(joined=joined, expected_world_size=1, world_size=1, probes={0: {"ok": True}},
                         collectives={}), run_dir / "preflight.json")
    write_job_file(slurm_script(spec, command=TrainCommand(spec_path=SEED, profile="rehearsal"), run_dir=run_dir,
                                dry_run=True), tmp_path / "job.sbatch")  # dry run: seed-10b.yaml names no image or venv
    write_job_file(k8s_yaml(k8s_documents(spec, run_dir=run_dir, dry_run=True)), tmp_path / "job.yaml")
    logger = logging.getLogger(f"leantrain.canary.{uuid.uuid4().hex[:6]}")
    handler = logging.FileHandler(run_dir / "train.log")
    handler.addFilter(RedactingFilter(spec=spec))
    logger.addHandler(handler)
    logger.propagate = False
    logger.error("s3 auth failed for secret %s", canary)
    handler.close()

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 9
    leaks = [str(p) for p in files if canary.encode() in p.read_bytes()]
    assert leaks == []
    # the writers did record the events, with the secret replaced
    assert "upload failed with key ***" in (run_dir / "audit.log").read_text()
    assert "AWS_SECRET_ACCESS_KEY" in (tmp_path / "job.yaml").read_text()  # named, from the Secret
    assert json.loads((run_dir / "lineage.json").read_text())["command"][-1] == "note=***"
