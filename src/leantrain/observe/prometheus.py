"""Prometheus: a metrics sink that serves the latest step's values, and alerting rules for operators.

`PrometheusSink` is a metrics sink (`write(record)`, `close()`) on its own registry (never the process-global
one, so two sinks or a test never collide), served by prometheus_client's HTTP server. Every metric has
the `leantrain_` prefix and `rank`/`host` labels. `alerting_rules` turns the alert rules into a Prometheus
rules file, so operators who run Prometheus/Alertmanager get the same alerts from the scraped series:

    python -m leantrain.observe.prometheus SPEC --out leantrain-rules.yml
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from leantrain.observe.alerts import AlertRules, load_rules
from leantrain.observe.report_data import as_float

# metrics.jsonl key -> (Prometheus name, help). Seconds and bytes in the names, as Prometheus asks.
GAUGES: dict[str, tuple[str, str]] = {
    "step": ("leantrain_step", "Last optimizer step logged."),
    "loss": ("leantrain_loss", "Training loss at the last logged step."),
    "grad_norm": ("leantrain_grad_norm", "Global gradient norm before clipping."),
    "lr": ("leantrain_learning_rate", "Learning rate."),
    "tokens_per_s": ("leantrain_tokens_per_second", "Training tokens per second (all ranks)."),
    "mfu": ("leantrain_mfu_ratio", "Model FLOPs utilisation, 0..1."),
    "step_time_s": ("leantrain_step_time_seconds", "Wall time of one optimizer step."),
    "data_wait_s": ("leantrain_data_wait_seconds", "Time the step waited for data."),
    "comm_s": ("leantrain_comm_seconds", "Time the step spent in collectives."),
    "mem_bytes": ("leantrain_memory_bytes", "Peak device memory of the step."),
}
LABELS = ("rank", "host")


class PrometheusSink:
    """Serve the last record's values on http://addr:port/metrics (port 0 picks a free port)."""

    def __init__(self, *, port: int, addr: str = "0.0.0.0", rank: int = 0, host: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.default_labels = {"rank": str(rank), "host": host or socket.gethostname()}
        self.gauges = {key: Gauge(name, doc, LABELS, registry=self.registry) for key, (name, doc) in GAUGES.items()}
        self.last_step_time = Gauge(
            "leantrain_last_step_timestamp_seconds", "Unix time of the last logged step (hang detection).",
            LABELS, registry=self.registry)
        self.rank_step_time = Gauge(  # labelled by rank alone: the exporter (rank 0) does not know each rank's host
            "leantrain_rank_step_time_seconds", "Step time per rank, as gathered by rank 0 (stragglers).",
            ("rank",), registry=self.registry)
        self.nonfinite = Counter(
            "leantrain_nonfinite_steps", "Logged steps with a non-finite loss or gradient norm.",
            LABELS, registry=self.registry)
        self.records = Counter("leantrain_records", "Metric records received.", LABELS, registry=self.registry)
        self.eval_loss = Gauge("leantrain_eval_loss", "Held-out loss at the last evaluation.", LABELS,
                               registry=self.registry)
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self._server.server_address[1])

    @classmethod
    def from_monitoring(cls, monitoring: Any, *, rank: int = 0, host: str | None = None) -> PrometheusSink | None:
        """A sink on `monitoring.prometheus_port`; None when the spec sets no port."""
        if monitoring.prometheus_port is None:
            return None
        return cls(port=monitoring.prometheus_port, rank=rank, host=host)

    def write(self, record: dict[str, Any]) -> None:
        if "step" not in record:
            return  # events carry no metric values
        labels = {
            "rank": str(record.get("rank", self.default_labels["rank"])),
            "host": str(record.get("host", self.default_labels["host"])),
        }
        if "eval_loss" in record and "loss" not in record:
            self.eval_loss.labels(**labels).set(as_float(record["eval_loss"]))
            return
        for key, gauge in self.gauges.items():
            value = as_float(record.get(key))
            # A present-but-non-finite loss is shown as NaN; an absent value keeps the last one.
            if not math.isnan(value) or (key in ("loss", "grad_norm") and key in record):
                gauge.labels(**labels).set(value)
        time_s = as_float(record.get("time"))
        if math.isnan(time_s):
            self.last_step_time.labels(**labels).set_to_current_time()
        else:
            self.last_step_time.labels(**labels).set(time_s)
        per_rank = record.get("rank_step_time_s")
        if isinstance(per_rank, list):
            for rank, seconds in enumerate(per_rank):
                self.rank_step_time.labels(rank=str(rank)).set(as_float(seconds))
        if record.get("loss") is not None and not math.isfinite(as_float(record.get("loss"))) or (
            record.get("grad_norm") is not None and not math.isfinite(as_float(record.get("grad_norm")))
        ):
            self.nonfinite.labels(**labels).inc()
        self.records.labels(**labels).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _rule(name: str, expr: str, severity: str, summary: str, for_: str | float = 0.0) -> dict[str, Any]:
    """One alerting rule; a number `for_` is the engine rule's `for_s`, so both wait the same time."""
    duration = for_ if isinstance(for_, str) else f"{for_:g}s"
    return {"alert": name, "expr": expr, "for": duration, "labels": {"severity": severity},
            "annotations": {"summary": summary}}


