"""LoRA adapter shapes: which Linear of our block a target name means, and how many parameters rank-r adapters
add (r·(in + out) per target Linear). Shape-level only, so the planner's inputs can count them."""

from __future__ import annotations

from leantrain.spec.shapes import ModelShape


def target_shapes(shape: ModelShape, *, moe_layer: bool) -> dict[str, tuple[int, int]]:
    """(in, out) of each Linear a LoRA target name can mean in one of our blocks (routed experts get none)."""
    d, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    shapes = {"wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d)}
    if not moe_layer:
        shapes.update({"w1": (d, f), "w3": (d, f), "w2": (f, d)})
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
    return total
