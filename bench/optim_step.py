"""Optimizer step time of AdamWBf16States (bf16 moments, multi-tensor) vs torch's AdamW (CPU).

The same fp32 parameters (a Llama-shaped set: per layer wq/wk/wv/wo, w1/w2/w3 and two norm gains, plus the
embedding and output head) with the same fixed gradients are stepped by:
- torch_foreach (the baseline): `torch.optim.AdamW(foreach=True)`, fp32 moments;
- torch_fused: `torch.optim.AdamW(fused=True)`, what `optimizer_state: fp32` builds;
- bf16_states: `AdamWBf16States` as `optimizer_state: bf16` builds it (stochastic rounding on);
- bf16_states_nearest: the same with round-to-nearest (`stochastic_rounding=False`).
Only `optimizer.step()` is timed. Steps are interleaved round-robin (one of each per round) so a busy machine
slows all alike; the median and the best step are reported. Prints `name: value unit (ratio vs baseline)`;
the ratio is a speed ratio (baseline time / this time), so < 1.0 means slower than torch's foreach AdamW.

Usage: python bench/optim_step.py [--steps N] [--threads T] [--layers L] [--d-model D]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from leantrain.train.optim import AdamWBf16States

HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8}
WEIGHT_DECAY = 0.1


def make_params(*, layers: int, d_model: int, vocab: int) -> list[torch.nn.Parameter]:
    """Llama-shaped fp32 parameters with fixed random gradients (GQA with half the heads for k/v)."""
    gen = torch.Generator().manual_seed(0)
    kv, ffn = d_model // 2, 3 * d_model
    shapes = [(vocab, d_model), (vocab, d_model)]
    for _ in range(layers):
        shapes += [(d_model, d_model), (kv, d_model), (kv, d_model), (d_model, d_model),
                   (ffn, d_model), (ffn, d_model), (d_model, ffn), (d_model,), (d_model,)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def builders() -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    return {
        "torch_foreach": lambda ps: torch.optim.AdamW(groups(ps), **HYPER, foreach=True),
        "torch_fused": lambda ps: torch.optim.AdamW(groups(ps), **HYPER, fused=True),
        "bf16_states": lambda ps: AdamWBf16States(groups(ps), **HYPER, seed=0),
        "bf16_states_nearest": lambda ps: AdamWBf16States(groups(ps), **HYPER, stochastic_rounding=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = {}
    for name, build in builders().items():
        params = make_params(layers=args.layers, d_model=args.d_model, vocab=args.vocab)
        optimizer = build(params)
        optimizer.step()  # warm-up: the states are allocated here
        runs[name] = (optimizer, [])
    baseline_params = [p for g in runs["torch_foreach"][0].param_groups for p in g["params"]]
    numel = sum(p.numel() for p in baseline_params)
    for _ in range(args.steps):
        for optimizer, times in runs.values():
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
    print(f"# {numel / 1e6:.1f}M fp32 parameters in {len(baseline_params)} tensors, {args.steps} interleaved "
          f"steps, {args.threads} thread(s), torch {torch.__version__}")
    base_median = statistics.median(runs["torch_foreach"][1])
    base_best = min(runs["torch_foreach"][1])
    for name, (optimizer, times) in runs.items():
        median, best = statistics.median(times), min(times)
        state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
        print(f"{name}: median {median * 1e3:.1f} ms (ratio {base_median / median:.2f}), best {best * 1e3:.1f} ms "
              f"(ratio {base_best / best:.2f}), moment bytes/param {state_bytes / numel:.1f}")


if __name__ == "__main__":
    main()
