"""W&B (offline) and MLflow (local file store) sinks record the same metrics as metrics.jsonl, in a real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from leantrain.cli import main

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[1]


def _jsonl_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of the training records in metrics.jsonl (numeric scalars only)."""
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" not in record or "event" in record:
            continue
        for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
            if isinstance(record.get(key), int | float) and math.isfinite(record[key]):
                out.setdefault(key, {})[int(record["step"])] = float(record[key])
    return out


def _wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of an offline .wandb file (LevelDB log format: 32 KiB blocks of chunks with a
    7-byte header crc32/length/type, after the file's 7-byte `:W&B` header)."""
    data, records, pending, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            records.append(pending)
    return records


def _wandb_offline_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    from wandb.proto import wandb_internal_pb2

    (run_file,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    out: dict[str, dict[int, float]] = {}
    for data in _wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items["_step"])
        for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
            if key in items:
                out.setdefault(key, {})[step] = float(items[key])
    return out


def test_wandb_offline_and_mlflow_local_record_what_metrics_jsonl_holds(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    spec = REPO / "examples" / "tiny-cpu.yaml"
    assert main(["prepare", str(spec), "--out", str(tmp_path / "data")]) == 0
    assert main(["train", str(spec), "--max-steps", "10", "--run-dir", str(run_dir),
                 "--set", f"data.dir={tmp_path / 'data'}", "--set", "training.log_every=2",
                 "--set", "monitoring.wandb={project: lt-test}", "--set", "monitoring.mlflow={experiment: lt}"]) == 0
    expected = _jsonl_metrics(run_dir)
    assert len(expected["loss"]) == 5

    client = mlflow.tracking.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("lt").experiment_id])
    for key, by_step in expected.items():
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == pytest.approx(by_step, rel=1e-6), key
    assert run.info.status == "FINISHED"

    assert _wandb_offline_metrics(run_dir) == {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()}
    # No network: offline mode wrote only local files.
    assert list((run_dir / "wandb").glob("offline-run-*"))
