"""Experiment-tracking sinks: Weights & Biases (`monitoring.wandb`) and MLflow (`monitoring.mlflow`).

Both are metrics sinks (`write(record)`, `close()`) beside metrics.jsonl, TensorBoard and Prometheus, and log
exactly the numeric leaves TensorBoard gets (`loss`, `loss_by_source/en`, ...; not `step`, which is the x-axis),
skipping non-finite values (metrics.jsonl lists those under `nonfinite`). Only rank 0 tracks.

Defaults need no network: W&B runs in `offline` mode under RUN_DIR/wandb (`wandb sync RUN_DIR/wandb/offline-*`
uploads later), MLflow writes a local file store under RUN_DIR/mlruns (`mlflow ui --backend-store-uri
RUN_DIR/mlruns`). `mode: online` or a `tracking_uri` send them to a server. The clients are the
`tracking` extra (`pip install -e ".[tracking]"`; MLflow as mlflow-skinny).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError
from leantrain.observe.sinks import Sink, numeric_leaves

WANDB_DIR = "wandb"
MLFLOW_DIR = "mlruns"


def _metrics(record: dict[str, Any]) -> dict[str, float]:
    return {tag: value for tag, value in numeric_leaves(record) if tag != "step" and math.isfinite(value)}


def _import(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserInputError(f"monitoring.{module} is set but the {module} client is not installed: "
                             f'pip install -e ".[tracking]"') from None


class WandbSink:
    """Logs every record to a W&B run (offline by default: nothing leaves the machine)."""

    def __init__(self, *, run_dir: Path, project: str, entity: str | None, mode: str, name: str | None,
                 config: dict[str, Any] | None = None) -> None:
        wandb = _import("wandb")
        out = Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, entity=entity, mode=mode, dir=str(out), name=name,
                               config=config or {}, settings=wandb.Settings(console="off", silent=True))

    def write(self, record: dict[str, Any]) -> None:
        metrics = _metrics(record)
        if metrics:
            self._run.log(metrics, step=int(record.get("step", 0)))

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """Logs every record to an MLflow run (a local file store under the run dir by default)."""

    def __init__(self, *, run_dir: Path, tracking_uri: str | None, experiment: str, name: str | None,
                 params: dict[str, Any] | None = None) -> None:
        mlflow = _import("mlflow")
        if tracking_uri is None:
            # The default store is files in the run dir (no server, no database driver); MLflow 3 keeps that
            # store in maintenance mode and asks for this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = tracking_uri or (Path(run_dir) / MLFLOW_DIR).resolve().as_uri()
        self._client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        self._run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        for key, value in (params or {}).items():
            self._client.log_param(self._run_id, key, value)
        self._entities = mlflow.entities

    def write(self, record: dict[str, Any]) -> None:
        step, stamp_ms = int(record.get("step", 0)), int(float(record.get("time", 0.0)) * 1000)
        metrics = [self._entities.Metric(key=k, value=v, timestamp=stamp_ms, step=step)
                   for k, v in _metrics(record).items()]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def tracking_sinks(spec: Any, *, run_dir: Path, rank: int = 0) -> list[Sink]:
    """The sinks `monitoring.wandb` / `monitoring.mlflow` ask for (rank 0 only)."""
    monitoring = spec.monitoring
    if rank != 0:
        return []
    name = spec.run.name or Path(run_dir).name
    params = {"model.size_billion": spec.model.size_billion, "training.lr": spec.training.lr,
              "training.global_batch_tokens": spec.training.global_batch_tokens, "data.seq_len": spec.data.seq_len}
    sinks: list[Sink] = []
    if monitoring.wandb is not None:
        w = monitoring.wandb
        sinks.append(WandbSink(run_dir=Path(w.dir or Path(run_dir)), project=w.project, entity=w.entity,
                               mode=w.mode, name=name, config=params))
    if monitoring.mlflow is not None:
        m = monitoring.mlflow
        sinks.append(MlflowSink(run_dir=Path(run_dir), tracking_uri=m.tracking_uri, experiment=m.experiment,
                                name=name, params=params))
    return sinks
