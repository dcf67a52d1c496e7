"""Terminal rendering of a parsed spec (the `check` command and the demo's first stage)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from leantrain.spec import JobSpec, resolve_shape


def render_spec_summary(spec: JobSpec, *, console: Console) -> None:
    shape = resolve_shape(spec.model)
    par = spec.parallelism
    table = Table(title="job spec", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("task", spec.task)
    table.add_row("model", f"{spec.model.architecture}, {shape.total_params() / 1e9:.3f}B params "
                  f"({shape.active_params() / 1e9:.3f}B active)")
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
