"""LoRA adapter shapes: which Linear of our block a target name means, and how many parameters rank-r adapters
add (r·(in + out) per target Linear). Shape-level only, so the planner's inputs can count them. The names
resolve as `model.lora.apply_lora` swaps them (every nn.Linear with that attribute name): the attention's
projections (MHA wq wk wv wo, or MLA's wq | wq_a wq_b, wkv_a, wkv_b, wo), the dense MLP's w1 w2 (w3 for SwiGLU),
in MoE layers the shared experts' SwiGLU and the router's gate; routed experts are stacked tensors, no Linear,
and get none. `output` (untied) is one Linear for the whole model."""

from __future__ import annotations

from leantrain.spec.shapes import ModelShape


def _attention(shape: ModelShape) -> dict[str, tuple[int, int]]:
    d, m = shape.d_model, shape.mla
    if m is None:
        q = shape.n_heads * shape.head_dim
        return {"wq": (d, q), "wk": (d, shape.kv_dim), "wv": (d, shape.kv_dim), "wo": (q, d)}
    heads = shape.n_heads
    out = {"wkv_a": (d, m.kv_lora_rank + m.qk_rope_head_dim),
           "wkv_b": (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)), "wo": (heads * m.v_head_dim, d)}
    if m.q_lora_rank:
        out.update({"wq_a": (d, m.q_lora_rank), "wq_b": (m.q_lora_rank, heads * m.qk_head_dim)})
    else:
        out["wq"] = (d, heads * m.qk_head_dim)
    return out


def target_shapes(shape: ModelShape, *, moe_layer: bool) -> dict[str, tuple[int, int]]:
    """(in, out) of the Linear each LoRA target name means in one of our blocks (a name may mean none; routed
    experts get none)."""
    d = shape.d_model
    shapes = _attention(shape)
    moe = shape.moe
    if moe_layer and moe is not None:
        hidden = moe.num_shared_experts * moe.expert_hidden
        if hidden:
            shapes.update({"w1": (d, hidden), "w3": (d, hidden), "w2": (hidden, d)})
        shapes["gate"] = (d, moe.num_experts)
    else:
        f = shape.ffn_hidden
        shapes.update({"w1": (d, f), "w2": (f, d)})
        if shape.mlp == "swiglu":
            shapes["w3"] = (d, f)
    return shapes


def per_layer_targets(shape: ModelShape, targets: tuple[str, ...], *, moe_layer: bool) -> list[tuple[int, int]]:
    known = target_shapes(shape, moe_layer=moe_layer)
    return [known[name] for name in targets if name in known]


def lora_param_count(shape: ModelShape, *, rank: int, targets: tuple[str, ...]) -> float:
    """Trainable adapter parameters of the whole model (0 without LoRA)."""
    if not rank:
        return 0.0
    total = 0.0
    for count, moe in ((shape.num_dense_layers, False), (shape.num_moe_layers, True)):
        total += count * sum(rank * (i + o) for i, o in per_layer_targets(shape, targets, moe_layer=moe))
    if "output" in targets and not shape.tie_embeddings:
        total += rank * (shape.d_model + shape.vocab_size)
    return total
