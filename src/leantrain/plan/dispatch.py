"""Expert-parallel all-to-all: the dispatch and combine of each token's routed copies, and what overlapping
them with compute costs.

One MoE layer moves four all-to-alls per micro-batch (forward dispatch and combine, their backward twins;
full recompute repeats the forward pair). Each carries, per token, its activation (÷ tp: each TP rank sends
its share of the tokens, parallel/expert.py, with sequence parallelism or without) for every routed copy
that leaves the GPU:
- EP inside a node: k·(ep − 1)/ep copies over the intra-node link (NVLink).
- EP across N nodes, plain all-to-all (`plan.moe_node_limit` null): each copy for a remote GPU crosses the
  inter-node link, k·(N − 1)/N of them per token; copies for GPUs of the same node go over NVLink at the same
  time, so the call takes the slower of the two.
- Node-limited routing (DeepSeek-V3 §2.1.2 and §3.2.2, M = 4): a token's experts lie on at most M nodes; it is
  sent once over InfiniBand to each target node (to the GPU with the same in-node index) and forwarded there
  over NVLink to the GPUs holding its experts, the two fully overlapped. Inter-node copies per token are
  min(M, N, k)·(N − 1)/N (with balanced routing its own node is one of the targets with probability M/N),
  NVLink copies k·(g − 1)/g for g EP ranks per node.
- Bytes per value: the dispatched tensor is the expert up-projection's input, so where Linear inputs are kept
  in fp8 (`linear_input_bytes` 1) the forward dispatch and the backward dispatch of the gradient before the
  down-projection carry fp8, and both combines the compute dtype (DeepSeek-V3 §3.3.3, "low-precision
  communication").
- Overlap is not free: DeepSeek's dispatch/combine kernels take 20 of the H800's 132 SMs (§3.5.1), so compute
  that runs beside a hidden all-to-all runs on the remaining SMs: hiding t seconds costs t · 20/132.
"""

from __future__ import annotations

import math

from leantrain.plan.inputs import COLLECTIVE_LATENCY_S, PlanInputs
from leantrain.plan.layout import Layout

# Share of a GPU's SMs the overlapped dispatch/combine kernels occupy (DeepSeek-V3 §3.5.1: 20 of 132 on H800).
COMM_SM_SHARE = 20 / 132


def copies_per_token(inputs: PlanInputs, layout: Layout) -> tuple[float, float]:
    """(inter-node, intra-node) routed copies of one token that leave its GPU, per all-to-all."""
    moe = inputs.shape.moe
    assert moe is not None
    k, ep = moe.top_k, layout.ep
    span = ep * layout.tp  # EP ranks are dp ranks, tp apart (parallel/dims.py: tp innermost)
    if span <= inputs.gpus_per_node:
        return 0.0, k * (ep - 1) / ep
    nodes = math.ceil(span / inputs.gpus_per_node)
    per_node = ep / nodes
    if inputs.moe_node_limit is None:
        return k * (nodes - 1) / nodes, k * (per_node - 1) / ep
    targets = min(inputs.moe_node_limit, nodes, k)
    return targets * (nodes - 1) / nodes, k * (per_node - 1) / per_node


def all_to_all_s(inputs: PlanInputs, layout: Layout, *, tokens: int, moe_layers: int) -> float:
    """Seconds of expert all-to-all one micro-batch of `tokens` tokens spends on a stage's MoE layers,
    before any overlap."""
    if inputs.shape.moe is None or layout.ep <= 1 or moe_layers <= 0:
        return 0.0
    inter, intra = copies_per_token(inputs, layout)
    values = tokens * inputs.shape.d_model / layout.tp

    def call(value_bytes: float) -> float:
        data = values * value_bytes
        return COLLECTIVE_LATENCY_S + max(inter * data / inputs.inter_node_bytes_s,
                                          intra * data / inputs.intra_node_bytes_s)

    dispatch, combine = call(inputs.linear_input_bytes), call(inputs.act_bytes)
    pairs = 3 if layout.recompute == "full" else 2  # forward, backward (+ the recomputed forward)
    return moe_layers * pairs * (dispatch + combine)


def exposed_all_to_all_s(raw_s: float, *, compute_s: float, overlap: float) -> float:
    """What a micro-batch's all-to-all adds to its time: the unhidden part, plus the SMs hiding the rest takes
    from compute. At most `overlap` of it hides, and never more than the compute beside it."""
    hidden = min(raw_s * overlap, compute_s)
    return raw_s - hidden + hidden * COMM_SM_SHARE
