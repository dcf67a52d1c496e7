"""Fine-tuning in the memory model (task: finetune; finetune.method full | lora | qlora | dpo).

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
- dpo (train/dpo.py): a micro-batch's rows are the pairs' chosen and rejected sequences, so activations are
  counted as for any micro_batch rows. Each step first runs the reference model's forward without gradients
  (its activations and logits are freed before the policy's forward, so they add no peak) — 2 FLOPs per
  parameter per token more (plan/inputs.py). With LoRA/QLoRA weights the reference is the frozen base with
  the adapters off: no memory. Full DPO holds a frozen copy of the weights, sharded and stored as the
  policy's (`reference_copies`: the parameter bytes twice, no gradients or optimizer states for the copy).
"""

from __future__ import annotations

from leantrain.plan.adapters import lora_param_count, per_layer_targets
from leantrain.plan.inputs import PlanInputs
from leantrain.spec.shapes import ModelShape

NF4_BYTES_PER_PARAM = (4 + 0.127) / 8  # QLoRA §3 (Double Quantization): 4-bit values + 0.127 bits of scales


def reference_copies(inputs: PlanInputs) -> float:
    """Copies of the trained weights a GPU holds: 2 for full DPO (the policy and its frozen reference), else 1."""
    return 2.0 if inputs.dpo_reference == "copy" else 1.0


def adapter_params(inputs: PlanInputs) -> float:
    """Trainable adapter parameters of the whole model (0 without LoRA)."""
    return lora_param_count(inputs.shape, rank=inputs.lora_rank, targets=inputs.lora_targets)


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
    for i, _ in per_layer_targets(inputs.shape, inputs.lora_targets, moe_layer=False):
        per_token += inputs.act_bytes * (inputs.lora_rank + (i if inputs.lora_dropout > 0 else 0))
    return tokens * per_token / tp


def frozen_base_counted(inputs: PlanInputs, recompute: str) -> bool:
    """Whether `frozen_base_bytes` applies: LoRA/QLoRA, eager kernels, no recompute or selective."""
    return bool(inputs.lora_rank) and not inputs.fused_kernels and recompute in ("none", "selective")


def frozen_base_bytes(inputs: PlanInputs, *, recompute: str, moe_layer: bool) -> float:
    """Per token, what one eager block keeps in full training and not when its base is frozen (LoRA/QLoRA freeze
    every base parameter, model/lora.py: a frozen matmul keeps its weight, not its input): each RMSNorm's
    normalised tensor, which only its weight's gradient reads (`weight * normed`); a norm's output when no adapter
    reads it (wq/wk/wv for the attention norm, w1/w3 for the MLP's); the down projection's input when w2 has no
    adapter (the attention output stays: the attention core keeps it). Counted where the plan counts these
    tensors (eager kernels; no recompute or selective); the adapters' own tensors are `adapter_activation_bytes`.
    LoRA runs without tensor parallelism (spec/rules.py). Measured on the trainer's LoRA model with saved-tensor
    hooks for three target sets (tests/test_plan_finetune.py)."""
    if not frozen_base_counted(inputs, recompute):
        return 0.0
    shape, e, targets = inputs.shape, inputs.act_bytes, set(inputs.lora_targets)
    unread = 2  # the two norms' normalised tensors
    if shape.mla is None and not {"wq", "wk", "wv"} & targets:
        unread += 1
    if not (moe_layer and shape.moe is not None):  # a dense MLP (an MoE layer's experts keep their own tensors)
        if not {"w1", "w3"} & targets:
            unread += 1
        if "w2" not in targets:
            return e * (unread * shape.d_model + shape.ffn_hidden)
    return e * unread * shape.d_model


def frozen_head_bytes(inputs: PlanInputs, *, tokens: int, recompute: str) -> float:
    """What the last stage's final norm and output projection do not keep when the base is frozen: the norm's
    normalised tensor, and its output (the projection's input) unless the projection has an adapter."""
    head_frozen = "output" not in inputs.lora_targets or inputs.shape.tie_embeddings
    per_token = inputs.act_bytes * inputs.shape.d_model * (2 if head_frozen else 1)
    return tokens * per_token if frozen_base_counted(inputs, recompute) else 0.0
