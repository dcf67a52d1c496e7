"""Prometheus: the sink's endpoint is scraped over HTTP, and the generated alerting rules are well formed."""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from leantrain.observe.alerts import AlertRules
from leantrain.observe.prometheus import GAUGES, PrometheusSink, alerting_rules, main

REPO = Path(__file__).resolve().parents[1]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_endpoint_serves_the_last_record_with_rank_and_host_labels() -> None:
    sink = PrometheusSink(port=0, addr="127.0.0.1", rank=0, host="node0")
    try:
        sink.write({"step": 10, "loss": 2.5, "grad_norm": 0.9, "lr": 3e-4, "tokens_per_s": 1234.0, "mfu": 0.41,
                    "step_time_s": 0.4, "data_wait_s": 0.01, "comm_s": 0.05, "mem_bytes": 2**30, "time": 1.8e9,
                    "rank_step_time_s": [0.4, 0.6]})
        sink.write({"step": 12, "loss": float("nan"), "grad_norm": 1.0, "time": 1.8e9 + 1})
        sink.write({"step": 12, "eval_loss": 2.75, "eval_perplexity": 15.6})
        samples = _scrape(sink.port)
    finally:
        sink.close()
    labels = (("host", "node0"), ("rank", "0"))
    assert samples[("leantrain_step", labels)] == 12
    assert math.isnan(samples[("leantrain_loss", labels)])
    assert samples[("leantrain_eval_loss", labels)] == 2.75
    assert samples[("leantrain_tokens_per_second", labels)] == 1234.0  # kept from the last record that had it
    assert samples[("leantrain_memory_bytes", labels)] == 2**30
    assert samples[("leantrain_last_step_timestamp_seconds", labels)] == 1.8e9 + 1
    # each rank's series carries its rank only: it was labelled with rank 0's host, a wrong host for every other
    assert samples[("leantrain_rank_step_time_seconds", (("rank", "1"),))] == 0.6
    assert samples[("leantrain_nonfinite_steps_total", labels)] == 1
    names = {name for name, _ in samples}
    assert {name for name, _ in GAUGES.values()} <= names
    assert all(name.startswith("leantrain_") for name in names)


def test_alerting_rules_follow_the_alert_thresholds(tmp_path: Path) -> None:
    rules = AlertRules.model_validate({"data_wait": {"max_share": 0.3}, "straggler": {"enabled": False}})
    doc = alerting_rules(rules, hang_timeout_s=900, plan_mfu=0.4)
    group = doc["groups"][0]
    by_name = {r["alert"]: r for r in group["rules"]}
    assert "LeantrainStraggler" not in by_name
    assert by_name["LeantrainDataBound"]["expr"].endswith("> 0.3")
    assert "> 900" in by_name["LeantrainNoProgress"]["expr"]
    assert "< 0.2" in by_name["LeantrainLowMFU"]["expr"]
    for rule in group["rules"]:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["expr"].count("(") == rule["expr"].count(")")
    out = tmp_path / "rules.yml"
    assert main([str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    assert written["groups"][0]["name"] == "leantrain" and "LeantrainLowMFU" not in str(written)


def test_sink_from_the_spec() -> None:
    from leantrain.spec.schema import MonitoringSpec

    assert PrometheusSink.from_monitoring(MonitoringSpec()) is None
    sink = PrometheusSink.from_monitoring(MonitoringSpec(prometheus_port=0), rank=3, host="h")
    assert sink is not None
    try:
        sink.write({"step": 1, "loss": 4.0})
        assert _scrape(sink.port)[("leantrain_loss", (("host", "h"), ("rank", "3")))] == 4.0
    finally:
        sink.close()


def test_generated_rules_wait_the_engine_rules_for() -> None:
    from leantrain.observe.alerts import AlertRules
    from leantrain.observe.prometheus import alerting_rules

    rules = AlertRules.model_validate({"straggler": {"for_s": 90}})
    by_name = {r["alert"]: r for r in alerting_rules(rules, hang_timeout_s=600, plan_mfu=0.4)["groups"][0]["rules"]}
    assert by_name["LeantrainStraggler"]["for"] == "90s"
    assert by_name["LeantrainThroughputDrop"]["for"] == f"{rules.throughput_drop.for_s:g}s" == "20s"
    assert by_name["LeantrainLowMFU"]["for"] == "30s" and by_name["LeantrainLossSpike"]["for"] == "0s"


def test_a_plan_without_a_usable_mfu_is_refused_naming_the_key(tmp_path: Path) -> None:
    """`alert-rules --plan FILE` is given for the MFU floor: a hand-edited plan whose throughput.mfu is missing, of
    the wrong type or not a fraction was a traceback (AttributeError, TypeError), a floor below zero or no floor."""
    import json

    import pytest

    from leantrain.errors import UserInputError
    from leantrain.observe.prometheus import rules_yaml
    from leantrain.spec import load_spec

    spec = load_spec(REPO / "examples" / "tiny-cpu.yaml")
    plan = tmp_path / "plan.json"
    for throughput, said in ((5, "key 'throughput': expected an object"), ({"mfu": "high"}, "expected a number"),
                             ({"mfu": -3}, r"expected a fraction in \(0, 1\], got -3"),
                             ({}, "no key 'throughput.mfu'")):
        plan.write_text(json.dumps({"throughput": throughput}))
        with pytest.raises(UserInputError, match=f"--plan {plan}: .*{said}"):
            rules_yaml(spec, plan_file=plan)
    plan.write_text(json.dumps({"throughput": {"mfu": 0.4}}))
    assert "leantrain_mfu_ratio < 0.2" in rules_yaml(spec, plan_file=plan)
