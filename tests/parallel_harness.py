"""Shared harness for the parallelism tests: train the real model for N steps in a given layout.

`reference_run` trains in this process (no process group): the ground truth. `spawn_layouts` starts
`world_size` processes (gloo, one thread each) that run one or more layouts in turn on the same process
group and write, from rank 0, each layout's per-step losses and gradient norms as JSON. Both use the same
seeded weights (`build_model` on the CPU), the same synthetic token batches and AdamW with clipping, so
the only difference is the layout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from leantrain.model.transformer import Transformer, build_model, model_args_from_spec
from leantrain.parallel import CommTimer, ParallelDims, parallelize
from leantrain.parallel.expert import expert_modules
from leantrain.spec.schema import JobSpec
from leantrain.train.optim import AdamWBf16States

SEQ_LEN = 16
MICRO_BATCH = 2
GLOBAL_SEQUENCES = 8  # per optimizer step, all ranks
LR = 1e-2
GRAD_CLIP = 1.0
SEED = 7


def make_spec(
    *, moe: bool = False, tie: bool = False, n_layers: int = 2, compute: str = "fp32", aux_loss_coef: float = 0.01,
    mla: bool = False, optimizer_state: str = "fp32", recompute: str = "none", **parallelism: Any
) -> JobSpec:
    """A tiny fp32 job; `parallelism` sets spec.parallelism fields. `mla`: DeepSeek-style latent attention, and
    with `moe` DeepSeek-V3's routing (sigmoid scores, 2 expert groups of which a token uses 1, weights × 2.5).
    `optimizer_state: bf16`: both runs step with `AdamWBf16States` (see `make_optimizer`)."""
    model: dict[str, Any] = {
        "architecture": "moe" if moe else "dense", "n_layers": n_layers, "d_model": 32, "n_heads": 4,
        "n_kv_heads": 4 if mla else 2, "ffn_hidden": 64, "vocab_size": 64, "tie_embeddings": tie,
    }
    if moe:
        model["moe"] = {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "num_shared_experts": 1,
                        "aux_loss_coef": aux_loss_coef}
    if mla:
        model["mla"] = {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                        "v_head_dim": 8}
        if moe:
            model["moe"].update({"router": "sigmoid", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                                 "first_dense_layers": 1})
    return JobSpec.model_validate({
        "model": model,
        "parallelism": {"zero_stage": 3, **parallelism},
        "precision": {"compute": compute, "optimizer_state": optimizer_state},
        "data": {"tokens_total": 1e5, "seq_len": SEQ_LEN},
        "training": {"global_batch_tokens": GLOBAL_SEQUENCES * SEQ_LEN, "micro_batch": MICRO_BATCH,
                     "device": "cpu", "seed": SEED, "activation_checkpointing": recompute},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 8},
    })


def batches(step: int, *, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's global batch as micro-batches of (inputs, targets); the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    # Learnable sequences (a random start, then steps of 1 or 2), so the loss falls and equal losses mean something.
    starts = torch.randint(0, vocab, (GLOBAL_SEQUENCES, 1), generator=gen)
    strides = torch.randint(1, 3, (GLOBAL_SEQUENCES, 1), generator=gen)
    tokens = (starts + strides * torch.arange(SEQ_LEN + 1)) % vocab  # (sequences, seq + 1)
    chunks = tokens.split(MICRO_BATCH)
    return [(c[:, :-1], c[:, 1:]) for c in chunks]


def full_model(spec: JobSpec) -> Transformer:
    args = model_args_from_spec(spec.model, max_seq_len=SEQ_LEN)
    model = build_model(args, device=torch.device("cpu"), seed=SEED)
    model.set_recompute(spec.training.activation_checkpointing)
    return model


def make_optimizer(spec: JobSpec, params: Any) -> torch.optim.Optimizer:
    """torch's AdamW, or for `optimizer_state: bf16` AdamWBf16States with round-to-nearest: its stochastic
    rounding draws its noise shard by shard, so a sharded run would round differently from one process."""
    if spec.precision.optimizer_state == "bf16":
        return AdamWBf16States(params, lr=LR, weight_decay=0.0, stochastic_rounding=False)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def reference_run(spec: JobSpec, *, steps: int) -> dict[str, list[float]]:
    """Single process: accumulate over all micro-batches, clip, AdamW."""
    torch.manual_seed(SEED)
    model = full_model(spec)
    optimizer = make_optimizer(spec, model.parameters())
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        micro = batches(step, vocab=spec.model.vocab_size or 64)
        total = 0.0
        for inputs, targets in micro:
            loss = _loss(model(inputs), targets)
            aux = model.auxiliary_loss()
            ((loss if aux is None else loss + aux) / len(micro)).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        optimizer.step()
        losses.append(total / len(micro))
    return {"loss": losses, "grad_norm": norms}


def layout_run(spec: JobSpec, *, steps: int) -> dict[str, list[float]]:
    """One rank of a distributed run (the process group is already up)."""
    world = dist.get_world_size()
    args = model_args_from_spec(spec.model, max_seq_len=SEQ_LEN)
    dims = ParallelDims.from_spec(spec.parallelism, world_size=world, shape=args.shape)
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args)
    model.set_recompute(spec.training.activation_checkpointing)  # as train/build.py, before parallelize
    num_micro = GLOBAL_SEQUENCES // MICRO_BATCH // dims.dp
    pm = parallelize(model, dims, spec, mesh=mesh, device=torch.device("cpu"), num_microbatches=num_micro)
    pm.initialize(seed=SEED)  # each rank fills its own shards: the same values as `full_model` (by name)
    optimizer = make_optimizer(spec, list(pm.parameters()))
    losses, norms, comm = [], [], {}
    timer = CommTimer(device_type="cpu")
    sent = [0]  # rows this rank's MoE layers hand to their experts in a step (before any all-to-all)
    for experts in (m for part in pm.parts for m in expert_modules(part)):
        experts.register_forward_pre_hook(lambda _m, args: sent.__setitem__(0, sent[0] + args[0].shape[0]),
                                          prepend=True)
    for step in range(steps):
        start = time.perf_counter()
        sent[0] = 0
        with timer.measure() if step == 1 else contextlib.nullcontext() as measured:  # step 0 has lazy setup
            optimizer.zero_grad(set_to_none=True)
            mine = batches(step, vocab=spec.model.vocab_size or 64)[pm.dp_rank :: pm.dp_size]
            loss = pm.forward_backward(mine, loss_fn=_loss)
            pm.finish_gradients()
            norms.append(float(pm.clip_grad_norm_(GRAD_CLIP)))
            optimizer.step()
        if measured is not None:
            comm = {"comm_s": measured.comm_s, "num_events": measured.num_events,
                    "step_s": time.perf_counter() - start}
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # mean over data-parallel ranks
        losses.append(float(loss) / dims.dp)
    experts = [m for part in pm.parts for m in expert_modules(part)]
    local_experts = experts[0].w1.to_local().shape[0] if experts and isinstance(experts[0].w1, DTensor) else None
    # Share of the routed experts' weights this rank holds (1/ep under EP alone; 1/dp_shard with expert FSDP).
    expert_share = (experts[0].w1.to_local().numel() / experts[0].w1.numel()) if experts and isinstance(
        experts[0].w1, DTensor) else None
    param_dtypes = sorted({str(p.dtype) for p in pm.parameters()})
    moment_dtypes = sorted({str(s["exp_avg"].dtype) for s in optimizer.state.values()})
    return {"loss": losses, "grad_norm": norms, "comm": comm, "local_experts": local_experts,
            "expert_share": expert_share, "expert_rows_sent": sent[0],
            "param_dtypes": param_dtypes, "moment_dtypes": moment_dtypes}


def _gloo_worker(rank: int, world_size: int, fn: Callable[[], Any], out_file: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = Path(out_file).with_name("store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn()
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: a gloo process sometimes aborts there (docs/parallel.md)


def spawn_gloo(fn: Callable[[], Any], *, world_size: int, out_dir: Path) -> Any:
    """Run `fn` (a picklable top-level function or partial) on `world_size` fresh spawned processes in one gloo
    group; rank 0's JSON-able result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "result.json"
    mp.start_processes(_gloo_worker, args=(world_size, fn, str(out_file)), nprocs=world_size, join=True,
                       start_method="spawn")
    return json.loads(out_file.read_text())