def alerting_rules(rules: AlertRules, *, hang_timeout_s: float, plan_mfu: float | None = None) -> dict[str, Any]:
    """A Prometheus rules file (one group) with the same thresholds as the in-process alert engine."""
    out: list[dict[str, Any]] = []
    if rules.nonfinite_loss.enabled:
        out.append(_rule("LeantrainNonFiniteLoss", "increase(leantrain_nonfinite_steps_total[5m]) > 0",
                         rules.nonfinite_loss.severity, "Non-finite loss or gradient on {{ $labels.host }}",
                         rules.nonfinite_loss.for_s))
    if rules.hang.enabled:
        timeout = rules.hang.timeout_s or hang_timeout_s
        out.append(_rule("LeantrainNoProgress", f"time() - leantrain_last_step_timestamp_seconds > {timeout:g}",
                         rules.hang.severity, f"No training step for over {timeout:g} s", rules.hang.for_s))
    if rules.loss_spike.enabled:
        # PromQL has no rolling median/MAD; mean + z·stddev over the window is its closest form (the engine's
        # robust z is already in standard deviations: 1.4826 × MAD estimates σ).
        out.append(_rule(
            "LeantrainLossSpike",
            f"leantrain_loss > (avg_over_time(leantrain_loss[30m]) + {rules.loss_spike.z:.3g} * "
            f"stddev_over_time(leantrain_loss[30m])) and leantrain_loss > "
            f"{1 + rules.loss_spike.min_rel_increase:g} * avg_over_time(leantrain_loss[30m])",
            rules.loss_spike.severity, "Loss spike on rank {{ $labels.rank }}", rules.loss_spike.for_s))
    if rules.grad_norm_explosion.enabled:
        out.append(_rule(
            "LeantrainGradNormExplosion",
            f"leantrain_grad_norm > {rules.grad_norm_explosion.factor:g} * "
            "quantile_over_time(0.5, leantrain_grad_norm[30m])",
            rules.grad_norm_explosion.severity, "Gradient norm explosion", rules.grad_norm_explosion.for_s))
    if rules.throughput_drop.enabled:
        out.append(_rule(
            "LeantrainThroughputDrop",
            f"leantrain_tokens_per_second < {1 - rules.throughput_drop.drop_fraction:g} * "
            "quantile_over_time(0.5, leantrain_tokens_per_second[30m])",
            rules.throughput_drop.severity, "Tokens/s dropped below the run's median", rules.throughput_drop.for_s))
    if rules.low_mfu.enabled and plan_mfu:
        floor = rules.low_mfu.fraction_of_plan * plan_mfu
        out.append(_rule("LeantrainLowMFU", f"leantrain_mfu_ratio < {floor:.4g}", rules.low_mfu.severity,
                         f"MFU below {floor:.1%} ({rules.low_mfu.fraction_of_plan:.0%} of plan)", rules.low_mfu.for_s))
    if rules.data_wait.enabled:
        out.append(_rule(
            "LeantrainDataBound",
            f"leantrain_data_wait_seconds / leantrain_step_time_seconds > {rules.data_wait.max_share:g}",
            rules.data_wait.severity, "Steps wait for data", rules.data_wait.for_s))
    if rules.straggler.enabled:
        out.append(_rule(
            "LeantrainStraggler",
            f"max(leantrain_rank_step_time_seconds) > {rules.straggler.max_ratio:g} * "
            "quantile(0.5, leantrain_rank_step_time_seconds)",
            rules.straggler.severity, "A rank is much slower than the median rank", rules.straggler.for_s))
    if rules.low_disk.enabled:
        # node_exporter's filesystem series: the run dir's disk is the operator's to label; all mounts here.
        out.append(_rule(
            "LeantrainLowDisk",
            f"node_filesystem_avail_bytes < {rules.low_disk.min_free_bytes:.0f} or "
            f"node_filesystem_avail_bytes / node_filesystem_size_bytes < {rules.low_disk.min_free_fraction:g}",
            rules.low_disk.severity, "Low disk space on {{ $labels.instance }} {{ $labels.mountpoint }}",
            rules.low_disk.for_s))
    return {"groups": [{"name": "leantrain", "rules": out}]}


