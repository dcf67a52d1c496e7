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


def test_head_dim_other_than_d_model_over_n_heads_is_counted_planned_and_checked() -> None:
    """Qwen3-30B-A3B (Qwen3 technical report, Table 2: 48 layers, 32 query / 4 KV heads, 128 experts, 8 active;
    model card: 30.5B total, 3.3B activated; config.json hidden_size 2048, head_dim 128, moe_intermediate_size
    768, vocab 151936): 128-wide heads on a 2048-wide model make q and o 2048 × 4096, twice what d_model / n_heads
    gives; the planner's FLOPs, and the spec rules, follow."""
    from leantrain.errors import UserInputError
    from leantrain.plan.flops import flops_per_token

    qwen3 = {"architecture": "moe", "vocab_size": 151936, "n_layers": 48, "d_model": 2048, "n_heads": 32,
             "n_kv_heads": 4, "head_dim": 128, "ffn_hidden": 768,
             "moe": {"num_experts": 128, "top_k": 8, "num_shared_experts": 0, "expert_hidden": 768}}
    shape = shape_for(**qwen3)
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (128, 4096, 512)
    assert shape.attention_params() == 2 * 2048 * 4096 + 2 * 2048 * 512
    assert shape.total_params() == pytest.approx(30.5e9, rel=0.005)
    assert shape.active_params() == pytest.approx(3.3e9, rel=0.02)
    narrow = shape_for(**{**qwen3, "head_dim": None})
    assert flops_per_token(shape, seq_len=4096).attention == 2 * flops_per_token(narrow, seq_len=4096).attention
    # d_model need not divide by n_heads once head_dim is given (Mistral NeMo: 5120 over 32 heads of 128)
    nemo = shape_for(n_layers=2, d_model=5120, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden=14336,
                     vocab_size=1000)
    assert nemo.q_dim == 4096
    data = {"model": {"n_layers": 2, "d_model": 60, "n_heads": 8, "ffn_hidden": 64, "vocab_size": 100},
            "data": {"tokens_total": 1e9}}
    with pytest.raises(UserInputError, match="give model.head_dim"):
        spec_from_dict(data)
    assert resolve_shape(spec_from_dict({**data, "model": {**data["model"], "head_dim": 8}}).model).q_dim == 64
    # a head_dim equal to d_model // n_heads where n_heads does not divide d_model (66 / 8) is still a given width
    uneven = {**data, "model": {**data["model"], "d_model": 66, "head_dim": 8}}
    assert resolve_shape(spec_from_dict(uneven).model).attn_head_dim == 8
    for bad, words in (({"head_dim": 7}, "must be even"),
                       ({"head_dim": 8, "mla": {"kv_lora_rank": 8}}, "model.mla")):
        with pytest.raises(UserInputError, match=words):
            spec_from_dict({**data, "model": {**data["model"], **bad}})
