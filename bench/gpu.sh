#!/usr/bin/env bash
# GPU benchmark (issue #5): a ~1B dense Llama-style model on one GPU with bf16 + torch.compile, and fp8
# (torchao float8) where the GPU has it (compute capability >= 8.9). Prints tokens/s, MFU and peak memory
# per run, then the fp8/bf16 ratio. Finishes in under 8 minutes; every step is printed as it goes.
# Usage: bash bench/gpu.sh  (after `make install`); OUT=dir to change where it writes.
set -euo pipefail
cd "$(dirname "$0")/.."
LT=${LT:-.venv/bin/leantrain}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-out/gpu}
SPEC=examples/gpu-1b-bench.yaml
STEPS=${STEPS:-30}
mkdir -p "$OUT"

"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh needs a CUDA GPU (torch.cuda.is_available() is False)")
print(f"gpu: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), torch {torch.__version__}")
PY

echo "== prepare (byte tokenizer, bundled corpus)"
timeout 120 "$LT" prepare "$SPEC" --out "$OUT/data"

run() {  # name, extra --set arguments...
  local name=$1; shift
  echo "== train $name ($STEPS steps)"
  rm -rf "$OUT/run-$name"
  timeout 240 "$LT" train "$SPEC" --set "data.dir=$OUT/data" --set training.eval_every=0 "$@" \
    --run-dir "$OUT/run-$name" --max-steps "$STEPS"
}
run bf16
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.get_device_capability() >= (8, 9) else 1)"; then
  run fp8 --set precision.compute=fp8
fi

"$PY" - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out, results = Path(sys.argv[1]), {}
for name in ("bf16", "fp8"):
    path = out / f"run-{name}" / "metrics.jsonl"
    if not path.is_file():
        continue
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
    steady = rows[len(rows) // 2:] or rows  # after compile warm-up
    results[name] = {k: statistics.median(r[k] for r in steady) for k in ("tokens_per_s", "mfu", "step_time_s")}
    results[name]["mem_gib"] = max(r["mem_bytes"] for r in rows) / 2**30
    r = results[name]
    print(f"gpu_1b_{name}_tokens_per_s: {r['tokens_per_s']:.0f} tokens/s")
    print(f"gpu_1b_{name}_mfu: {100 * r['mfu']:.1f} %")
    print(f"gpu_1b_{name}_peak_mem: {r['mem_gib']:.1f} GiB")
if "fp8" in results:
    ratio = results["fp8"]["tokens_per_s"] / results["bf16"]["tokens_per_s"]
    print(f"gpu_1b_fp8_vs_bf16: {ratio:.2f}x tokens/s (ratio vs bf16 baseline)")
PY
