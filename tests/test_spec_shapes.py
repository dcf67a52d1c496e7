"""Model shapes from a nominal size, and parameter counts."""

from __future__ import annotations

import pytest

from leantrain.spec import resolve_shape, spec_from_dict


def shape_for(**model: object):
    return resolve_shape(spec_from_dict({"model": model, "data": {"tokens_total": 1e9}}).model)


def test_llama3_8b_reproduced_from_size() -> None:
    shape = shape_for(size_billion=8.03)
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads, shape.ffn_hidden) == (
        32, 4096, 32, 8, 14336,
    )
    assert shape.total_params() == 8_030_261_248  # Meta's published Llama 3 8B count


@pytest.mark.parametrize("size", [1, 3, 10, 13, 34, 70, 405])
def test_sized_models_land_near_target(size: float) -> None:
    shape = shape_for(size_billion=size)
    assert shape.total_params() == pytest.approx(size * 1e9, rel=0.05)
    assert shape.nominal_params == size * 1e9
    assert shape.d_model % shape.n_heads == 0 and shape.n_heads % shape.n_kv_heads == 0
    if shape.d_model >= 4096:
        assert shape.n_heads % 8 == 0  # so any tensor-parallel degree up to 8 divides the heads


def test_explicit_shape_counts_exactly() -> None:
    shape = shape_for(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=512,
                      tie_embeddings=True)
    per_layer = (2 * 64 * 64 + 2 * 64 * 32) + 3 * 64 * 192 + 2 * 64
    assert shape.total_params() == 2 * per_layer + 64 + 512 * 64
    assert shape.active_params() == shape.total_params()


def test_moe_active_params_count_top_k_and_shared() -> None:
    shape = shape_for(architecture="moe", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                      vocab_size=512, moe={"num_experts": 8, "top_k": 2, "num_shared_experts": 1,
                                           "expert_hidden": 32})
    expert = 3 * 64 * 32
    assert shape.total_params() - shape.active_params() == 2 * (8 - 2) * expert
    assert shape.moe_layer_params(active=False) == 64 * 8 + 9 * expert


def test_explicit_fields_override_the_size_rule() -> None:
    shape = shape_for(size_billion=8.03, vocab_size=32000)
    assert shape.vocab_size == 32000
    assert shape.nominal_params == 8.03e9
