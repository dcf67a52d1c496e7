"""The alert rules file (`monitoring.alert_rules`): each rule's switches and thresholds, defaults included.

observe/alerts.py evaluates them (and re-exports these names); prometheus.py writes them as Prometheus rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from leantrain.errors import UserInputError

Severity = Literal["info", "warning", "critical"]


class Rule(BaseModel):
    """Common switches of every rule."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="Evaluate this rule.")
    severity: Severity = Field("warning", description="info, warning or critical.")
    for_s: float = Field(0.0, ge=0, description="The condition must hold this long (record time) before the alert "
                         "fires; the Prometheus rule's `for`.")
    resolve_margin: float = Field(0.0, ge=0, lt=1, description="A firing alert resolves only once the value is "
                                  "this far (relative) on the good side of the threshold.")


class NonFiniteRule(Rule):
    severity: Severity = "critical"


class LossSpikeRule(Rule):
    # Short on purpose: early in training the loss falls fast, and a long window's spread hides spikes.
    window: int = Field(20, ge=3, description="Recent finite losses the spike is measured against.")
    min_history: int = Field(5, ge=2, description="Losses needed before the rule judges.")
    z: float = Field(6.0, gt=0, description="Robust z-score (median/MAD) above which a loss is a spike.")
    min_rel_increase: float = Field(0.1, ge=0, description="And at least this much above the median (relative).")


class GradNormRule(Rule):
    window: int = Field(50, ge=3, description="Recent grad norms for the running median.")
    min_history: int = Field(5, ge=2, description="Grad norms needed before the rule judges.")
    factor: float = Field(10.0, gt=1, description="Fire when grad_norm exceeds factor × running median.")


class ThroughputDropRule(Rule):
    for_s: float = 20.0
    resolve_margin: float = 0.1
    window: int = Field(500, ge=3, description="Post-warm-up tokens/s values the run's own baseline (median) "
                        "is taken over.")
    warmup_records: int = Field(5, ge=0, description="Records left out of the baseline (compile, warm caches).")
    min_history: int = Field(5, ge=2, description="Baseline values needed before the rule judges.")
    drop_fraction: float = Field(0.3, gt=0, lt=1, description="Fire below (1 - drop_fraction) × the baseline.")


class LowMfuRule(Rule):
    for_s: float = 30.0
    resolve_margin: float = 0.1
    fraction_of_plan: float = Field(0.5, gt=0, le=1, description="Fire when MFU < this × plan throughput.mfu.")
    skip_first: int = Field(3, ge=0, description="Records ignored at start (compile, warm caches).")


class DataWaitRule(Rule):
    for_s: float = 20.0
    resolve_margin: float = 0.1
    max_share: float = Field(0.2, gt=0, lt=1, description="Fire when data_wait_s / step_time_s exceeds this.")


class HangRule(Rule):
    severity: Severity = "critical"
    timeout_s: float | None = Field(None, gt=0, description="No step for this long; default monitoring.hang_timeout_s.")
    check_every_s: float = Field(5.0, gt=0, description="Watchdog period.")


class StragglerRule(Rule):
    for_s: float = 20.0
    resolve_margin: float = 0.1
    max_ratio: float = Field(1.5, gt=1, description="Fire when the slowest rank's step time / others' median > this.")


class CheckpointFailureRule(Rule):
    severity: Severity = "critical"


class LowDiskRule(Rule):
    min_free_bytes: float = Field(5 * 2**30, ge=0, description="Fire when the run dir's disk has less free.")
    min_free_fraction: float = Field(0.02, ge=0, lt=1, description="Or less than this share free.")
    check_every_s: float = Field(60.0, gt=0, description="Disk check period.")


class AlertRules(BaseModel):
    """The rules file (YAML): every key optional; what is absent keeps its default."""

    model_config = ConfigDict(extra="forbid")
    nonfinite_loss: NonFiniteRule = Field(default_factory=NonFiniteRule)
    loss_spike: LossSpikeRule = Field(default_factory=LossSpikeRule)
    grad_norm_explosion: GradNormRule = Field(default_factory=GradNormRule)
    throughput_drop: ThroughputDropRule = Field(default_factory=ThroughputDropRule)
    low_mfu: LowMfuRule = Field(default_factory=LowMfuRule)
    data_wait: DataWaitRule = Field(default_factory=DataWaitRule)
    hang: HangRule = Field(default_factory=HangRule)
    straggler: StragglerRule = Field(default_factory=StragglerRule)
    checkpoint_failure: CheckpointFailureRule = Field(default_factory=CheckpointFailureRule)
    low_disk: LowDiskRule = Field(default_factory=LowDiskRule)


def load_rules(path: Path | None) -> AlertRules:
    """Defaults, overlaid with a YAML rules file; errors name the file and the key."""
    if path is None:
        return AlertRules()
    if not Path(path).is_file():
        raise UserInputError(f"monitoring.alert_rules: {path} does not exist")
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        return AlertRules.model_validate(raw)
    except yaml.YAMLError as err:
        raise UserInputError(f"alert rules {path}: YAML syntax error: {err}") from None
    except ValidationError as err:
        lines = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise UserInputError(f"alert rules {path}: {lines} (rules: {', '.join(AlertRules.model_fields)})") from None
