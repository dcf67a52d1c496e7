"""Step time of leantrain's trainer vs a minimal hand-written PyTorch loop vs transformers' Llama (CPU).

All three train the same shape (same weights at the start) on the same number of tokens per step:
- ours: `Trainer.train_step()` — real sampler over a data dir, per-source loss, non-finite check, clip,
  AdamW as the trainer configures it, MoE/metrics bookkeeping;
- minimal: our model, `torch.optim.AdamW` with defaults, random tokens already in memory, forward,
  cross-entropy, backward, clip, step — the least a training loop can do;
- transformers: `LlamaForCausalLM` (SDPA attention) with the weights copied, in the same minimal loop.
Steps are interleaved round-robin (one of each per round) so a busy machine slows all three alike; the
median and the best (least disturbed) step time are reported, tokens/s from the best. Prints
`name: value unit (ratio vs baseline)`; the ratio is a speed ratio (baseline time / this time), so ≥ 1.0
means at least as fast as the minimal loop.

`--eval-window`: instead, the *logged* step time of a run with a heavy held-out evaluation every 2 steps
against the same run without evaluation (the baseline), and what the step time would be if the window's
wall clock were divided by its steps (evaluation counted in, as before the window excluded it).

Usage: python bench/train_step.py [--steps N] [--threads T] [--eval-window]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from leantrain.data.layout import write_token_data_dir
from leantrain.model.hf import export_hf
from leantrain.spec import spec_from_dict
from leantrain.train.trainer import Trainer

SHAPE = {"n_layers": 4, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "vocab_size": 1024,
         "tie_embeddings": False}
SEQ_LEN, MICRO_BATCH = 256, 8


def make_trainer(work: Path, *, run: str = "run", **training: object) -> Trainer:
    rng = np.random.default_rng(0)
    docs = [[int(t) for t in rng.integers(1, SHAPE["vocab_size"], 500)] for _ in range(400)]
    if not (work / "data").exists():
        write_token_data_dir(work / "data", {"a": docs[:200], "b": docs[200:]}, vocab_size=SHAPE["vocab_size"],
                             eos_id=0, valid_docs_by_source={"a": docs[:40], "b": docs[200:240]})
    spec = spec_from_dict({
        "model": {**SHAPE, "rope_theta": 10000.0},
        "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e9, "seq_len": SEQ_LEN, "dir": str(work / "data")},
        "training": {"global_batch_tokens": SEQ_LEN * MICRO_BATCH, "micro_batch": MICRO_BATCH, "lr": 1e-4,
                     "warmup_steps": 0, "device": "cpu", "eval_every": 0, **training},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
    })
    return Trainer(spec, run_dir=work / run)


def eval_window(steps: int, *, rounds: int = 3) -> None:
    """Logged step time with a heavy held-out evaluation every 2 steps vs the same run without evaluation.

    The two runs alternate `rounds` times (a busy machine slows both alike); medians over all logged windows
    but each run's first (lazy setup).
    """
    logged: dict[str, list[dict[str, float]]] = {"no_eval": [], "eval": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for round_index in range(rounds):
            for name, extra in (("no_eval", {"eval_every": 0}), ("eval", {"eval_every": 2, "eval_batches": 16})):
                trainer = make_trainer(work, run=f"{name}-{round_index}", max_steps=steps, log_every=2, **extra)
                logged[name] += [r for r in trainer.train() if "loss" in r][1:]
    base = statistics.median(r["step_time_s"] for r in logged["no_eval"])
    with_eval = statistics.median(r["step_time_s"] for r in logged["eval"])
    eval_s = statistics.median(r["eval_s"] for r in logged["eval"] if r["eval_s"] > 0)
    naive = statistics.median(r["window_s"] / 2 for r in logged["eval"])  # 2 steps per window
    print(f"# eval every 2 steps, 16 eval micro-batches, log every 2 steps, {rounds} × {steps} steps, threads "
          f"{torch.get_num_threads()}")
    print(f"logged_step_time_no_eval: {1000 * base:.1f} ms (1.00x vs no eval)")
    print(f"logged_step_time_with_eval: {1000 * with_eval:.1f} ms ({with_eval / base:.2f}x vs no eval)")
    print(f"eval_s_per_window: {1000 * eval_s:.1f} ms (reported apart, {eval_s / base:.1f}x a step)")
    print(f"window_s_over_steps_with_eval: {1000 * naive:.1f} ms ({naive / base:.2f}x vs no eval; eval counted in)")


def minimal_step_fn(model: torch.nn.Module, *, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(1, SHAPE["vocab_size"], (MICRO_BATCH, SEQ_LEN + 1))

    def step() -> None:
        logits = logits_of(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per loop")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per loop")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--eval-window", action="store_true", help="logged step time with vs without eval")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_window:
        eval_window(max(6, args.steps))  # --steps: steps per run
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trainer = make_trainer(work)
        loops: dict[str, Callable[[], object]] = {"ours": trainer.train_step}
        plain = copy.deepcopy(trainer.model)
        loops["minimal"] = minimal_step_fn(plain, logits_of=plain)
        try:
            from transformers import LlamaForCausalLM

            export_hf(trainer.model, work / "hf")
            hf = LlamaForCausalLM.from_pretrained(work / "hf", attn_implementation="sdpa").train()
            loops["transformers"] = minimal_step_fn(hf, logits_of=lambda x: hf(input_ids=x).logits)
        except ImportError:
            print("transformers: not installed (pip install transformers) — skipped")
        times: dict[str, list[float]] = {name: [] for name in loops}
        for round_index in range(args.warmup + args.steps):
            for name, step in loops.items():
                start = time.perf_counter()
                step()
                if round_index >= args.warmup:
                    times[name].append(time.perf_counter() - start)
    tokens = SEQ_LEN * MICRO_BATCH
    median = {name: statistics.median(values) for name, values in times.items()}
    best = {name: min(values) for name, values in times.items()}
    print(f"# shape {SHAPE}, seq_len {SEQ_LEN}, micro_batch {MICRO_BATCH}, fp32, threads {torch.get_num_threads()}, "
          f"{args.steps} steps, torch {torch.__version__}")
    for name in loops:
        ratio, best_ratio = median["minimal"] / median[name], best["minimal"] / best[name]
        print(f"{name}_step_time: {1000 * median[name]:.1f} ms ({ratio:.2f}x vs minimal)")
        print(f"{name}_step_time_best: {1000 * best[name]:.1f} ms ({best_ratio:.2f}x vs minimal)")
        print(f"{name}_tokens_per_s: {tokens / best[name]:,.0f} tokens/s ({best_ratio:.2f}x vs minimal)")


if __name__ == "__main__":
    main()
