"""Initialisation by parameter name: deterministic, order-free, the same in every dtype and every split."""

from __future__ import annotations

import math

import pytest
import torch

from leantrain.model.init import init_parameters, init_rule, param_seed
from leantrain.model.transformer import Transformer, build_model, model_args_from_spec
from leantrain.parallel.pipeline import build_stage_modules
from leantrain.spec.schema import ModelSpec

CPU = torch.device("cpu")


def args(**fields: object):  # noqa: ANN201
    base = {"n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "vocab_size": 96,
            "tie_embeddings": False}
    return model_args_from_spec(ModelSpec(**(base | fields)), max_seq_len=16)


def test_pipeline_stages_initialise_to_the_single_process_values() -> None:
    """A stage initialised on its own (as a pipeline rank does) holds exactly the whole model's values."""
    model_args = args()
    whole = build_model(model_args, device=CPU, seed=5)
    with torch.device("meta"):
        meta = Transformer(model_args)
    (_, stage), = build_stage_modules(meta, pp_rank=1, pp=2, virtual_stages=1)
    stage.to_empty(device=CPU)
    init_parameters(stage, args=model_args, seed=5)
    reference = dict(whole.named_parameters())
    names = [name for name, _ in stage.named_parameters()]
    assert "layers.3.attention.wq.weight" in names and "output.weight" in names
    for name, param in stage.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_bf16_masters_are_the_fp32_values_rounded() -> None:
    model_args = args()
    fp32 = build_model(model_args, device=CPU, seed=1)
    with torch.device("meta"):
        bf16 = Transformer(model_args).to(torch.bfloat16)
    bf16.to_empty(device=CPU)
    bf16.init_weights(seed=1)
    for (name, a), b in zip(fp32.named_parameters(), bf16.parameters(), strict=True):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a.to(torch.bfloat16), b), name


def test_seeds_differ_and_statistics_follow_the_rules() -> None:
    model_args = args(n_layers=8, d_model=128, n_heads=4, n_kv_heads=4, ffn_hidden=512)
    a = build_model(model_args, device=CPU, seed=0)
    b = build_model(model_args, device=CPU, seed=1)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
    wq, wo = a.layers["0"].attention.wq.weight.detach(), a.layers["0"].attention.wo.weight.detach()
    assert float(wq.std()) == pytest.approx(0.02, rel=0.05)
    assert float(wo.std()) == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)  # depth-scaled output projection
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert float(a.output.weight.detach().abs().max()) <= 3 / math.sqrt(128)
    # Each parameter has its own stream: two parameters of the same shape do not repeat each other.
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_every_moe_parameter_has_a_rule_and_unknown_names_are_refused() -> None:
    model_args = args(architecture="moe", moe={"num_experts": 4, "top_k": 2, "num_shared_experts": 1,
                                                 "expert_hidden": 16})
    with torch.device("meta"):
        model = Transformer(model_args)
    for name, _ in model.named_parameters():
        init_rule(name, model_args)  # raises for a parameter without a rule
    with pytest.raises(KeyError, match="lora_A"):
        init_rule("layers.0.attention.wq.lora_A.weight", model_args)
    assert param_seed(0, "a") != param_seed(0, "b") and param_seed(3, "a") == param_seed(3, "a")


@pytest.mark.parametrize("world", [4, 8])
def test_every_shard_is_generated_rank_locally_in_blocks(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of a (2, world/2) mesh fills its own shard, for every placement the layouts produce (FSDP dim 0,
    expert FSDP dim 1, TP row-wise, FSDP over TP's strided shard), with exactly the values of the whole tensor,
    while generating at most one block at a time and only the blocks its rows overlap."""
    from functools import partial

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import leantrain.model.init as init

    monkeypatch.setattr(init, "BLOCK_ELEMENTS", 64)  # 24 × 10 × 6 → one row (60 elements) per block: 24 blocks
    shape = (24, 10, 6)
    generated: list[int] = []

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> None:
        generated.append(tensor.shape[0])
        init._trunc_normal(tensor, generator, std=0.02)

    whole = torch.empty(shape)
    init.fill_parameter(whole, partial(init._trunc_normal, std=0.02), seed=7)
    placements = [(Shard(0), Shard(0)), (Shard(1), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(2)),
                  (_StridedShard(0, split_factor=world // 2), Shard(0))]
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
            for placement in placements:
                def shard(tensor: torch.Tensor, placement: tuple = placement, mesh: object = mesh) -> DTensor:
                    return DTensor.from_local(tensor, mesh, [Replicate(), Replicate()], run_check=False).redistribute(
                        mesh, placement)
                param = shard(torch.zeros(shape))
                generated.clear()
                init.fill_parameter(param, fill, seed=7)
                assert torch.equal(param.to_local(), shard(whole).to_local()), (rank, placement)
                if param.to_local().numel() == 0:  # an uneven split can leave a rank nothing: nothing generated
                    assert not generated
                    continue
                assert max(generated) == 1  # one block (one row) at a time
                # only the blocks holding this rank's rows along dim 0
                assert sum(generated) == param.to_local().shape[0] if placement[0] == Shard(0) == placement[1] \
                    else sum(generated) <= shape[0]
        finally:
            dist.destroy_process_group()
