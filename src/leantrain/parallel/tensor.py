"""Tensor parallelism (Megatron-style, with DTensor): attention and MLP split over the `tp` axis.
Multi-head latent attention splits its per-head up-projections and keeps its latents whole on each rank.

Per block: wq/wk/wv and w1/w3 column-wise (each rank holds n_heads/tp heads and ffn_hidden/tp hidden
units), wo and w2 row-wise (partial sums reduced). With sequence parallelism the residual stream between
blocks is split along the sequence (Korthikanti et al. 2022): the norms run on 1/tp of the tokens, and the
row-wise outputs reduce-scatter instead of all-reduce, the column-wise inputs all-gather.

The embedding is vocab-split (row-wise: each rank looks up its vocabulary rows, the partial outputs are summed, or
reduce-scattered along the sequence under sequence parallelism), as torchtitan's Llama TP plan does
(torchtitan/models/llama3/infra/parallelize.py): a 128k × 16k embedding whole on every TP rank is 4 GiB of fp32
master plus its Adam states. Its lookup is Megatron's vocabulary-parallel one (`_VocabParallel`), so that the
weight's gradient is this rank's rows only: torch's RowwiseParallel gives the same forward, but DTensor has no
row-wise rule for the embedding's backward, so every rank computed the whole-vocabulary gradient (a Replicate
DTensor), which FSDP kept in fp32 through a pipeline step's micro-batches before taking its rows (2 GiB per rank
at Llama 3 8B's width, 8 GiB at 405B's; found by `leantrain rehearse`). With tied embeddings it stays whole (the
head multiplies by the same weight outside any TP style). The untied output projection is column-wise (vocab
split); with loss parallel its logits stay vocab-sharded (a DTensor) and the cross-entropy runs under
`loss_parallel()`.
Under fp8 the block's float8 Linear layers take torchao's float8 styles (`Float8ColwiseParallel`,
`Float8RowwiseParallel`, and `PrepareFloat8ModuleInput` for the sequence-parallel all-gathers, which then move
float8 instead of bf16), as torchtitan's plan does; the head and the embedding keep the plain styles.
MoE feed-forwards run on the whole sequence (their input is gathered, their output split again); their
shared experts are split like a dense MLP, and their routed experts are split by expert parallelism, or
without it by `parallel.expert.apply_expert_tensor_parallel` (each expert's hidden dim over TP).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from leantrain.errors import UserInputError


def apply_tensor_parallel(
    model: nn.Module,
    *,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    loss_parallel_enabled: bool,
    seq_len: int | None = None,
    tied_embeddings: bool = False,
) -> None:
    """Shard `model` (a Transformer or a pipeline stage with the same attribute names) over `tp_mesh` in place."""
    tp = tp_mesh.size()
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise UserInputError(
            f"parallelism.sequence_parallel needs data.seq_len ({seq_len}) divisible by tensor_parallel ({tp})"
        )
    seq_layout = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {}
    has_output = getattr(model, "output", None) is not None
    if getattr(model, "tok_embeddings", None) is not None:
        if not tied_embeddings:
            top["tok_embeddings"] = _VocabParallel(output_layout=seq_layout)
        elif sequence_parallel:
            # The whole embedding output is on every rank; keeping this rank's sequence chunk needs no communication.
            top["tok_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None and sequence_parallel:
        if has_output:
            top["norm"] = SequenceParallel()
        else:  # tied embeddings: the head is a plain matmul with the (unsplit) embedding, so gather first
            top["norm"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)
    if has_output:
        top["output"] = ColwiseParallel(
            input_layouts=seq_layout,
            output_layouts=Shard(-1) if loss_parallel_enabled else Replicate(),
            use_local_output=not loss_parallel_enabled,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    float8_collectives = not sequence_parallel or dist.get_backend(tp_mesh.get_group()) != "gloo"
    for block in model.layers.values():  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel=sequence_parallel,
                                                        float8_collectives=float8_collectives))


def _styles(block: nn.Module, *, float8_collectives: bool) -> tuple[type[ParallelStyle], ...]:
    """(colwise, rowwise, prepare-input) styles for a block: torchao's float8 ones when its Linears are float8.

    gloo has no float8 dtypes: with sequence parallelism on gloo (CPU tests) the plain styles wrap the float8
    Linears, whose GEMMs still run in float8 on their DTensor shards, while the activations' all-gathers and
    reduce-scatters (forward and backward) stay in bf16; NCCL moves them in float8 (half the bytes)."""
    if type(block.attention.wo).__name__ == "Float8Linear" and float8_collectives:  # type: ignore[union-attr]
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def colwise_linears(model: nn.Module) -> set[str]:
    """The names (from the model's root) of the Linears the blocks' TP plan splits column-wise, i.e. by their
    weight's rows: what `train.precision` needs to know which float8 weights leave an FSDP2 rank empty."""
    return {f"layers.{name}.{key}" for name, block in model.layers.named_children()  # type: ignore[union-attr]
            for key, style in _block_plan(block, sequence_parallel=False, float8_collectives=False).items()
            if isinstance(style, ColwiseParallel)}


def _block_plan(block: nn.Module, *, sequence_parallel: bool, float8_collectives: bool) -> dict[str, ParallelStyle]:
    seq_layout = Shard(1) if sequence_parallel else Replicate()
    colwise, rowwise, prepare_input = _styles(block, float8_collectives=float8_collectives)
    if hasattr(block.attention, "wkv_a"):  # noqa: SIM102 - see `mla` below
        # Multi-head latent attention (torchtitan's deepseek_v3 plan): the latents (wq_a, wkv_a and their norms)
        # are computed whole on every rank, the up-projections split by heads, the output row-wise. The latents'
        # gradients come back whole from the column-wise inputs' backward all-reduce, so every rank holds the same.
        plan: dict[str, ParallelStyle] = {
            "attention.wq": colwise(), "attention.wq_b": colwise(), "attention.wkv_b": colwise(),
            "attention.wo": rowwise(output_layouts=seq_layout),
            "attention.shared_rope_key": _SumGradient(),
        }
        plan = {key: style for key, style in plan.items() if _has(block, key)}
    else:
        plan = {
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=seq_layout),
        }
    # Sequence parallelism gathers a sub-block's input once. Handed on as a DTensor (use_local_output False, as
    # torchtitan does), the column-wise Linears share it, and its gradient comes back in one reduce-scatter; as a
    # plain tensor each of them wrapped it anew and all-reduced its own whole-sequence gradient in backward (five
    # all-reduces a dense layer instead of two reduce-scatters). MLA's latents are plain Linears on the whole
    # input, which a DTensor would not pass through: its attention keeps the local tensor.
    mla = hasattr(block.attention, "wkv_a")
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        plan["attention"] = prepare_input(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=mla
        )
    if getattr(block, "is_moe", False):
        if sequence_parallel:
            plan["feed_forward"] = _moe_gather_and_split()
        if getattr(block.feed_forward, "shared_experts", None) is not None:  # a plain SwiGLU: Megatron's split
            plan.update({
                "feed_forward.shared_experts.w1": colwise(),
                "feed_forward.shared_experts.w3": colwise(),
                "feed_forward.shared_experts.w2": rowwise(),
            })
        return plan
    plan.update({
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=seq_layout),
    })
    if sequence_parallel:
        plan["feed_forward"] = prepare_input(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    return plan


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


class _SumGradient(ParallelStyle):
    """Identity forward, all-reduce of the gradient over TP in backward (Megatron's copy-to-region "f"): for a
    replicated activation that each rank's heads consume only in part (MLA's shared RoPE key)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False).to_local(
                grad_placements=(Partial(),)) for x in inputs)

        module.register_forward_pre_hook(hook)
        return module


class _VocabParallel(ParallelStyle):
    """An nn.Embedding split by vocabulary rows over TP (Shard(0)): each rank looks up the tokens its rows hold
    (zeros for the others), the partial outputs are summed into `output_layout` (all-reduce to Replicate, or
    reduce-scatter to Shard(1) under sequence parallelism; backward: the matching all-gather), and the lookup's
    backward runs on the local rows, so the weight's gradient is a Shard(0) DTensor of this rank's rows."""

    def __init__(self, *, output_layout: Shard | Replicate) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise TypeError(f"vocabulary-parallel embedding expects a plain nn.Embedding, got {module}")
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
        module.tp_output_layout = self.output_layout
        # bound, not a closure: a deep copy of the model (a DPO reference) then looks up in its own weight
        module.forward = types.MethodType(_vocab_parallel_lookup, module)  # type: ignore[method-assign]
        return module


def _vocab_parallel_lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    weight = module.weight  # the TP DTensor (FSDP's unsharded parameter when FSDP wraps the module)
    mesh = weight.device_mesh
    if isinstance(ids, DTensor):
        ids = ids.to_local()
    rows = weight.to_local()
    start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())  # torch.chunk's split, as Shard(0)'s
    outside = (ids < start) | (ids >= start + rows.shape[0])
    local = F.embedding((ids - start).masked_fill(outside, 0), rows).masked_fill(outside.unsqueeze(-1), 0)
    summed = DTensor.from_local(local, mesh, (Partial(),), run_check=False)
    return summed.redistribute(mesh, (module.tp_output_layout,)).to_local()


class _GatherThenSplit(ParallelStyle):
    """Run a module on the whole sequence inside a sequence-parallel region: gather its input, split its output."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                           use_local_output=True)._apply(module, device_mesh)
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))._apply(module, device_mesh)
        return module


def _moe_gather_and_split() -> ParallelStyle:
    return _GatherThenSplit()


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """The context the loss must be computed in when the logits are vocab-sharded (loss parallel)."""
    if enabled:
        with loss_parallel():
            yield
    else:
        yield
