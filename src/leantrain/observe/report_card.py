"""The report's run card, drill result and events in words (observe/report.py assembles the page).

The card says what ran: model and parameters, layout, precision, the data mixture and tokens (planned and
trained), from the run dir's spec.yaml, plan.json, train_info.json and metrics.jsonl. The drill section
reads drill.json (`leantrain drill`, or the demo's drill stage). Events become sentences; fields an event
kind has no sentence for are listed as `name: value` with bytes and seconds in units, never as raw Python.
"""

from __future__ import annotations

import html
import math
from typing import Any

from leantrain.observe.report_data import RunData, as_float


def human_bytes(value: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def human_count(value: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def field_text(name: str, value: Any) -> str:
    """One field in words: bytes and seconds in units, lists and nested records summarised."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if name.endswith("bytes") or name.endswith("_bytes_total"):
            return human_bytes(float(value))
        if name.endswith("_s") or name == "seconds":
            return f"{float(value):.3g} s"
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    if isinstance(value, dict):
        return ", ".join(f"{k.replace('_', ' ')} {field_text(k, v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, dict) for v in value):
            first = field_text(name, value[0])
            return f"{len(value)} ({first}{'; …' if len(value) > 1 else ''})"
        shown = ", ".join(field_text(name, v) for v in value[:8])
        return shown + (f" and {len(value) - 8} more" if len(value) > 8 else "")
    return str(value)


def fields_text(fields: dict[str, Any]) -> str:
    return "; ".join(f"{k.replace('_', ' ')}: {field_text(k, v)}" for k, v in fields.items())


def _normalised(weights: dict[str, float]) -> dict[str, float]:
    total = sum(w for w in weights.values() if w > 0)
    return {k: w / total for k, w in weights.items()} if total > 0 else weights


def run_card_rows(run: RunData) -> list[tuple[str, str]]:
    """(what, value) rows: task, model, parameters, layout, precision, data mixture, tokens, batch, hardware."""
    info = run.train_info or {}
    spec = run.spec_get
    rows: list[tuple[str, str]] = []
    rows.append(("task", str(spec("task") or info.get("task") or "—")))
    shape = [f"{k.replace('_', ' ')} {spec(f'model.{k}')}" for k in ("n_layers", "d_model", "n_heads", "n_kv_heads",
                                                                       "ffn_hidden", "vocab_size")
             if spec(f"model.{k}") is not None]
    if not shape and run.plan_get("model.n_layers") is not None:
        shape = [f"{k.replace('_', ' ')} {run.plan_get(f'model.{k}')}" for k in ("n_layers", "d_model", "vocab_size")]
    size = spec("model.size_billion")
    model = ", ".join([str(spec("model.architecture") or "dense"), *([f"sized {size}B"] if size else []), *shape])
    rows.append(("model", model + (f"; from {spec('model.init_from')}" if spec("model.init_from") else "")))
    params = as_float(info.get("num_params") or run.plan_get("model.total_params"))
    trainable = as_float(info.get("trainable_params"))
    if math.isfinite(params):
        text = f"{human_count(params)} ({params:,.0f})"
        if math.isfinite(trainable) and trainable < params:
            text += f", {human_count(trainable)} trainable ({trainable / params:.2%}: {spec('finetune.method')})"
        rows.append(("parameters", text))
    dims = [f"{axis} {run.plan_get(f'layout.{axis}')}" for axis in ("dp", "tp", "pp", "ep")
            if run.plan_get(f"layout.{axis}") is not None]
    layout = info.get("layout") or (" × ".join(dims) if dims else None)
    zero = run.plan_get("layout.zero")
    rows.append(("layout", f"{layout or '—'}; {run.world_size()} rank(s)" + (f", ZeRO-{zero}" if zero is not None
                                                                                else "")))
    precision = [f"compute {spec('precision.compute')}"] if spec("precision.compute") else []
    if spec("precision.optimizer_state"):
        precision.append(f"optimizer states {spec('precision.optimizer_state')}")
    rows.append(("precision", ", ".join(precision) or str(info.get("compute_dtype") or "—")))
    sources = spec("data.sources") or []
    weights = _normalised({str(s.get("name")): as_float(s.get("weight", 1.0)) for s in sources if isinstance(s, dict)})
    formats = {str(s.get("name")): str(s.get("builtin") or s.get("format", "jsonl")) for s in sources
               if isinstance(s, dict)}
    if weights:
        rows.append(("data mixture", ", ".join(f"{name} {share:.0%} ({formats.get(name, '')})"
                                               for name, share in weights.items())))
    elif info.get("sources"):
        rows.append(("data sources", ", ".join(map(str, info["sources"]))))
    planned = as_float(spec("data.tokens_total") or run.plan_get("compute.tokens"))
    seen = [as_float(r.get("tokens_seen")) for r in run.metrics]
    trained = max((t for t in seen if math.isfinite(t)), default=math.nan)
    tokens = []
    if math.isfinite(trained):
        tokens.append(f"{human_count(trained)} trained")
    if math.isfinite(planned):
        tokens.append(f"{human_count(planned)} planned (data.tokens_total)"
                      + (f": {trained / planned:.1%} done" if math.isfinite(trained) and planned > 0 else ""))
    if tokens:
        rows.append(("tokens", ", ".join(tokens)))
    batch = as_float(info.get("global_batch_tokens") or spec("training.global_batch_tokens"))
    seq = info.get("seq_len") or spec("data.seq_len")
    if math.isfinite(batch):
        rows.append(("batch", f"{batch:,.0f} tokens a step, sequences of {seq}, micro-batch "
                              f"{info.get('micro_batch') or spec('training.micro_batch')}"))
    accelerator = spec("hardware.accelerator")
    if accelerator or info.get("device"):
        rows.append(("hardware", f"{accelerator or info.get('device')}; torch {info.get('torch', '—')}"))
    return rows


def run_card(run: RunData) -> str:
    rows = run_card_rows(run)
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table id='run-card' class='card-table'>{body}</table>"


def drill_section(run: RunData) -> str:
    """drill.json in words: verdict, where the kill landed, recovery, steps lost, loss continuity."""
    result = run.drill
    if not result:
        return ("<p id='drill'>No drill.json in the run dir: `leantrain drill SPEC` kills a rank and checks the "
                "restart and the resumed loss curve.</p>")
    passed = result.get("passed") is True  # a hand-edited "no" or 1 is not a pass (validate reads it the same way)
    verdict = "<b class='resolved'>PASSED</b>" if passed else "<b class='critical'>FAILED</b>"
    why = "" if passed or not result.get("reason") else f": {html.escape(str(result['reason']))}"
    rows = [
        ("kill", f"rank {result.get('kill_rank')} of {result.get('num_ranks')} at step {result.get('kill_at')} of "
                 f"{result.get('max_steps')}" + (" during a save" if result.get("during_save") else "")
                 + (", the newest checkpoint corrupted first" if result.get("corrupt_latest") else "")),
        ("recovery", f"{field_text('recovery_s', result.get('recovery_s'))} from the kill to the next step, "
                     f"resumed from step {result.get('resumed_from')} ({result.get('steps_lost')} step(s) redone)"),
        ("restarts", f"{result.get('num_restarts')} (of at most {result.get('max_restarts')})"),
        ("loss after resume", "largest difference from the uninterrupted run "
                              f"{field_text('', result.get('max_loss_diff'))} (tolerance "
                              f"{field_text('', result.get('loss_tolerance'))})"),
        ("goodput", f"{as_float(result.get('goodput')):.1%} of the faulted run's wall time was training progress"
         if math.isfinite(as_float(result.get("goodput"))) else "—"),
    ]
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<p id='drill'>Fault drill {verdict}{why}.</p><table>{table}</table>"
