"""Mixture-of-experts: dispatch equals a per-token reference, balancing moves the right way, counts are exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leantrain.model import build_model, model_args_from_spec
from leantrain.model.moe import MoE
from leantrain.spec.schema import ModelSpec


def moe_args(**moe: object):
    spec = ModelSpec(
        n_layers=2, d_model=16, n_heads=2, ffn_hidden=32, vocab_size=50, architecture="moe",
        moe={"num_experts": 4, "top_k": 2, "expert_hidden": 8, **moe},
    )
    return model_args_from_spec(spec, max_seq_len=8)


def reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The slow, obvious computation: for each token, its top-k experts one by one."""
    flat = x.reshape(-1, x.shape[-1])
    bias = layer.expert_bias if layer.balance == "aux_free" else None
    _, top_idx, top_weights = layer.router(flat, selection_bias=bias)
    out = torch.zeros_like(flat)
    experts = layer.experts
    for t in range(flat.shape[0]):
        for slot in range(layer.top_k):
            e = int(top_idx[t, slot])
            h = F.silu(flat[t] @ experts.w1[e]) * (flat[t] @ experts.w3[e])
            out[t] += top_weights[t, slot] * (h @ experts.w2[e])
    if layer.shared_experts is not None:
        out += layer.shared_experts(flat)
    return out.view_as(x)


def test_grouped_dispatch_matches_per_token_reference() -> None:
    for router in ("softmax", "sigmoid"):
        model = build_model(moe_args(router=router, num_shared_experts=1), device=torch.device("cpu"), seed=0)
        layer = model.moe_layers()[0]
        x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


def test_counts_are_exact_and_not_doubled_by_recompute() -> None:
    model = build_model(moe_args(balance="aux_free"), device=torch.device("cpu"), seed=0)
    model.set_recompute("full")
    tokens = torch.randint(0, 50, (2, 8))
    model(tokens).sum().backward()  # backward reruns each block's forward
    counts = torch.stack([m.update_balance(bias_update_rate=0.0) for m in model.moe_layers()])
    assert counts.shape == (2, 4)
    assert torch.equal(counts.sum(dim=1), torch.full((2,), 2 * 8 * 2.0))  # tokens × top_k per layer
    assert model.moe_layers()[0].tokens_per_expert.sum() == 0  # reset after the update


def test_a_no_grad_pass_in_train_mode_adds_no_counts() -> None:
    """LoRA DPO's reference pass runs the policy in train mode with its adapters off, under no_grad: its tokens
    were added to the balance counts (the expert-load metric and the aux-free bias update saw each token twice)."""
    model = build_model(moe_args(balance="aux_free"), device=torch.device("cpu"), seed=0).train()
    tokens = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        model(tokens)
    assert all(m.tokens_per_expert.sum() == 0 for m in model.moe_layers())
    model(tokens).sum().backward()
    assert all(m.tokens_per_expert.sum() == 2 * 8 * 2 for m in model.moe_layers())


def test_aux_free_bias_moves_towards_underloaded_experts() -> None:
    model = build_model(moe_args(balance="aux_free", bias_update_rate=0.01), device=torch.device("cpu"), seed=0)
    layer = model.moe_layers()[0]
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 3.0, 1.0]))
    layer.update_balance(bias_update_rate=0.01)
    assert torch.allclose(layer.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_aux_free_bias_changes_selection_not_weights() -> None:
    model = build_model(moe_args(balance="aux_free", top_k=1), device=torch.device("cpu"), seed=0)
    layer = model.moe_layers()[0]
    x = torch.randn(8, 16)
    layer.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    probs, top_idx, weights = layer.router(x, selection_bias=layer.expert_bias)
    assert (top_idx == 0).all()
    torch.testing.assert_close(weights[:, 0], probs[:, 0])


def test_aux_loss_follows_the_switch_formula_and_trains_the_router() -> None:
    model = build_model(moe_args(balance="aux_loss", aux_loss_coef=1.0), device=torch.device("cpu"), seed=0)
    for layer in model.moe_layers():
        torch.nn.init.zeros_(layer.router.gate.weight)  # uniform probabilities; topk ties pick experts 0, 1
    model(torch.randint(0, 50, (2, 8)))
    aux = model.auxiliary_loss()
    # share = [0.5, 0.5, 0, 0], mean prob = 0.25 each: E · Σ f·P = 4 × 0.25 = 1 per layer, 2 layers
    assert aux is not None and abs(float(aux.detach()) - 2.0) < 1e-6
    aux.backward()
    assert model.moe_layers()[0].router.gate.weight.grad is not None


def test_grouped_gemm_and_padded_fallback_agree_in_forward_and_backward(monkeypatch) -> None:  # noqa: ANN001
    import leantrain.model.moe as moe_module

    model = build_model(moe_args(num_shared_experts=1), device=torch.device("cpu"), seed=0)
    layer = model.layers["1"].feed_forward
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), layer.experts.w2.grad.clone()

    grouped = run()
    monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda device, dtype: False)
    padded = run()
    torch.testing.assert_close(grouped[0], padded[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped[1], padded[1], rtol=1e-5, atol=1e-6)


def test_moe_forward_reads_nothing_on_the_host(monkeypatch) -> None:  # noqa: ANN001
    """Every way a tensor's value reaches Python (a device sync on a GPU) raises inside the MoE forward."""
    model = build_model(moe_args(num_shared_experts=1), device=torch.device("cpu"), seed=0)
    layer = model.layers["1"].feed_forward
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))

    def host_read(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a host read (.item/.tolist/int/float/bool) in the MoE forward")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = layer(x)
    monkeypatch.undo()
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_moe_forward_has_no_host_sync_and_compiles_as_one_graph() -> None:
    """fullgraph=True fails on any graph break: `.item()`, `.tolist()` or a data-dependent output shape (bf16:
    the grouped GEMM's compile-time rules take bf16, the dtype GPUs train MoE in)."""
    model = build_model(moe_args(), device=torch.device("cpu"), seed=0).to(torch.bfloat16)
    layer = model.layers["1"].feed_forward
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    torch._dynamo.reset()
