"""Cross-field rules of the job spec: checks that span sections, each naming the fields involved.

Shape rules need the resolved model shape (`size_billion` → layers, heads, ...), so they run after the
sections themselves validated; `JobSpec` calls `cross_field_problems` from its model validator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leantrain.spec.hf_config import read_hf_config
from leantrain.spec.shapes import ModelShape, resolve_shape

if TYPE_CHECKING:
    from leantrain.spec.schema import JobSpec, ParallelismSpec


def wraps_in_fsdp(*, dp: int, tp: int, fsdp_single_rank: bool) -> bool:
    """Whether the trainer wraps the model in FSDP2 (parallel/parallelize.py): several data-parallel ranks, one rank
    by request (`parallelism.fsdp_single_rank`), or tensor parallelism (FSDP2 over a 1-rank mesh then makes every
    parameter a DTensor, which foreach/fused optimizers need). Torch-free, so that the planner asks the same."""
    return dp > 1 or fsdp_single_rank or tp > 1


def float8_gemm_dims(out_features: int, in_features: int) -> bool:
    """Whether a Linear of these dims can run its GEMM in float8: both multiples of 16 (the fp8 GEMM's rule;
    train/precision.py `fp8_linear_filter`, and the planner's count of the float8-gathered weights)."""
    return out_features % 16 == 0 and in_features % 16 == 0


def rows_fill_every_shard(rows: int, shards: int) -> bool:
    """Whether FSDP2's chunks of a weight's `rows` (dim 0) leave no rank of `shards` empty: FSDP2 cuts rows into
    chunks of ceil(rows / shards), so 576 rows (DeepSeek-V3's wkv_a) over 128 ranks fill 116 of them. Float8
    weights all-gather in float8 only then (train/precision.py `fills_every_shard`; the planner counts them so)."""
    chunk = -(-rows // max(shards, 1))
    return rows > 0 and -(-rows // chunk) >= shards


def float8_gathered_params(shape: ModelShape, *, tp: int, shards: int, moe_layer: bool) -> float:
    """One block's Linear parameters per TP rank that FSDP2 gathers in float8 under fp8 (train/precision.py):
    those fp8 takes (both dims multiples of 16, `fp8_linear_filter`) whose rows, after TP's split, fill every one
    of `shards` ranks; the others gather in the compute dtype."""
    total = 0.0
    for out, inp, split in shape.block_linears(moe_layer=moe_layer):
        if float8_gemm_dims(out, inp) and rows_fill_every_shard(out // tp if split == "col" else out, shards):
            total += out * inp / (tp if split else 1)
    return total


def forward_autocasts(*, compute: str, master_weights: str, fsdp: bool) -> bool:
    """Whether each forward runs under `torch.autocast` (train/precision.py): bf16 compute (or fp8's layers that are
    not float8) over fp32 master weights without FSDP2, whose mixed precision gathers the weights in bf16 instead.
    The planner counts autocast's input copies by it (`PlanInputs.autocast_casts`)."""
    return compute in ("bf16", "fp8") and master_weights == "fp32" and not fsdp


def cross_field_problems(spec: JobSpec) -> list[str]:
    """Every cross-field problem of a spec whose sections are each valid; empty when it is coherent."""
    shape = resolve_shape(spec.model)
    return [
        *_layout_problems(spec),
        *shape_problems(spec.parallelism, shape),
        *moe_problems(spec.parallelism, shape),
        *_batch_and_node_problems(spec),
        *_finetune_problems(spec),
        *_size_problems(spec, shape),
        *_hang_problems(spec),
        *_recompute_problems(spec, shape),
    ]


def _recompute_problems(spec: JobSpec, shape: ModelShape) -> list[str]:
    if spec.training.activation_checkpointing != "op":
        return []
    field = "finetune.dpo.weights" if spec.finetune.method == "dpo" else "finetune.method"
    problem = op_recompute_problem(shape, weights=spec.finetune.weights, weights_field=field)
    return [] if problem is None else [problem]


def op_recompute_problem(shape: ModelShape, *, weights: str, weights_field: str = "finetune.method") -> str | None:
    """Why `op` recompute cannot run this model, or None (the layout search asks it too). The policy keeps every
    second of a Llama block's seven matmuls (wq, wk, wv, wo, w1, w3, w2: model/transformer.py), which is what the
    planner counts: other blocks (MoE's grouped expert matmuls, MLA's projections, a two-matmul GeLU MLP, LoRA's
    adapter matmuls) would keep other tensors than planned. `weights`: finetune.weights (none when pretraining), set
    by `weights_field` (finetune.dpo.weights under DPO)."""
    kind = ("an MoE model" if shape.moe is not None else "multi-head latent attention (model.mla)"
            if shape.mla is not None else f"a {shape.mlp} MLP" if shape.mlp != "swiglu"
            else f"{weights_field} {weights}" if weights in ("lora", "qlora") else None)
    if kind is None:
        return None
    return (f"training.activation_checkpointing: op is for dense SwiGLU models with standard attention and full "
            f"weights (seven matmuls a block), not {kind}: use selective or full")


HANG_POLL_MAX_S = 2.0  # the hang watchdog's longest look interval (ckpt/watchdog.py POLL_MAX_S)


def _hang_problems(spec: JobSpec) -> list[str]:
    """The hang watchdog must fire (and label the restart a hang) before a collective times out."""
    hang_s, collective_s = spec.monitoring.hang_timeout_s, spec.fault.collective_timeout_s
    if spec.fault.hang_action != "abort" or hang_s + HANG_POLL_MAX_S < collective_s:
        return []
    return [f"monitoring.hang_timeout_s ({hang_s:g} s) must be at least {HANG_POLL_MAX_S:g} s shorter than "
            f"fault.collective_timeout_s ({collective_s:g} s), so a frozen rank is found by the hang watchdog before "
            f"a collective times out; e.g. fault.collective_timeout_s: {hang_s + 30:g}, or fault.hang_action: alert"]


SIZE_MISFIT = 1.5  # a sized model whose shape misses size_billion by more than this factor is refused


def _size_problems(spec: JobSpec, shape: ModelShape) -> list[str]:
    """`size_billion` that no shape with this vocabulary reaches (the embedding alone is larger, say)."""
    model = spec.model
    if model.size_billion is None or model.init_from is not None:
        return []
    target, total = model.size_billion * 1e9, shape.total_params()
    if max(total / target, target / total) <= SIZE_MISFIT:
        return []
    embedding = shape.embedding_params()
    return [f"model.size_billion: {model.size_billion:g} resolves to {total / 1e6:,.1f}M parameters "
            f"(n_layers {shape.n_layers}, d_model {shape.d_model}, vocab_size {shape.vocab_size}: embeddings "
            f"{embedding / 1e6:,.1f}M); set model.vocab_size smaller or give an explicit shape (n_layers, d_model, "
            "n_heads)"]


def _dpo_problems(spec: JobSpec) -> list[str]:
    """finetune.method dpo trains on preference pairs only, with data parallelism / FSDP (train/dpo.py)."""
    dpo, problems = spec.finetune.method == "dpo", []
    if dpo and spec.task != "finetune":
        problems.append(f"finetune.method dpo needs task: finetune (task is {spec.task})")
    for source in spec.data.sources:
        if dpo and source.format != "preference":
            problems.append(f"data.sources[{source.name}].format: {source.format}, but finetune.method dpo trains on "
                            "format: preference pairs only")
        elif not dpo and source.format == "preference":
            problems.append(f"data.sources[{source.name}].format: preference pairs train with finetune.method dpo "
                            f"(method is {spec.finetune.method})")
    return problems


def _finetune_problems(spec: JobSpec) -> list[str]:
    """LoRA/QLoRA combinations the trainer does not build (train/finetune.py says why)."""
    method, par, problems = spec.finetune.weights, spec.parallelism, _dpo_problems(spec)
    if spec.model.init_from is not None:
        window = read_hf_config(spec.model.init_from).sliding_window
        if window is not None and window < spec.data.seq_len:
            problems.append(f"data.seq_len ({spec.data.seq_len}) exceeds the sliding_window ({window}) of "
                            f"{spec.model.init_from}/config.json: this model attends over the full sequence, so "
                            f"train with seq_len ≤ {window}")
    problems += finetune_layout_problems(dpo=spec.finetune.method == "dpo", weights=method,
                                         tensor_parallel=par.tensor_parallel, pipeline_parallel=par.pipeline_parallel,
                                         data_parallel=par.data_parallel)
    if method == "full":
        return problems
    if spec.task != "finetune":
        problems.append(f"finetune.method {method} needs task: finetune (task is {spec.task})")
    if spec.precision.compute == "fp8":
        problems.append(f"finetune.method {method} with precision.compute fp8 is not supported (the fp8 swap would "
                        "replace the adapted Linear layers)")
    return problems


def finetune_layout_problems(*, dpo: bool, weights: str, tensor_parallel: int, pipeline_parallel: int,
                             data_parallel: int = 1) -> list[str]:
    """The dp / tp / pp degrees a fine-tuning method runs with (the layout search filters with it too): DPO with
    data parallelism / FSDP only, LoRA/QLoRA without TP, QLoRA in one process (train/finetune.py)."""
    problems = []
    if dpo and (tensor_parallel > 1 or pipeline_parallel > 1):
        problems.append("finetune.method dpo runs with data parallelism / FSDP: set parallelism.tensor_parallel "
                        "and pipeline_parallel to 1")
    if weights in ("lora", "qlora") and tensor_parallel > 1:
        problems.append(f"finetune.method {weights} with parallelism.tensor_parallel > 1 is not supported (the TP "
                        "plans shard the base weight, not the adapters): use data_parallel/FSDP or pipeline_parallel")
    if weights == "qlora" and pipeline_parallel > 1:
        problems.append("finetune.method qlora runs without pipeline parallelism (parallelism.pipeline_parallel: 1)")
    if weights == "qlora" and data_parallel > 1:
        problems.append("finetune.method qlora runs in one process (the NF4 base is not sharded across ranks): set "
                        "parallelism.data_parallel to 1, or use method lora with FSDP for several GPUs")
    return problems


def _layout_problems(spec: JobSpec) -> list[str]:
    par, problems = spec.parallelism, []
    num_gpus = spec.hardware.num_gpus or spec.budget.num_gpus
    layout_given = bool(par.model_fields_set & {"data_parallel", "tensor_parallel", "pipeline_parallel"})
    if num_gpus is not None and layout_given and par.world_size != num_gpus:
        source = "hardware.num_nodes × gpus_per_node" if spec.hardware.num_gpus else "budget.num_gpus"
        problems.append(
            f"parallelism: data_parallel × tensor_parallel × pipeline_parallel = {par.data_parallel} × "
            f"{par.tensor_parallel} × {par.pipeline_parallel} = {par.world_size}, but {source} = {num_gpus}"
        )
    for name in ("expert_parallel", "data_parallel_replicate"):
        degree = getattr(par, name)
        if par.data_parallel % degree:
            problems.append(f"parallelism.{name} ({degree}) must divide data_parallel ({par.data_parallel})")
    if par.virtual_stages > 1 and par.pipeline_schedule != "interleaved_1f1b":
        problems.append("parallelism.virtual_stages > 1 needs pipeline_schedule: interleaved_1f1b")
    return problems


def shape_problems(par: ParallelismSpec, shape: ModelShape) -> list[str]:
    """What the model shape asks of the tp / pp / virtual-stage degrees (the layout search filters with it too)."""
    problems, tp = [], par.tensor_parallel
    if shape.n_heads % tp or shape.n_kv_heads % tp:
        problems.append(
            f"parallelism.tensor_parallel ({tp}) must divide model n_heads ({shape.n_heads}) and "
            f"n_kv_heads ({shape.n_kv_heads})"
        )
    if shape.ffn_hidden % tp:
        problems.append(f"parallelism.tensor_parallel ({tp}) must divide model.ffn_hidden ({shape.ffn_hidden})")
    num_chunks = par.pipeline_parallel * par.virtual_stages
    if num_chunks > shape.n_layers:
        problems.append(
            f"parallelism: pipeline_parallel × virtual_stages ({num_chunks}) exceeds model layers ({shape.n_layers})"
        )
    if shape.d_model % shape.n_heads and not shape.attn_head_dim and shape.mla is None:
        problems.append(f"model.d_model ({shape.d_model}) must be divisible by n_heads ({shape.n_heads}), or give "
                        "model.head_dim")
    if shape.n_heads % shape.n_kv_heads:
        problems.append(f"model.n_heads ({shape.n_heads}) must be divisible by n_kv_heads ({shape.n_kv_heads})")
    return problems


def moe_problems(par: ParallelismSpec, shape: ModelShape) -> list[str]:
    """What a mixture-of-experts shape asks of tp and ep (the layout search filters with it too)."""
    if shape.moe is None:
        return ["parallelism.expert_parallel > 1 needs model.architecture: moe"] if par.expert_parallel > 1 else []
    moe, problems = shape.moe, []
    tp = par.tensor_parallel
    if tp > 1 and par.expert_parallel == 1 and moe.expert_hidden % tp:
        problems.append(f"parallelism.tensor_parallel ({tp}) must divide model.moe.expert_hidden ({moe.expert_hidden}) "
                        "when expert_parallel is 1 (each expert is then split over TP)")
    if tp > 1 and (moe.num_shared_experts * moe.expert_hidden) % tp:
        problems.append(f"parallelism.tensor_parallel ({tp}) must divide the shared experts' hidden size "
                        f"({moe.num_shared_experts} × {moe.expert_hidden})")
    if moe.top_k > moe.num_experts:
        problems.append(f"model.moe.top_k ({moe.top_k}) must be ≤ num_experts ({moe.num_experts})")
    if moe.num_experts % par.expert_parallel:
        problems.append(
            f"parallelism.expert_parallel ({par.expert_parallel}) must divide model.moe.num_experts ({moe.num_experts})"
        )
    if moe.first_dense_layers >= shape.n_layers:
        problems.append(
            f"model.moe.first_dense_layers ({moe.first_dense_layers}) leaves no MoE layer of {shape.n_layers}"
        )
    return problems


def batch_divides(*, global_batch_tokens: int, micro_batch: int, seq_len: int, data_parallel: int) -> bool:
    """Every data-parallel rank gets whole micro-batches of whole sequences (the layout search filters with it too)."""
    return global_batch_tokens % (micro_batch * seq_len * data_parallel) == 0


def batch_fix_hint(*, global_batch_tokens: int, micro_batch: int, seq_len: int, data_parallel: int,
                   micro_batches: bool = True) -> str:
    """Values that divide: the nearest global batch sizes, and (`micro_batches`) micro_batch values that fit this
    global batch."""
    step = micro_batch * seq_len * data_parallel
    lower, upper = (global_batch_tokens // step) * step, (global_batch_tokens // step + 1) * step
    sizes = " or ".join(str(v) for v in (lower, upper) if v > 0)
    micro = [m for m in range(1, 65) if global_batch_tokens % (m * seq_len * data_parallel) == 0]
    hint = f"set training.global_batch_tokens to {sizes}"
    if micro and micro_batches:
        hint += f", or training.micro_batch to {', '.join(map(str, micro[:6]))}"
    return hint


def _batch_and_node_problems(spec: JobSpec) -> list[str]:
    problems = []
    if not batch_divides(global_batch_tokens=spec.training.global_batch_tokens, micro_batch=spec.training.micro_batch,
                         seq_len=spec.data.seq_len, data_parallel=spec.parallelism.data_parallel):
        hint = batch_fix_hint(global_batch_tokens=spec.training.global_batch_tokens,
                              micro_batch=spec.training.micro_batch, seq_len=spec.data.seq_len,
                              data_parallel=spec.parallelism.data_parallel)
        tokens_per_micro_step = spec.training.micro_batch * spec.data.seq_len * spec.parallelism.data_parallel
        problems.append(
            f"training.global_batch_tokens ({spec.training.global_batch_tokens}) must be a multiple of "
            f"micro_batch × seq_len × data_parallel ({tokens_per_micro_step}): {hint}"
        )
    fault, nodes = spec.fault, spec.hardware.num_nodes
    if nodes is not None and fault.min_nodes is not None and nodes < fault.min_nodes:
        problems.append(f"hardware.num_nodes ({nodes}) is below fault.min_nodes ({fault.min_nodes})")
    if nodes is not None and fault.max_nodes is not None and nodes > fault.max_nodes:
        problems.append(f"hardware.num_nodes ({nodes}) is above fault.max_nodes ({fault.max_nodes})")
    return problems
