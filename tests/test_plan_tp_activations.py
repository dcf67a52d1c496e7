"""Tensor parallelism's activations (fp8's float8 styles, MoE experts split over TP): what the trainer's blocks
save for backward against the plan's count.

The blocks are built and split as the trainer does (train/precision.py's float8 swap, then
parallel/tensor.py's TP plan, and parallel/expert.py's split of the routed experts' hidden width when there is
no expert parallelism) on rank 0 of a 2-rank fake process group, with real tensors on the CPU: the fake
group moves no data, which changes no shape, and a fake group is not gloo, so torchao's float8 TP styles are
used as under NCCL. Per layer and token (two depths × two sequence lengths: the embedding, the head and the
per-position tables cancel), autograd's saved tensors are counted once per storage, float8 data included.
"""

from __future__ import annotations

import pytest
import torch

from leantrain.plan.activations import activation_terms, float8_tp_saved_bytes, layer_activation_bytes
from leantrain.plan.inputs import plan_inputs
from leantrain.spec import spec_from_dict

TP = 2
# widths float8 takes (multiples of 16, per TP rank too); small, as the CPU's float8 matmul is slow
FIELDS = {"d_model": 128, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 448, "vocab_size": 256,
          "tie_embeddings": False}


MOE = {"architecture": "moe", "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 128, "num_shared_experts": 1,
                                     "first_dense_layers": 0}}


def _spec(compute: str, *, layers: int, seq_len: int, mlp: str):
    fields = {**FIELDS, "n_layers": layers} | ({"mlp": mlp, "ffn_hidden": 512} if mlp not in ("swiglu", "moe") else {})
    fields |= MOE if mlp == "moe" else {}
    return spec_from_dict({"model": fields, "data": {"tokens_total": 1e6, "seq_len": seq_len},
                           "training": {"global_batch_tokens": seq_len}, "precision": {"compute": compute}})


def _saved_bytes(compute: str, *, layers: int, seq_len: int, sp: bool, recompute: str, mlp: str) -> float:
    """Bytes autograd saves in one forward of the model on TP rank 0, weights in bf16 (as FSDP2 gathers them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from leantrain.model import build_model, model_args_from_spec
    from leantrain.parallel.expert import apply_expert_tensor_parallel
    from leantrain.parallel.tensor import apply_tensor_parallel
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    spec = _spec(compute, layers=layers, seq_len=seq_len, mlp=mlp)
    policy = PrecisionPolicy(compute=compute, param_dtype=torch.float32, device_type="cpu")
    model = apply_precision(build_model(model_args_from_spec(spec.model, max_seq_len=seq_len),
                                        device=torch.device("cpu"), seed=0), policy)
    for param in model.parameters():  # buffers (RoPE's tables) stay fp32, as FSDP2's param_dtype leaves them
        param.data = param.data.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, tp_mesh=mesh, sequence_parallel=sp, loss_parallel_enabled=True, seq_len=seq_len)
    if mlp == "moe":  # the trainer's TP without EP (parallel/parallelize.py)
        apply_expert_tensor_parallel(model, tp_mesh=mesh)
    model.set_recompute(recompute)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        inner = t
        while type(inner) not in (torch.Tensor, torch.nn.Parameter):
            # a DTensor's shard, a functional collective's AsyncCollectiveTensor, torchao's Float8Tensor's data
            inner = inner._local_tensor if isinstance(inner, DTensor) else (
                inner.elem if hasattr(inner, "elem") else inner._data)
        saved[inner.untyped_storage().data_ptr()] = inner.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, FIELDS["vocab_size"], (1, seq_len)))
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules()) == (compute == "fp8")
    return float(sum(saved.values()))


def _per_layer_token(compute: str, **kw: object) -> float:
    short, long = 32, 64
    return ((_saved_bytes(compute, layers=2, seq_len=long, **kw) - _saved_bytes(compute, layers=1, seq_len=long, **kw))
            - (_saved_bytes(compute, layers=2, seq_len=short, **kw)
               - _saved_bytes(compute, layers=1, seq_len=short, **kw))) / (long - short)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("recompute", ["selective", "none"])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_fp8_tp_blocks_save_what_the_plan_counts(sp: bool, recompute: str, mlp: str) -> None:
    """bf16 is the plan's eager count; fp8 is that less `float8_tp_saved_bytes`, to the byte. Without it the plan
    counted fp8 as bf16: 4.25 bytes per d-model width a token too many per SwiGLU layer here with sequence
    parallelism and selective recompute (torchao's styles keep float8 copies of the gathered inputs and of wo's
    and w2's inputs). Also pins RoPE's cast tables as whole-sequence under sequence parallelism (bf16 and fp8)."""
    from leantrain.parallel.dryrun import fake_process_group

    with fake_process_group(rank=0, world_size=TP):
        measured = {c: _per_layer_token(c, sp=sp, recompute=recompute, mlp=mlp) for c in ("bf16", "fp8")}
    inputs = plan_inputs(_spec("fp8", layers=2, seq_len=64, mlp=mlp))
    terms = activation_terms(inputs.shape, seq_len=64, act_bytes=inputs.act_bytes, flash=True, moe_layer=False)
    bf16 = layer_activation_bytes(terms, tokens=1, tp=TP, sp=sp, recompute=recompute,  # type: ignore[arg-type]
                                  act_bytes=inputs.act_bytes, d_model=FIELDS["d_model"])
    saved = float8_tp_saved_bytes(inputs.shape, tp=TP, sp=sp, recompute=recompute,  # type: ignore[arg-type]
                                  act_bytes=inputs.act_bytes, moe_layer=False)
    assert measured["bf16"] == pytest.approx(bf16, rel=1e-6)
    assert measured["fp8"] == pytest.approx(bf16 - saved, rel=1e-6)
    assert measured["fp8"] != measured["bf16"]  # the float8 styles ran


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_experts_split_over_tp_keep_whole_rows_as_the_plan_counts(sp: bool) -> None:
    """TP without EP splits each routed expert's hidden width; every TP rank routes all of the layer's tokens, so
    the routed copies' rows, their indices and routing weights and the router's scores are whole on each rank
    (`ActivationTerms.expert_rows`). Until 2026-12-07 the plan divided them by tp: 12 % short here (3,832 against
    4,376 bytes a token and layer with SP), activations 0.92 of the rehearsal on the grid's `moe fsdp4 tp2`. The
    plan's eager MoE count is within 0.5 % of the model's at tp 1 (tests/test_plan_formulas.py), hence the 1 %."""
    from leantrain.parallel.dryrun import fake_process_group

    with fake_process_group(rank=0, world_size=TP):
        measured = _per_layer_token("bf16", sp=sp, recompute="selective", mlp="moe")
    inputs = plan_inputs(_spec("bf16", layers=2, seq_len=64, mlp="moe"))
    terms = activation_terms(inputs.shape, seq_len=64, act_bytes=inputs.act_bytes, flash=True, moe_layer=True)
    planned = {whole: layer_activation_bytes(terms, tokens=1, tp=TP, sp=sp, recompute="selective",
                                             act_bytes=inputs.act_bytes, d_model=FIELDS["d_model"],
                                             experts_whole_rows=whole) for whole in (True, False)}
    assert planned[True] == pytest.approx(measured, rel=0.01)
    assert planned[False] < 0.9 * measured