def rules_yaml(spec: Any, *, plan_file: Path | None = None) -> str:
    """The Prometheus rules file for a spec: its alert rules, hang timeout and (with plan.json) MFU floor."""
    plan_mfu = None
    if plan_file is not None:  # given for the MFU floor: a plan without a usable throughput.mfu is refused
        from leantrain.errors import NUMBER, UserInputError, json_field
        from leantrain.observe.report_data import load_plan_file

        source = f"--plan {plan_file}"
        plan_mfu = json_field(load_plan_file(plan_file, spec=spec), "throughput.mfu", NUMBER, source=source)
        if not 0 < plan_mfu <= 1:
            raise UserInputError(f"{source}: key 'throughput.mfu': expected a fraction in (0, 1], got {plan_mfu}")
    rules = alerting_rules(load_rules(spec.monitoring.alert_rules), hang_timeout_s=spec.monitoring.hang_timeout_s,
                           plan_mfu=plan_mfu)
    return yaml.safe_dump(rules, sort_keys=False)


def run(*, console: Any, spec: Any, plan_file: Path | None, out: Path | None) -> None:
    """`leantrain alert-rules SPEC [--plan FILE] [--out FILE]`."""
    text = rules_yaml(spec, plan_file=plan_file)
    if out is None:
        sys.stdout.write(text)
        return
    out.write_text(text, encoding="utf-8")
    console.print(f"wrote Prometheus alerting rules to {out}")


def main(argv: list[str] | None = None) -> int:
    """Write the Prometheus rules file for a spec (its alert rules, hang timeout and planned MFU)."""
    from leantrain.errors import LeantrainError
    from leantrain.spec import load_spec

    parser = argparse.ArgumentParser(prog="python -m leantrain.observe.prometheus", description=main.__doc__)
    parser.add_argument("spec", type=Path, help="job spec (monitoring.alert_rules, monitoring.hang_timeout_s)")
    parser.add_argument("--plan", type=Path, help="plan.json, for the MFU floor")
    parser.add_argument("--out", type=Path, help="rules file to write (default: stdout)")
    args = parser.parse_args(argv)
    try:
        text = rules_yaml(load_spec(args.spec), plan_file=args.plan)
    except LeantrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
