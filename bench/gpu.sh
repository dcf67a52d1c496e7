#!/usr/bin/env bash
# One-GPU benchmark, under 8 minutes: a ~1B dense Llama-style model in bf16 (eager) and
# bf16 + per-block torch.compile; fp8 (torchao float8 + compile) where the GPU has it (capability >= 8.9);
# a small MoE (grouped GEMM dispatch) in bf16; FSDP2 on one device (`leantrain launch --nproc 1` with
# parallelism.fsdp_single_rank, ZeRO-3: the 1B bf16 run wrapped in FSDP2 over a 1-rank mesh, against the
# plain bf16 run); and `--max-steps 0` of an 8B-shaped model (build on meta, initialise on the GPU, `model_ready`). Each run prints
# tokens/s, MFU and peak memory with the ratio to the plan's prediction (plan.json in its run dir). Every command
# has a timeout and prints as it goes.
# The plan's ratios use the catalog entry of the GPU found (H200, H100-SXM, A100-80GB...; ACCEL=name overrides). A run
# that fails is reported and the next one still runs (the script exits 1 at the end), and each run's checkpoint
# (a 1B model's is ~12 GB) is deleted after the run, so that a 64 GiB disk holds the whole benchmark.
# PARTS=wide adds three runs at Llama 3 8B's widths cut to 4 layers (d_model 4096, vocab 128256, seq 8192: the
# GEMM sizes of an 8B job) in bf16 eager, bf16 + compile and fp8 + compile, for fp8's gain at that size and the
# rehearsal's memory at a real vocabulary; PARTS=wide alone runs only those, PARTS="1b wide" both.
# Usage: bash bench/gpu.sh  (after `make install TORCH=cuda`); OUT=dir to change where it writes, STEPS=N.
set -euo pipefail
cd "$(dirname "$0")/.."
LT=${LT:-.venv/bin/leantrain}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-out/gpu}
SPEC=examples/gpu-1b-bench.yaml
STEPS=${STEPS:-20}
PARTS=${PARTS:-1b}
mkdir -p "$OUT"

"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh needs a CUDA GPU (torch.cuda.is_available() is False)")
print(f"gpu: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), torch {torch.__version__}")
PY
if [ -z "${ACCEL:-}" ]; then  # the catalog's name for this GPU (leantrain/hardware.py), H100-SXM when unknown
  ACCEL=$("$PY" -c "
import torch
name = torch.cuda.get_device_name()
known = [('H200', 'H200'), ('H100 PCIe', 'H100-PCIe'), ('H100', 'H100-SXM'), ('H800', 'H800'), ('B200', 'B200'),
         ('A100-SXM4-40GB', 'A100-40GB'), ('A100', 'A100-80GB'), ('L40S', 'L40S')]
print(next((ours for theirs, ours in known if theirs in name), 'H100-SXM'))")
fi
echo "catalog accelerator: $ACCEL"
FAILED=""

echo "== prepare (byte tokenizer, bundled corpus)"
timeout 120 "$LT" prepare "$SPEC" --out "$OUT/data"

run() {  # name, steps, timeout_s, extra arguments (--set ...); CMD=launch for `leantrain launch`
  local name=$1 steps=$2 limit=$3; shift 3
  echo "== ${CMD:-train} $name ($steps steps)"
  rm -rf "$OUT/run-$name"
  local rc=0
  timeout "$limit" "$LT" "${CMD:-train}" "$SPEC" --set "data.dir=$OUT/data" --set training.eval_every=0 \
    --set training.log_every=5 --set "hardware.accelerator=$ACCEL" "$@" --run-dir "$OUT/run-$name" \
    --max-steps "$steps" || rc=$?
  rm -rf "$OUT/run-$name/checkpoints"
  if [ "$rc" != 0 ]; then echo "== $name FAILED (exit $rc)"; FAILED="$FAILED $name"; fi
}
part() { [[ " $PARTS " == *" $1 "* ]]; }
fp8_here() { "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.get_device_capability() >= (8, 9) else 1)"; }
if part 1b; then
run bf16 "$STEPS" 120 --set training.compile=false
run bf16-compile "$STEPS" 180 --set training.compile=true
if fp8_here; then
  run fp8-compile "$STEPS" 180 --set precision.compute=fp8 --set training.compile=true
fi
run moe-small "$STEPS" 120 --set training.compile=false --set model.size_billion=null --set model.architecture=moe \
  --set model.n_layers=8 --set model.d_model=1024 --set model.n_heads=16 --set model.n_kv_heads=8 \
  --set model.ffn_hidden=2816 --set model.moe.num_experts=8 --set model.moe.top_k=2 \
  --set model.moe.expert_hidden=1024 --set model.moe.balance=aux_free
CMD=launch run bf16-fsdp1 "$STEPS" 150 --nproc 1 --set training.compile=false \
  --set parallelism.fsdp_single_rank=true --set parallelism.zero_stage=3
run 8b-ready 0 180 --set model.size_billion=8 --set model.vocab_size=128256
fi
if part wide; then
  WIDE=(--set model.size_billion=null --set model.n_layers=4 --set model.d_model=4096 --set model.n_heads=32
        --set model.n_kv_heads=8 --set model.ffn_hidden=14336 --set model.vocab_size=128256
        --set model.tie_embeddings=false --set data.seq_len=8192 --set training.micro_batch=1)
  WSTEPS=${WSTEPS:-10}
  run wide-bf16 "$WSTEPS" 120 "${WIDE[@]}" --set training.compile=false
  run wide-bf16-compile "$WSTEPS" 180 "${WIDE[@]}" --set training.compile=true
  if fp8_here; then
    run wide-fp8-compile "$WSTEPS" 180 "${WIDE[@]}" --set precision.compute=fp8 --set training.compile=true
  fi
fi

"$PY" - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])

