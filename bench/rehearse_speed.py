"""How long `leantrain rehearse` takes per rank, against the floor fake tensors set.

The rehearsal runs the trainer itself under a fake process group and fake tensors (docs/rehearse.md); its cost
is the ops it dispatches, each through FSDP2/DTensor, the rehearsal's probes and FakeTensorMode. The baseline
is an independent loop that does not use leantrain's model or trainer: a plain-torch pre-norm transformer block
with the same widths (d_model, heads, SwiGLU, vocabulary), run forward and backward under FakeTensorMode for
the same layer × micro-batch count, with no parallelism and no probes. The ratio says what the trainer's
parallel path and the probes cost over fake tensors' own dispatch.

    python bench/rehearse_speed.py [--example llama3-405b.yaml] [--set key=value ...]

Default: Llama 3.1 405B's widths on its 16,384-rank world, cut to 16 layers under 1F1B (one layer per PP16
stage, 16 micro-batches), rank 0: the scale lane's 405B job.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SETS = ["model.n_layers=16", "parallelism.pipeline_schedule=1f1b", "parallelism.virtual_stages=1"]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rehearsal(example: str, sets: list[str]) -> tuple[float, dict]:
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(ROOT / "examples" / example, overrides=sets)
    start = cpu_s()
    report = rehearse(spec, ranks=[0], isolated=False)
    return cpu_s() - start, report


def bare_fake_loop(*, d: int, heads: int, kv_heads: int, ffn: int, vocab: int, tokens: int, layers: int,
                   microbatches: int, steps: int, first: bool, last: bool) -> float:
    """The same layer × micro-batch work as plain torch ops under FakeTensorMode (bf16, one rank's TP shard of
    nothing: whole widths divided by `tp` are passed in by the caller)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = cpu_s()
    with FakeTensorMode():
        dt = torch.bfloat16
        head_dim = d // heads
        weights = []
        for _ in range(layers):
            weights.append([torch.empty(n, d, dtype=dt, requires_grad=True) for n in
                            (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)]
                           + [torch.empty(d, heads * head_dim, dtype=dt, requires_grad=True)]
                           + [torch.empty(ffn, d, dtype=dt, requires_grad=True) for _ in range(2)]
                           + [torch.empty(d, ffn, dtype=dt, requires_grad=True)]
                           + [torch.ones(d, dtype=dt, requires_grad=True) for _ in range(2)])
        embed = torch.empty(vocab, d, dtype=dt, requires_grad=True)
        for _ in range(steps):
            for _ in range(microbatches):
                x = (F.embedding(torch.zeros(1, tokens, dtype=torch.long), embed) if first
                     else torch.empty(1, tokens, d, dtype=dt, requires_grad=True))
                for wq, wk, wv, wo, w1, w3, w2, n1, n2 in weights:
                    h = F.rms_norm(x, (d,), n1)
                    q = F.linear(h, wq).view(1, tokens, -1, head_dim).transpose(1, 2)
                    k = F.linear(h, wk).view(1, tokens, -1, head_dim).transpose(1, 2)
                    v = F.linear(h, wv).view(1, tokens, -1, head_dim).transpose(1, 2)
                    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    x = x + F.linear(a.transpose(1, 2).reshape(1, tokens, -1), wo)
                    h = F.rms_norm(x, (d,), n2)
                    x = x + F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)
                out = (F.cross_entropy(F.linear(x, embed).float().view(tokens, -1),
                                       torch.zeros(tokens, dtype=torch.long)) if last else x.float().sum())
                out.backward()
    return cpu_s() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", default="llama3-405b.yaml")
    parser.add_argument("--set", action="append", default=None)
    args = parser.parse_args()
    sets = args.set if args.set is not None else DEFAULT_SETS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    took, report = rehearsal(args.example, sets)
    rank = report["ranks"][0]
    from leantrain.golive.rehearse_report import STEPS
    from leantrain.spec import load_spec
    from leantrain.spec.shapes import resolve_shape

    spec = load_spec(ROOT / "examples" / args.example, overrides=sets)
    shape = resolve_shape(spec.model)
    par = spec.parallelism
    tp, pp = par.tensor_parallel, par.pipeline_parallel
    layers = rank.get("layers") or math.ceil(shape.n_layers / pp)
    tokens = spec.training.micro_batch * spec.data.seq_len
    base = bare_fake_loop(d=shape.d_model, heads=shape.n_heads // tp, kv_heads=max(1, shape.n_kv_heads // tp),
                          ffn=shape.ffn_hidden // tp, vocab=shape.vocab_size // tp, tokens=tokens // tp,
                          layers=layers, microbatches=rank["num_microbatches"], steps=STEPS, first=True,
                          last=pp == 1)
    print(f"{args.example} {' '.join(sets)}: rank 0 of {report['world_size']} ({report['layout']}), {layers} layers, "
          f"{rank['num_microbatches']} micro-batches, {STEPS} steps")
    print(f"rehearsal (the trainer, FSDP2/TP/PP, probes, fake tensors): {took:.1f} s CPU "
          f"(startup {rank['rehearsal_s']['startup']:.1f} s, step {rank['rehearsal_s']['step']:.1f} s wall)")
    print(f"bare fake-tensor loop, same layers x micro-batches x steps: {base:.1f} s CPU")
    print(f"ratio rehearsal / bare loop: {took / base:.2f}x  (load {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")


if __name__ == "__main__":
    main()
