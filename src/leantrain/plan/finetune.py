"""Fine-tuning in the memory model (task: finetune; finetune.method full | lora | qlora).

- full: every weight trains — the pretraining arithmetic applies unchanged.
- lora (Hu et al. 2021): the base is frozen in the compute dtype (no gradients, no optimizer states); each
  target Linear of shape in → out gets adapters A (r × in) and B (out × r), r·(in + out) parameters, that
  train with gradients and Adam states like any weight. Targets are matched by name (wq, wk, wv, wo of every
  layer; w1, w2, w3 of the dense MLPs; routed experts get none).
- qlora (Dettmers et al. 2023, "QLoRA", §3): the base's Linear weights are stored in 4-bit NormalFloat with
  double-quantised block scales — 4 bits + 0.127 bits per parameter (blocks of 64, 8-bit scales with one
  fp32 second-level scale per 256 blocks) — while embeddings and norms stay in the compute dtype.
- activations: the base's own (its inputs still need gradients), plus per target the adapter's input after
  dropout (a new tensor when dropout > 0) and A's output (r values), both in the compute dtype.
"""

from __future__ import annotations

from leantrain.plan.inputs import PlanInputs
from leantrain.spec.shapes import ModelShape

NF4_BYTES_PER_PARAM = (4 + 0.127) / 8  # QLoRA §3 (Double Quantization): 4-bit values + 0.127 bits of scales


def target_shapes(shape: ModelShape, *, moe_layer: bool) -> dict[str, tuple[int, int]]:
    """(in, out) of each Linear a LoRA target name can mean in one of our blocks."""
    d, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    shapes = {"wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d)}
    if not moe_layer:
        shapes.update({"w1": (d, f), "w3": (d, f), "w2": (f, d)})
    return shapes


def _per_layer(shape: ModelShape, targets: tuple[str, ...], *, moe_layer: bool) -> list[tuple[int, int]]:
    known = target_shapes(shape, moe_layer=moe_layer)
    return [known[name] for name in targets if name in known]


def adapter_params(inputs: PlanInputs) -> float:
    """Trainable adapter parameters of the whole model (0 without LoRA)."""
    if not inputs.lora_rank:
        return 0.0
    shape, r = inputs.shape, inputs.lora_rank
    total = 0.0
    for count, moe in ((shape.num_dense_layers, False), (shape.num_moe_layers, True)):
        total += count * sum(r * (i + o) for i, o in _per_layer(shape, inputs.lora_targets, moe_layer=moe))
    return total


def quantised_params(shape: ModelShape) -> float:
    """Parameters QLoRA stores in NF4: every Linear weight of the blocks (not embeddings or norms)."""
    norms = 2 * shape.d_model * shape.n_layers + shape.d_model
    return shape.non_embedding_params() - norms


def frozen_weight_bytes(inputs: PlanInputs) -> float:
    """Bytes of the frozen base model (whole model, before any sharding)."""
    shape = inputs.shape
    total = shape.total_params()
    if inputs.finetune == "qlora":
        linear = quantised_params(shape)
        return linear * NF4_BYTES_PER_PARAM + (total - linear) * inputs.weight_bytes
    return total * inputs.weight_bytes


def adapter_activation_bytes(inputs: PlanInputs, *, tokens: int, tp: int) -> float:
    """Saved bytes of one layer's adapters for one micro-batch (dense-layer targets, the upper bound)."""
    if not inputs.lora_rank:
        return 0.0
    per_token = 0.0
    for i, _ in _per_layer(inputs.shape, inputs.lora_targets, moe_layer=False):
        per_token += inputs.act_bytes * (inputs.lora_rank + (i if inputs.lora_dropout > 0 else 0))
    return tokens * per_token / tp
