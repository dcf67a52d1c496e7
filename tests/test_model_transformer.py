"""The dense model: parameter counts equal the planner's, attention is causal, recompute keeps gradients."""

from __future__ import annotations

import pytest
import torch

from leantrain.model import ModelArgs, Transformer, build_model, model_args_from_spec, num_params
from leantrain.spec.schema import ModelSpec
from leantrain.spec.shapes import resolve_shape

TINY = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "vocab_size": 97}


def tiny_args(**overrides: object) -> ModelArgs:
    spec = ModelSpec(**{**TINY, **overrides})
    return model_args_from_spec(spec, max_seq_len=16)


@pytest.mark.parametrize(
    "model_fields",
    [
        {**TINY, "tie_embeddings": True},
        {**TINY, "tie_embeddings": False},
        {**TINY, "n_kv_heads": 4},
        {**TINY, "n_layers": 3, "architecture": "moe",
         "moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1, "first_dense_layers": 1}},
        {"size_billion": 8.03},  # Llama 3 8B, built on the meta device (no memory)
    ],
    ids=["tied", "untied", "mha", "moe-shared-first-dense", "llama3-8b-meta"],
)
def test_parameter_count_matches_planner(model_fields: dict) -> None:
    spec = ModelSpec(**model_fields)
    with torch.device("meta"):
        model = Transformer(model_args_from_spec(spec, max_seq_len=16))
    assert num_params(model) == resolve_shape(spec).total_params()


def test_shapes_follow_the_spec() -> None:
    model = build_model(tiny_args(), device=torch.device("cpu"), seed=0)
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (32, 32)
    assert attention.wk.weight.shape == (2 * 8, 32)  # 2 kv heads × head_dim 8
    assert model.layers["1"].feed_forward.w1.weight.shape == (64, 32)
    logits = model(torch.randint(0, 97, (3, 16)))
    assert logits.shape == (3, 16, 97)
    assert not model.rope.is_meta and torch.isfinite(logits).all()


def test_attention_is_causal() -> None:
    model = build_model(tiny_args(), device=torch.device("cpu"), seed=0)
    tokens = torch.randint(0, 97, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 97  # change only the future from position 10 on
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert (a[:, 10] - b[:, 10]).abs().max() > 1e-4  # and the changed positions do see it


def test_same_seed_same_weights_and_tied_embeddings_shared() -> None:
    first = build_model(tiny_args(tie_embeddings=True), device=torch.device("cpu"), seed=3)
    second = build_model(tiny_args(tie_embeddings=True), device=torch.device("cpu"), seed=3)
    for (name, p), q in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert first.output is None and "output.weight" not in first.state_dict()


@pytest.mark.parametrize(("mode", "architecture"), [("selective", "dense"), ("selective", "moe"), ("full", "dense"),
                                                   ("full", "moe"), ("op", "dense")])
def test_recompute_gives_the_same_gradients(mode: str, architecture: str) -> None:
    extra = {"architecture": "moe", "moe": {"num_experts": 4, "top_k": 2}} if architecture == "moe" else {}
    args = tiny_args(**extra)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(recompute: str) -> dict[str, torch.Tensor]:
        model = build_model(args, device=torch.device("cpu"), seed=0)
        model.set_recompute(recompute)  # type: ignore[arg-type]
        loss = model(tokens).logsumexp(-1).mean()
        aux = model.auxiliary_loss()
        (loss if aux is None else loss + aux).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference, recomputed = grads("none"), grads(mode)
    assert reference.keys() == recomputed.keys()
    for name in reference:
        torch.testing.assert_close(recomputed[name], reference[name], rtol=0, atol=0, msg=name)


def _record_op_policy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, str, bool]]:
    """Record the op policy's decisions as (in the recompute, op, kept) while the test runs."""
    from torch.utils import checkpoint as ckpt
    from torch.utils.checkpoint import CheckpointPolicy

    decisions: list[tuple[bool, str, bool]] = []
    original = ckpt.create_selective_checkpoint_contexts

    def recording(policy):  # type: ignore[no-untyped-def]
        def wrapped(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = policy(ctx, op, *args, **kwargs)
            decisions.append((bool(ctx.is_recompute), str(op), out == CheckpointPolicy.MUST_SAVE))
            return out
        return original(wrapped)

    monkeypatch.setattr(ckpt, "create_selective_checkpoint_contexts", recording)
    return decisions


def test_op_recompute_keeps_every_second_matmul_and_the_attention_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op policy's decisions on one block: of the seven matmuls (wq, wk, wv, wo, w1, w3, w2) the 1st, 3rd, 5th
    and 7th are kept, the attention kernel's outputs are kept, norms and the activation function are not (torch
    replays these decisions in the recompute; the gradients equal no recompute's, above)."""
    decisions = _record_op_policy(monkeypatch)
    model = build_model(tiny_args(n_layers=1), device=torch.device("cpu"), seed=0)
    model.set_recompute("op")
    model(torch.randint(0, 97, (2, 16))).logsumexp(-1).mean().backward()
    forward = [(op, keep) for r, op, keep in decisions if not r]
    mms = [keep for op, keep in forward if op in ("aten.mm.default", "aten.addmm.default")]
    assert mms == [True, False, True, False, True, False, True], mms
    assert any("scaled_dot_product" in op and keep for op, keep in forward), forward
    assert not any(keep for op, keep in forward if "rsqrt" in op or "silu" in op or op.startswith("aten.mul"))


def test_op_recompute_under_fp8_keeps_the_same_matmuls_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fp8 compute (torchao's float8 Linear layers, `train/precision.py`) the op policy still sees a block's
    seven matmuls as `aten.mm` (the float8 tensor subclass dispatches to `_scaled_mm` below the policy), keeps the
    1st, 3rd, 5th and 7th (bf16 outputs, the bytes the plan counts: `leantrain rehearse` of the 8B-wide FSDP 8 row
    with fp8, activations 1.00 of the plan), and the gradients equal fp8 without recompute bit for bit."""
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    decisions = _record_op_policy(monkeypatch)
    args = tiny_args(n_layers=1, d_model=64, n_heads=4, n_kv_heads=4, ffn_hidden=128)  # fp8 GEMMs: dims % 16
    policy = PrecisionPolicy(compute="fp8", param_dtype=torch.float32, device_type="cpu")
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(recompute: str) -> dict[str, torch.Tensor]:
        model = apply_precision(build_model(args, device=torch.device("cpu"), seed=0), policy)
        assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
        model.set_recompute(recompute)  # type: ignore[arg-type]
        with policy.autocast():
            model(tokens).float().logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads("none")
    decisions.clear()
    recomputed = grads("op")
    mms = [keep for r, op, keep in decisions if not r and op == "aten.mm.default"]
    assert mms == [True, False, True, False, True, False, True], mms
    for name in reference:
        torch.testing.assert_close(recomputed[name], reference[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_op_recompute_composes_with_compiled_blocks() -> None:
    """`training.compile` (per-block torch.compile, the fused kernels a plan may assume) with `op`, which the layout
    search proposes for dense SwiGLU models: the policy's call-order matmul count runs under compile, and the
    gradients equal eager without recompute to compile's rounding."""
    args = tiny_args(n_layers=2)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(recompute: str, compiled: bool) -> dict[str, torch.Tensor]:
        model = build_model(args, device=torch.device("cpu"), seed=0)
        model.set_recompute(recompute)  # type: ignore[arg-type]
        if compiled:
            model.compile_blocks()
        model(tokens).logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference, compiled = grads("none", False), grads("op", True)
    for name in reference:
        torch.testing.assert_close(compiled[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)
