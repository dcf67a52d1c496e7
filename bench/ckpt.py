"""Checkpoint benchmark: async-save stall vs sync save time, and save MB/s vs `dd` to the same disk.

    python bench/ckpt.py [--state-mb 96] [--repeats 3] [--dir DIR] [--no-append]

The state is a model plus AdamW moments (about a third weights, two thirds optimizer), saved through the
CheckpointManager (DCP, sha256 manifest, fsync, commit, rename). Baselines: the sync save (for the async
stall) and `dd bs=4M conv=fsync` of the same number of bytes into the same folder (for bandwidth).
Prints `name: value unit (ratio vs baseline)` lines and appends them to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from leantrain.ckpt import CheckpointManager
from leantrain.spec import spec_from_dict
from leantrain.spec.schema import SecuritySpec

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BENCH_KEY_ENV = "LEANTRAIN_BENCH_CKPT_KEY"


def make_state(state_mb: float) -> dict:
    """A model whose weights + two Adam moments are about `state_mb` MB (fp32)."""
    width = 1024
    num_layers = max(1, round(state_mb * 1e6 / 12 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(num_layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "trainer": {"step": 0}}


def spec_for(root: Path, *, encrypt: bool) -> object:
    spec = spec_from_dict({
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "ffn_hidden": 32, "vocab_size": 64},
        "data": {"tokens_total": 1e4, "seq_len": 8},
        "training": {"global_batch_tokens": 8, "device": "cpu"},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1},
        "budget": {"target_days": None, "num_gpus": 1},
        "checkpoint": {"interval_steps": 1, "keep_last": 1, "url": str(root)},
    })
    if encrypt:
        spec.security = SecuritySpec(encrypt_checkpoints=True, encryption_key="${" + BENCH_KEY_ENV + "}")
    return spec


def time_saves(
    run_dir: Path, state: dict, *, repeats: int, blocking: bool, encrypt: bool = False
) -> tuple[list, list]:
    """Per save: (seconds the caller was blocked, seconds until committed). A fresh run dir per mode."""
    ckpt = CheckpointManager(spec_for(run_dir / "checkpoints", encrypt=encrypt), run_dir=run_dir)
    stalls, totals = [], []
    for step in range(1, repeats + 1):
        start = time.perf_counter()
        ckpt.save(step, state, blocking=blocking)
        stalls.append(time.perf_counter() - start)
        ckpt.wait()
        totals.append(time.perf_counter() - start)
    ckpt.close()
    return stalls, totals


def dd_seconds(folder: Path, num_bytes: int) -> float:
    count = max(1, num_bytes // (4 * 2**20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={folder / 'dd.bin'}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - start
    (folder / "dd.bin").unlink()
    return elapsed * num_bytes / (count * 4 * 2**20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mb", type=float, default=96.0, help="model + optimizer state size, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: cwd)")
    parser.add_argument("--no-append", action="store_true", help="do not append to bench/RESULTS.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    os.environ.setdefault(BENCH_KEY_ENV, base64.b64encode(os.urandom(32)).decode())
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or Path.cwd()))
    try:
        state = make_state(args.state_mb)
        time_saves(root / "warmup", state, repeats=1, blocking=True)  # first DCP call pays one-off costs
        _, sync_totals = time_saves(root / "sync", state, repeats=args.repeats, blocking=True)
        async_stalls, async_totals = time_saves(root / "async", state, repeats=args.repeats, blocking=False)
        _, enc_totals = time_saves(root / "encrypted", state, repeats=args.repeats, blocking=True, encrypt=True)
        saves = [e for e in (root / "async" / "events.jsonl").read_text().splitlines() if '"checkpoint_saved"' in e]
        assert len(saves) == args.repeats, "every async save must have been written, not skipped"
        num_bytes = sum(p.stat().st_size for p in (root / "sync" / "checkpoints").rglob("*") if p.is_file())
        dd_s = statistics.median(dd_seconds(root, num_bytes) for _ in range(args.repeats))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync_s, stall_s = statistics.median(sync_totals), statistics.median(async_stalls)
    async_s, enc_s = statistics.median(async_totals), statistics.median(enc_totals)
    mb = num_bytes / 1e6
    lines = [
        f"ckpt_state_size: {mb:.1f} MB",
        f"ckpt_sync_save: {sync_s:.3f} s",
        f"ckpt_async_stall: {stall_s:.3f} s ({stall_s / sync_s:.3f}x vs sync save)",
        f"ckpt_async_total: {async_s:.3f} s ({async_s / sync_s:.2f}x vs sync save)",
        f"ckpt_save_bandwidth: {mb / sync_s:.1f} MB/s ({(mb / sync_s) / (mb / dd_s):.2f}x vs dd conv=fsync)",
        f"dd_write_bandwidth: {mb / dd_s:.1f} MB/s (baseline)",
        f"ckpt_encrypted_save_bandwidth: {mb / enc_s:.1f} MB/s ({sync_s / enc_s:.2f}x vs plain save)",
    ]
    print("\n".join(lines))
    if not args.no_append:
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, torch {torch.__version__}"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = (f"\n## bench/ckpt.py — {stamp}\n\nMachine: {machine}; disk: the folder `{args.dir or Path.cwd()}`; "
                   f"median of {args.repeats}.\n\n```\n" + "\n".join(lines) + "\n```\n")
        with RESULTS.open("a", encoding="utf-8") as out:
            out.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
