"""Terminal rendering of a parsed spec (the `check` command and the demo's first stage), and the human units
every table uses: counts as 0.13M / 10.0B, money with the digits a small amount needs, plurals."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from leantrain.spec import JobSpec, resolve_shape


def human_count(value: float, *, digits: int = 3) -> str:
    """12 → "12", 130_000 → "0.13M", 1.2e10 → "12B", 4.2e12 → "4.2T" (3 significant digits)."""
    if not math.isfinite(value):
        return str(value)
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if abs(value) >= scale / 10:
            return f"{value / scale:.{digits}g}{suffix}"
    if abs(value) >= 1e3:
        return f"{value / 1e3:.{digits}g}K"
    return f"{value:.{digits}g}"


def human_money(value: float, currency: str = "USD") -> str:
    """1234.5 → "1,234 USD"; 0.00031 → "0.00031 USD": small amounts keep two significant digits, not "0"."""
    if not math.isfinite(value):
        return f"{value} {currency}"
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f} {currency}"
    if abs(value) >= 1:
        return f"{value:,.2f} {currency}"
    return f"{value:.2g} {currency}"


def human_days(days: float) -> str:
    """30.2 → "30.2 days", 0.02 → "29 min", 0.0002 → "17 s": short runs in the unit that shows them."""
    if not math.isfinite(days):
        return f"{days} days"
    seconds = days * 86400
    if seconds < 120:
        return f"{seconds:.2g} s"
    if seconds < 7200:
        return f"{seconds / 60:.2g} min"
    if days < 2:
        return f"{seconds / 3600:.2g} h"
    return f"{days:.1f} days"


def plural(count: int, noun: str) -> str:
    """1 → "1 node", 4 → "4 nodes"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def render_spec_summary(spec: JobSpec, *, console: Console) -> None:
    shape = resolve_shape(spec.model)
    par = spec.parallelism
    table = Table(title="job spec", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("task", spec.task)
    table.add_row("model", f"{spec.model.architecture}, {human_count(shape.total_params())} params "
                  f"({human_count(shape.active_params())} active)")
    table.add_row("shape", f"{shape.n_layers} layers × d_model {shape.d_model}, {shape.n_heads} heads "
                  f"({shape.n_kv_heads} kv), ffn {shape.ffn_hidden}, vocab {shape.vocab_size}")
    if shape.moe is not None:
        m = shape.moe
        table.add_row("experts", f"{m.num_experts} routed (top-{m.top_k}) + {m.num_shared_experts} shared, "
                      f"hidden {m.expert_hidden}")
    table.add_row("layout", f"dp {par.data_parallel} × tp {par.tensor_parallel} × pp {par.pipeline_parallel}"
                  f" (ep {par.expert_parallel}), ZeRO-{par.zero_stage}")
    table.add_row("precision", f"compute {spec.precision.compute}, optimizer states {spec.precision.optimizer_state}")
    table.add_row("data", f"{spec.data.tokens_total:.3g} tokens, seq {spec.data.seq_len}, "
                  f"{len(spec.data.sources)} source(s)")
    table.add_row("hardware", f"{spec.hardware.accelerator}, {spec.hardware.gpus_per_node}/node")
    console.print(table)
