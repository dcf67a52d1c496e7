"""Trace check: build our model under FakeTensorMode (no memory allocated), run one micro-batch forward and
backward and an AdamW step, and count the bytes of weights, gradients, optimizer states and the tensors
autograd saves for backward; then compare with the analytic plan for a single-GPU layout.

Saved tensors are counted once per storage (views share it) and the model's own weights and buffers are
left out (they are counted as weights). The loss is cross-entropy on fp32 logits, as the trainer computes it.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from leantrain.errors import UserInputError
from leantrain.plan.activations import activation_terms, head_activation_bytes, layer_activation_bytes
from leantrain.plan.inputs import plan_inputs
from leantrain.plan.layout import Layout
from leantrain.plan.memory import memory_per_gpu
from leantrain.spec.schema import JobSpec

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


@dataclass(frozen=True)
class TraceComparison:
    """Planned and traced bytes per category for one micro-batch on one GPU."""

    planned: dict[str, float]
    traced: dict[str, float]

    def ratio(self, key: str) -> float:
        return self.traced[key] / self.planned[key]


def planned_single_gpu(spec: JobSpec, *, micro_batch: int, recompute: str) -> dict[str, float]:
    """The plan's numbers for dp = tp = pp = 1, ZeRO-0. Activations are what the forward saves: all layers,
    the final norm and the loss's log-probabilities (not the transient buffers of the backward)."""
    inputs = plan_inputs(spec)
    layout = Layout(dp=1, tp=1, pp=1, zero=0, micro_batch=micro_batch, recompute=recompute)  # type: ignore[arg-type]
    mem = memory_per_gpu(inputs, layout, num_microbatches=1)
    shape, tokens = inputs.shape, micro_batch * inputs.seq_len
    saved = head_activation_bytes(shape, tokens=tokens, act_bytes=inputs.act_bytes, tp=1, fused=inputs.fused_kernels)
    for layer in range(shape.n_layers):
        terms = activation_terms(shape, seq_len=inputs.seq_len, act_bytes=inputs.act_bytes,
                                 flash=inputs.flash_attention, moe_layer=layer >= shape.num_dense_layers,
                                 fused=inputs.fused_kernels, linear_bytes=inputs.linear_input_bytes)
        saved += layer_activation_bytes(terms, tokens=tokens, tp=1, sp=False, recompute=recompute,  # type: ignore[arg-type]
                                        act_bytes=inputs.act_bytes, d_model=shape.d_model)
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "activations": saved}


def _created_storages_mode() -> type:
    """A dispatch mode that records (weakly) every storage an op creates, with its size."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Created(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[StorageWeakRef, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    self.storages.setdefault(StorageWeakRef(storage), storage.nbytes())
            return out

    return Created


def trace_single_gpu(spec: JobSpec, *, micro_batch: int, recompute: str) -> dict[str, float]:
    """Bytes seen when our model runs one micro-batch under FakeTensorMode (nothing is allocated)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from leantrain.model.transformer import Transformer, model_args_from_spec, rope_tables

    _Created = _created_storages_mode()

    if spec.model.architecture == "moe" and spec.precision.compute == "fp32":
        raise UserInputError("plan.trace of an MoE model needs precision.compute: bf16 (the grouped expert "
                             "matmul has no fp32 kernel to trace; set plan.trace: false or trace in bf16)")
    seq_len = spec.data.seq_len
    args = model_args_from_spec(spec.model, max_seq_len=seq_len)
    dtype = getattr(torch, TORCH_DTYPES[spec.precision.compute])
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[StorageWeakRef(storage)] = storage.nbytes()
        return tensor

    previous_dtype = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # build straight in the compute dtype: fake weights, no conversion
        try:
            model = Transformer(args)
        finally:
            torch.set_default_dtype(previous_dtype)
        model.rope = rope_tables(head_dim=args.shape.head_dim, max_seq_len=seq_len, theta=args.rope_theta)
        model.set_recompute(recompute)  # type: ignore[arg-type]
        own = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
        tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        # only `op` needs every created storage recorded (below); the other modes' saves all pass the hooks
        created = _Created() if recompute == "op" else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), created:
            logits = model(tokens)  # (batch, seq, vocab)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        if recompute == "op":
            # Selective checkpointing keeps what its policy saves in the checkpoint's own store, which saved-tensor
            # hooks never see: count instead every storage the forward made that is still alive after it, less
            # the logits and the loss the caller holds (on none/selective/full this equals the hooks' count).
            gc.collect()
            held = own | {StorageWeakRef(t.untyped_storage()) for t in (logits, loss)}
            storages = created.storages  # type: ignore[union-attr]
            activations = float(sum(n for ref, n in storages.items() if not ref.expired() and ref not in held))
        else:
            activations = float(sum(n for ref, n in saved.items() if ref not in own))
        loss.backward()
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)  # fewer (fake) ops
        optimizer.step()
        states = [t for state in optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {
            "params": float(sum(p.numel() * p.element_size() for p in params)),
            "grads": float(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)),
            "optimizer": float(sum(t.numel() * t.element_size() for t in states)),
            "activations": activations,
        }


COMPILED_TRACE_MAX_PARAMS = 50_000_000


def trace_compiled_activations(spec: JobSpec, *, micro_batch: int) -> float:
    """Bytes autograd saves for one micro-batch when the blocks run under torch.compile, as `training.compile`
    does: the fused count's check. Compilation needs real tensors, so only small models (CPU, seconds)."""
    import torch
    import torch.nn.functional as F
    from torch.multiprocessing.reductions import StorageWeakRef

    from leantrain.model.transformer import Transformer, model_args_from_spec, rope_tables

    seq_len = spec.data.seq_len
    args = model_args_from_spec(spec.model, max_seq_len=seq_len)
    if args.shape.total_params() > COMPILED_TRACE_MAX_PARAMS:
        raise UserInputError(f"the compiled trace builds real weights: at most {COMPILED_TRACE_MAX_PARAMS:,} "
                             f"parameters, this model has {args.shape.total_params():,}")
    dtype = getattr(torch, TORCH_DTYPES[spec.precision.compute])
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Transformer(args)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.rope = rope_tables(head_dim=args.shape.head_dim, max_seq_len=seq_len, theta=args.rope_theta)
    model.compile_blocks()
    own = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[StorageWeakRef(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    return float(sum(n for ref, n in saved.items() if ref not in own))


def compare(spec: JobSpec, *, micro_batch: int = 1, recompute: str = "none") -> TraceComparison:
    return TraceComparison(planned=planned_single_gpu(spec, micro_batch=micro_batch, recompute=recompute),
                           traced=trace_single_gpu(spec, micro_batch=micro_batch, recompute=recompute))


def render_comparison(result: TraceComparison, *, console: Console, micro_batch: int, recompute: str) -> None:
    table = Table(title=f"trace check: one GPU, micro-batch {micro_batch}, recompute {recompute}")
    for col in ("", "planned", "traced", "traced / planned"):
        table.add_column(col, justify="right")
    for key in ("params", "grads", "optimizer", "activations"):
        table.add_row(key, f"{result.planned[key] / 2**20:,.1f} MiB", f"{result.traced[key] / 2**20:,.1f} MiB",
                      f"{result.ratio(key):.3f}")
    console.print(table)