def plan_of(run: Path) -> dict:
    path = run / "plan.json"
    return json.loads(path.read_text()) if path.is_file() else {}

def ratio(value: float, planned: float | None) -> str:
    return f"({value / planned:.2f}x vs plan)" if planned else "(no plan)"

results = {}
for name in ("bf16", "bf16-compile", "fp8-compile", "moe-small", "bf16-fsdp1", "wide-bf16", "wide-bf16-compile",
             "wide-fp8-compile"):
    run = out / f"run-{name}"
    path = run / "metrics.jsonl"
    if not path.is_file():
        continue
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
    steady = rows[len(rows) // 2:] or rows  # after compile warm-up
    r = {k: statistics.median(x[k] for x in steady) for k in ("tokens_per_s", "mfu", "step_time_s")}
    r["mem_gib"] = max(x["mem_bytes"] for x in rows) / 2**30
    results[name] = r
    plan = plan_of(run)
    planned_mem = plan.get("memory", {}).get("per_gpu", {}).get("total")
    key = name.replace("-", "_")
    print(f"gpu_{key}_tokens_per_s: {r['tokens_per_s']:.0f} tokens/s "
          f"{ratio(r['tokens_per_s'], plan.get('throughput', {}).get('tokens_per_s'))}")
    print(f"gpu_{key}_mfu: {100 * r['mfu']:.1f} % {ratio(r['mfu'], plan.get('throughput', {}).get('mfu'))}")
    print(f"gpu_{key}_peak_mem: {r['mem_gib']:.1f} GiB {ratio(r['mem_gib'] * 2**30, planned_mem)}")
if "bf16-compile" in results and "bf16" in results:
    print(f"gpu_1b_compile_vs_eager: {results['bf16-compile']['tokens_per_s'] / results['bf16']['tokens_per_s']:.2f}x "
          "tokens/s (ratio vs bf16 eager baseline)")
if "fp8-compile" in results and "bf16-compile" in results:
    print(f"gpu_1b_fp8_vs_bf16: {results['fp8-compile']['tokens_per_s'] / results['bf16-compile']['tokens_per_s']:.2f}x "
          "tokens/s (ratio vs bf16+compile baseline)")
for prefix in ("", "wide-"):
    eager, compiled, fp8 = (results.get(prefix + n) for n in ("bf16", "bf16-compile", "fp8-compile"))
    if prefix and compiled and eager:
        print(f"gpu_wide_compile_vs_eager: {compiled['tokens_per_s'] / eager['tokens_per_s']:.2f}x tokens/s "
              "(ratio vs bf16 eager baseline)")
    if prefix and fp8 and compiled:
        print(f"gpu_wide_fp8_vs_bf16: {fp8['tokens_per_s'] / compiled['tokens_per_s']:.2f}x tokens/s "
              "(ratio vs bf16+compile baseline)")
if "bf16-fsdp1" in results and "bf16" in results:
    fsdp, plain = results["bf16-fsdp1"], results["bf16"]
    print(f"gpu_1b_fsdp1_vs_plain: {fsdp['tokens_per_s'] / plain['tokens_per_s']:.2f}x tokens/s "
          "(ratio vs plain bf16 eager baseline)")
    print(f"gpu_1b_fsdp1_peak_mem_vs_plain: {fsdp['mem_gib'] / plain['mem_gib']:.2f}x peak memory "
          "(ratio vs plain bf16 eager baseline)")
events = out / "run-8b-ready" / "events.jsonl"
if events.is_file():
    ready = [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "model_ready"][-1]
    rank = ready["ranks"][0]
    print(f"gpu_8b_ready_param_bytes: {ready['param_bytes_total'] / 2**30:.1f} GiB")
    print(f"gpu_8b_ready_device_peak: {rank['device_mem_peak_bytes'] / 2**30:.1f} GiB "
          f"({rank['device_mem_peak_bytes'] / ready['param_bytes_total']:.2f}x the parameters)")
    print(f"gpu_8b_ready_host_rss_peak: {rank['host_rss_peak_bytes'] / 2**30:.1f} GiB "
          f"({rank['host_rss_peak_bytes'] / ready['param_bytes_total']:.2f}x the parameters)")
PY
if [ -n "$FAILED" ]; then echo "failed runs:$FAILED"; exit 1; fi
