"""Precision policy and optimizers: bf16 with fp32 master weights, refusals, bf16 and 8-bit optimizer states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from leantrain.errors import UserInputError
from leantrain.spec.schema import PrecisionSpec, TrainingSpec
from leantrain.train.optim import AdamWBf16States, build_optimizer
from leantrain.train.precision import resolve_precision
from leantrain.train.trainer import Trainer
from test_train_loop import make_data, tiny_spec

CPU = torch.device("cpu")


def test_bf16_compute_keeps_fp32_master_weights(tmp_path: Path) -> None:
    data_dir = make_data(tmp_path / "data")
    spec = tiny_spec(data_dir, moe=True)  # MoE covers the dense paths and the expert dispatch
    spec.precision.compute = "bf16"
    trainer = Trainer(spec, run_dir=tmp_path / "bf16")
    with trainer.precision.autocast():
        out = trainer.model.layers["0"].attention.wq(torch.randn(2, 32))
    assert out.dtype == torch.bfloat16  # matmuls run in bf16 ...
    result = trainer.train_step()
    for p in trainer.model.parameters():  # ... while weights, gradients and Adam moments stay fp32
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    reference = Trainer(tiny_spec(data_dir, moe=True), run_dir=tmp_path / "fp32").train_step()
    assert abs(float(result.loss) - float(reference.loss)) < 0.05  # same model, same batch, bf16 rounding


def test_bf16_master_weights_cast_parameters_not_buffers(tmp_path: Path) -> None:
    spec = tiny_spec(make_data(tmp_path / "data"), moe=True)
    spec.precision.compute, spec.precision.master_weights = "bf16", "bf16"
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert trainer.model.rope.dtype == torch.float32
    assert trainer.model.moe_layers()[0].tokens_per_expert.dtype == torch.float32
    assert torch.isfinite(trainer.train_step().loss)


def test_unsupported_compute_is_refused_clearly_and_fp8_runs_on_cpu() -> None:
    with pytest.raises(UserInputError, match="loss scaling"):
        resolve_precision(PrecisionSpec(compute="fp16"), device=CPU)
    with pytest.raises(UserInputError, match="fp8 needs a GPU with fp8 tensor cores"):
        resolve_precision(PrecisionSpec(compute="fp8"), device=torch.device("meta"))
    assert resolve_precision(PrecisionSpec(compute="fp8"), device=CPU).compute == "fp8"  # torch._scaled_mm on CPU


def test_bf16_optimizer_states_track_fp32_adamw() -> None:
    torch.manual_seed(0)
    reference_model = torch.nn.Linear(16, 8)
    model = torch.nn.Linear(16, 8)
    model.load_state_dict(reference_model.state_dict())
    training = TrainingSpec(lr=1e-2, weight_decay=0.1)
    reference = build_optimizer(reference_model, training, PrecisionSpec(optimizer_state="fp32"), device=CPU)
    ours = build_optimizer(model, training, PrecisionSpec(optimizer_state="bf16"), device=CPU)
    assert isinstance(ours, AdamWBf16States)
    inputs = torch.randn(32, 16)
    for _ in range(5):
        for m, opt in ((reference_model, reference), (model, ours)):
            opt.zero_grad()
            m(inputs).square().mean().backward()
            opt.step()
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in ours.state.values())
    for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-3)  # 5 steps of lr 1e-2: bf16 moments, ~1% error
        assert not torch.equal(p, q)  # and it really is a different implementation


@pytest.mark.slow
def test_8bit_states_and_compiled_blocks_train(tmp_path: Path) -> None:
    """torchao AdamW8bit (quantised moments) with torch.compile per block: first steps compile (~30 s)."""
    pytest.importorskip("torchao")
    spec = tiny_spec(make_data(tmp_path / "data"), max_steps=3)
    spec.precision.optimizer_state = "8bit"
    spec.training.compile = True
    spec.model.vocab_size = 128  # a 128 × 32 embedding: torchao quantises tensors of ≥ 4096 values only
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    records = trainer.train()
    assert type(trainer.optimizer).__name__ == "AdamW8bit"
    embedding_state = trainer.optimizer.state[trainer.model.tok_embeddings.weight]
    assert type(embedding_state["exp_avg"]).__name__ == "OptimState8bit"
    assert records[-1]["loss"] < records[0]["loss"]


def test_fp8_swap_happens_on_meta_and_spares_the_output_head() -> None:
    """What a GPU run does before materialising (the fp8 GEMMs themselves need an fp8-capable GPU)."""
    pytest.importorskip("torchao")
    from leantrain.model import model_args_from_spec
    from leantrain.model.transformer import Transformer
    from leantrain.spec.schema import ModelSpec
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    spec = ModelSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=96)
    with torch.device("meta"):
        model = Transformer(model_args_from_spec(spec, max_seq_len=16))
    apply_precision(model, PrecisionPolicy(compute="fp8", param_dtype=torch.float32, device_type="cuda"), cast=False)
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert type(model.layers["0"].feed_forward.w2).__name__ == "Float8Linear"
    assert type(model.output).__name__ == "Linear"
    model.to_empty(device=CPU)
    model.init_weights()
    assert not model.layers["0"].attention.wq.weight.is_meta


def test_fp8_runs_the_rest_in_bf16_and_mfu_uses_the_bf16_peak() -> None:
    from leantrain.parallel.fsdp import mixed_precision_policy
    from leantrain.train.precision import PrecisionPolicy

    policy = PrecisionPolicy(compute="fp8", param_dtype=torch.float32, device_type="cpu")
    assert policy.peak_dtype == "bf16"  # torchtitan's convention: fp8 shows up as a higher MFU
    with policy.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    fsdp_policy = mixed_precision_policy(PrecisionSpec(compute="fp8"))
    assert fsdp_policy.param_dtype == torch.bfloat16 and fsdp_policy.reduce_dtype == torch.float32


def test_fp8_under_fsdp_gathers_float8_weights_and_precomputes_scales() -> None:
    pytest.importorskip("torchao")
    from leantrain.model import model_args_from_spec
    from leantrain.model.transformer import Transformer
    from leantrain.spec.schema import ModelSpec
    from leantrain.train.precision import PrecisionPolicy, apply_precision, float8_post_step

    spec = ModelSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=96)
    policy = PrecisionPolicy(compute="fp8", param_dtype=torch.float32, device_type="cuda")
    with torch.device("meta"):
        model = Transformer(model_args_from_spec(spec, max_seq_len=16))
    apply_precision(model, policy, cast=False, fsdp_float8_all_gather=True)
    wq = model.layers["0"].attention.wq
    assert wq.config.enable_fsdp_float8_all_gather
    assert type(wq.weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"  # FSDP2 gathers it in float8
    assert float8_post_step([model], policy, fsdp=False)() is None  # nothing to precompute without FSDP
    bf16 = PrecisionPolicy(compute="bf16", param_dtype=torch.float32, device_type="cuda")
    assert float8_post_step([model], bf16, fsdp=True)() is None


def test_fp8_layers_too_narrow_for_every_fsdp_rank_gather_in_the_master_dtype() -> None:
    """FSDP2 over 8 ranks: wk/wv have 32 rows (4 per rank), fine; over 64 ranks 32 ranks hold none, and torchao's
    float8 all-gather and scale precompute cannot take an empty shard's amax: those layers gather unconverted
    (still float8 GEMMs), the wider ones in float8."""
    pytest.importorskip("torchao")
    from leantrain.model import model_args_from_spec
    from leantrain.model.transformer import Transformer
    from leantrain.spec.schema import ModelSpec
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    spec = ModelSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=96)
    policy = PrecisionPolicy(compute="fp8", param_dtype=torch.float32, device_type="cuda")
    for shards, narrow_gathered in ((8, True), (64, False)):
        with torch.device("meta"):
            model = Transformer(model_args_from_spec(spec, max_seq_len=16))
        apply_precision(model, policy, cast=False, fsdp_float8_all_gather=True, fsdp_shards=shards)
        attention = model.layers["0"].attention
        assert type(attention.wk).__name__ == type(attention.wq).__name__ == "Float8Linear"
        assert attention.wq.config.enable_fsdp_float8_all_gather  # 64 rows: one for each of 64 ranks
        assert attention.wk.config.enable_fsdp_float8_all_gather is narrow_gathered, shards


def test_under_tensor_parallel_only_column_wise_layers_have_their_rows_split() -> None:
    """TP 2 × FSDP 64: a row-wise Linear (wo, w2) keeps its 64 rows, one per FSDP rank, and gathers in float8; a
    column-wise one (wq: 64 rows, 32 per TP rank) leaves ranks empty and gathers in the master dtype. Until
    2026-12-07 every Linear's rows were divided by TP, so wo and w2 gathered in the master dtype for nothing."""
    pytest.importorskip("torchao")
    from leantrain.model import model_args_from_spec
    from leantrain.model.transformer import Transformer
    from leantrain.parallel.tensor import colwise_linears
    from leantrain.spec.schema import ModelSpec
    from leantrain.train.precision import PrecisionPolicy, apply_precision

    spec = ModelSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=4, ffn_hidden=128, vocab_size=96)
    policy = PrecisionPolicy(compute="fp8", param_dtype=torch.float32, device_type="cuda")
    gathered = {}
    for colwise in (None, "known"):
        with torch.device("meta"):
            model = Transformer(model_args_from_spec(spec, max_seq_len=16))
        names = colwise_linears(model) if colwise else None
        apply_precision(model, policy, cast=False, fsdp_float8_all_gather=True, fsdp_shards=64, tp=2,
                        tp_colwise=names)
        block = model.layers["0"]
        gathered[colwise] = {name: module.config.enable_fsdp_float8_all_gather for name, module in (
            ("wq", block.attention.wq), ("wo", block.attention.wo), ("w1", block.feed_forward.w1),
            ("w2", block.feed_forward.w2))}
    assert names == {"layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                     "layers.0.feed_forward.w1", "layers.0.feed_forward.w3"}  # the TP plan's column-wise Linears
    assert gathered["known"] == {"wq": False, "wo": True, "w1": True, "w2": True}
    assert gathered[None] == {"wq": False, "wo": False, "w1": True, "w2": False}  # every row count halved


@pytest.mark.slow
def test_fp8_rehearses_on_a_rank_whose_fsdp_shard_is_empty() -> None:
    """The tiny model in fp8 on 64 FSDP ranks, its last rank (empty wk/wv shards) rehearsed to the end: torchao's
    scale precompute after the optimizer step raised there before (`_foreach_norm` of an empty tensor)."""
    pytest.importorskip("torchao")
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    examples = Path(__file__).resolve().parents[1] / "examples"
    common = ["parallelism.data_parallel=64", "parallelism.zero_stage=3", "training.global_batch_tokens=32768",
              "hardware.accelerator=H100-SXM", "precision.compute=fp8", "precision.master_weights=fp32"]
    # and under TP 2, where the row-wise wo and w2 keep their 64 rows and gather in float8 (one row a rank)
    for last, sets in ((63, ["hardware.num_nodes=32"]),
                       (127, ["hardware.num_nodes=64", "parallelism.tensor_parallel=2"])):
        spec = load_spec(examples / "tiny-cpu.yaml", overrides=[*common, *sets])
        report = rehearse(spec, ranks=[last], isolated=False)
        assert [r["rank"] for r in report["ranks"]] == [0, last] and report["fits"]


def test_fp8_with_tensor_parallel_is_accepted_and_moe_aux_loss_runs_under_pp() -> None:
    from leantrain.spec import spec_from_dict

    base = {"model": {"n_layers": 4, "d_model": 64, "n_heads": 4, "ffn_hidden": 128, "vocab_size": 96,
                      "tie_embeddings": False},
            "data": {"tokens_total": 1e6, "seq_len": 16}, "training": {"global_batch_tokens": 64, "micro_batch": 1}}
    fp8_tp = spec_from_dict(base | {"precision": {"compute": "fp8"}, "parallelism": {"tensor_parallel": 2}})
    assert fp8_tp.parallelism.tensor_parallel == 2  # torchao's float8 TP styles (tests/test_train_fp8.py)
    moe = base["model"] | {"architecture": "moe", "moe": {"num_experts": 4, "top_k": 2}}  # balance: aux_loss
    spec = spec_from_dict(base | {"model": moe, "parallelism": {"pipeline_parallel": 2}})  # carried per stage
    assert spec.parallelism.pipeline_parallel == 2


def test_stochastic_rounding_to_bf16_is_unbiased_and_lands_on_a_neighbour() -> None:
    from leantrain.train.optim import stochastic_round_bf16

    x = torch.full((20_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16 value (1 + 2^-7)
    rounded = stochastic_round_bf16(x, generator=torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - x[0].item()) < 3e-4  # σ of the mean ≈ 2.7e-5
    assert abs(x.to(torch.bfloat16).float().mean().item() - x[0].item()) > 9e-4  # round-to-nearest loses it all
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert torch.equal(stochastic_round_bf16(special).float()[:2], special[:2])
    assert stochastic_round_bf16(special).float()[2].isnan()


def _bf16_run(*, seed: int, rounding: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    opt = AdamWBf16States(model.parameters(), lr=1e-3, weight_decay=0.1, stochastic_rounding=rounding, seed=seed)
    inputs = torch.randn(32, 16, dtype=torch.bfloat16)
    for _ in range(steps):
        opt.zero_grad()
        model(inputs).float().square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bf16_optimizer_rounding_is_seeded_and_reproducible() -> None:
    first, again = _bf16_run(seed=1, rounding=True), _bf16_run(seed=1, rounding=True)
    other, nearest = _bf16_run(seed=2, rounding=True), _bf16_run(seed=1, rounding=False)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, nearest, strict=True))
    for a, b in zip(first, nearest, strict=True):  # the same updates, rounded differently
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2)


def test_a_skipped_step_changes_nothing() -> None:
    from leantrain.train.optim import step_if_finite

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = AdamWBf16States(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    states = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    model(torch.randn(4, 16)).sum().backward()
    step_if_finite(opt, torch.tensor(False))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    after = {k: v for s in opt.state.values() for k, v in s.items()}
    assert all(torch.equal(after[k], v) for k, v in states.items())


def _reference_adamw_bf16_moments(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict[int, Any], *,
                                  lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The AdamW of Loshchilov & Hutter (decoupled decay, bias-corrected moments), one parameter at a time, with
    the moments stored in bf16 (round-to-nearest) and the arithmetic in fp32: what AdamWBf16States computes."""
    beta1, beta2 = betas
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        s = state.setdefault(i, {"step": 0, "m": torch.zeros_like(p, dtype=torch.bfloat16),
                                 "v": torch.zeros_like(p, dtype=torch.bfloat16)})
        s["step"] += 1
        m = s["m"].float().lerp(g, 1 - beta1)  # beta1·m + (1 − beta1)·g
        v = s["v"].float() * beta2 + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1 ** s["step"]), v / (1 - beta2 ** s["step"])
        p.mul_(1 - lr * weight_decay).sub_(lr * m_hat / (v_hat.sqrt() + eps))
        s["m"], s["v"] = m.to(torch.bfloat16), v.to(torch.bfloat16)


def test_bf16_states_without_rounding_equal_a_plain_reference_adamw_loop() -> None:
    """Round-to-nearest (stochastic_rounding off): the multi-tensor step equals the per-parameter textbook loop
    to 1e-6 over 6 steps, for two groups (decayed matrices, undecayed vectors). A wrong bias correction, decay or
    first moment breaks it: planted in optim.py, bias2 from beta1, bias1 one step ahead, no decay and lerp by beta1
    each failed (by 2e-2, 1e-2, 2e-3 and 0.3; the real step is within 6e-8)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    reference = [p.detach().clone() for p in model.parameters()]
    initial = [p.detach().clone() for p in model.parameters()]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = AdamWBf16States(groups, **hyper, stochastic_rounding=False)
    decay = [0.1 if p.dim() >= 2 else 0.0 for p in model.parameters()]
    states: list[dict[int, Any]] = [{}, {}]
    inputs, targets = torch.randn(64, 16), torch.randn(64, 8)
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]  # both step on the same gradients
        opt.step()
        for index, wd in enumerate((0.1, 0.0)):
            chosen = [i for i, d in enumerate(decay) if d == wd]
            _reference_adamw_bf16_moments([reference[i] for i in chosen], [grads[i] for i in chosen],
                                          states[index], **hyper, weight_decay=wd)
    for p, q, p0 in zip(model.parameters(), reference, initial, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-6)
        assert (p.detach() - p0).abs().max() > 1e-2  # 6 steps of lr 1e-2 moved it: the comparison means something
    assert [s["step"].item() for s in opt.state.values()] == [6.0] * 4
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())


@pytest.mark.slow
def test_bf16_states_under_fsdp_on_two_ranks_equal_one_process(tmp_path: Path) -> None:
    """optimizer_state: bf16 under FSDP2 (2 gloo ranks, each stepping its shards' bf16 moments) equals the same
    optimizer in one process: losses to 1e-5 and gradient norms to 5e-5 relative over 6 steps. Not bitwise: the
    reduce-scatter sums the gradients in another order (an fp32 ulp), and a moment that then lies near a bf16
    rounding midpoint rounds the other way (2^-8 of that moment); measured ≤ 2.7e-6 by step 6, where torch's
    AdamW with fp32 moments stays ≤ 2e-7. Round-to-nearest: stochastic rounding seeds its noise per rank, so a
    shard would draw other noise than the whole tensor does (with it on, the losses differed by 1.6e-4)."""
    from parallel_harness import make_spec, reference_run, spawn_layouts

    steps, layout = 6, {"data_parallel": 2, "optimizer_state": "bf16"}
    got = spawn_layouts([("fsdp_bf16_states", layout)], world_size=2, steps=steps, out_dir=tmp_path)
    got = got["fsdp_bf16_states"]
    assert got["moment_dtypes"] == ["torch.bfloat16"] and got["param_dtypes"] == ["torch.float32"]
    ref = reference_run(make_spec(**layout), steps=steps)
    fp32 = reference_run(make_spec(data_parallel=2), steps=steps)  # torch's AdamW with fp32 moments
    # The gradient norm squares what the moments' rounding moved: 1.07e-5 relative at step 6 on an AMD EPYC
    # host (2026-12-02, the session-start code too), where the losses stayed within 1e-5.
    for key, rel in (("loss", 1e-5), ("grad_norm", 5e-5)):
        assert got[key] == pytest.approx(ref[key], rel=rel), key
    assert ref["loss"][-1] < ref["loss"][0]
    assert max(abs(a - b) for a, b in zip(ref["loss"], fp32["loss"], strict=True)) > 1e-5  # bf16 moments show


@pytest.mark.parametrize(("compute", "master"), [("bf16", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_the_trainer_and_the_plan_read_one_autocast_rule(compute: str, master: str) -> None:
    """Whether the forward runs under torch.autocast (each Linear then keeps its own bf16 input copy, which the
    plan counts) is one rule, spec/rules.py `forward_autocasts` over `wraps_in_fsdp`, for the trainer (its
    precision policy and the FSDP2 wrapping its dims decide) and the planner (`PlanInputs.autocast_casts`)."""
    import itertools

    from leantrain.parallel.dims import ParallelDims
    from leantrain.plan.inputs import plan_inputs
    from leantrain.plan.layout import Layout
    from leantrain.spec import spec_from_dict

    policy = resolve_precision(PrecisionSpec(compute=compute, master_weights=master), device=torch.device("cpu"))
    for dp, tp, single in itertools.product((1, 2), (1, 2), (False, True)):
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, tp=tp, pp=1, ep=1, world_size=dp * tp, fsdp_single_rank=single)
        trainer = policy.forward_context(fsdp=dims.wraps_in_fsdp) == policy.autocast
        inputs = plan_inputs(spec_from_dict({
            "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 128},
            "data": {"tokens_total": 1e5, "seq_len": 32}, "training": {"global_batch_tokens": 32 * dp},
            "precision": {"compute": compute, "master_weights": master}, "plan": {"kernels": "eager"},
            "parallelism": {"fsdp_single_rank": single}}))
        assert inputs.autocast_casts(Layout(dp=dp, tp=tp, pp=1, zero=0)) == trainer, (dp, tp, single)
        assert trainer == (compute == "bf16" and master == "fp32" and dp == 1 and tp == 1 and not single)


def test_stochastic_rounding_keeps_the_copies_of_a_parameter_on_several_ranks_equal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parameter held whole on several ranks (data-parallel replicas at ZeRO-0 or under HSDP, a norm on
    tensor-parallel peers) gets the same gradient on each; the rounding noise was seeded per rank, so the copies'
    moments and weights drifted apart step by step. Seeded without the rank, they stay equal."""
    import torch.distributed as dist

    from leantrain.train.optim import AdamWBf16States

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(4096))
        opt = AdamWBf16States([param], lr=1e-3, weight_decay=0.1)
        for step in range(5):
            param.grad = torch.randn(4096, generator=torch.Generator().manual_seed(100 + step))
            opt.step()
        return param.detach().clone(), opt.state[param]["exp_avg"].float()

    (param0, moment0), (param1, moment1) = run(0), run(1)
    assert torch.equal(param0, param1) and torch.equal(moment0, moment1)