def _run_layouts(jobs: list[tuple[str, dict[str, Any]]], steps: int) -> dict[str, Any]:
    return {name: layout_run(make_spec(**spec_kwargs), steps=steps) for name, spec_kwargs in jobs}


def spawn_layouts(
    jobs: list[tuple[str, dict[str, Any]]], *, world_size: int, steps: int, out_dir: Path
) -> dict[str, dict[str, list[float]]]:
    """Run each (name, make_spec kwargs) layout on `world_size` fresh processes; rank 0's results by name."""
    return spawn_gloo(functools.partial(_run_layouts, jobs, steps), world_size=world_size, out_dir=out_dir)


# torchrun's agent picks the workers' MASTER_PORT by binding port 0 and closing it; with the shared rendezvous
# store off (launch.resources.TORCHRUN_ENV, on purpose: restarts timed out with it) rank 0 binds that port seconds
# later, and a socket of another test running beside it can take it first. Such a start is retried once.
PORT_TAKEN = "EADDRINUSE"


def port_taken(output: str) -> bool:
    """Whether a torchrun job failed only because its rank 0 could not bind the port the agent picked."""
    return PORT_TAKEN in output


def torchrun_train(raw: dict[str, Any], run_dir: Path, *, nproc: int = 2, timeout_s: float = 300) -> None:
    """`leantrain train` on `nproc` gloo ranks through torchrun's command line, for the job dict `raw` (its spec
    file is written beside `run_dir`); fails the test with the end of the output when it does not exit 0."""
    import subprocess

    import yaml

    from leantrain.launch import torchrun
    from leantrain.launch.resources import TrainCommand
    from leantrain.spec import spec_from_dict

    spec_path = run_dir.with_suffix(".yaml")
    spec_path.write_text(yaml.safe_dump(raw))
    argv = torchrun.torchrun_argv(spec_from_dict(raw), train=TrainCommand(spec_path=spec_path), run_dir=run_dir,
                                  nproc=nproc, max_restarts=0)
    for attempt in range(2):
        proc = subprocess.run(argv, env=torchrun.torchrun_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode == 0 or attempt or not port_taken(proc.stdout + proc.stderr):
            break
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing trained: start it again on a fresh port
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
