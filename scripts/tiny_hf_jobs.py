"""Run a fine-tuning example end to end on the CPU, nothing downloaded: `.venv/bin/python scripts/tiny_hf_jobs.py JOB`.

JOB is `continue-pretrain` (examples/continue-pretrain-cpu.yaml), `finetune-lora`
(examples/finetune-lora-cpu.yaml; `--qlora` swaps in finetune.method qlora) or `dpo-lora`
(examples/dpo-lora-cpu.yaml: DPO on generated arithmetic preference pairs, starting from the model that
`finetune-lora` exported, so SFT then DPO is two commands). The script builds what the
examples start from under demo-out/: a tiny Llama checkpoint with random weights (transformers'
LlamaConfig, saved with save_pretrained, plus a byte-level tokenizer with a ChatML chat template), and for
the LoRA job a generated arithmetic chat set and a multiple-choice eval file. Then it runs
`leantrain prepare`, `train`, `export` and `eval` on the example spec, as a user would one by one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    from leantrain.cli import main as leantrain
except ModuleNotFoundError:  # run with another Python than `make demo`'s venv: use the venv's
    VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
    if not VENV_PYTHON.exists() or Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        sys.exit("leantrain is not installed for this Python: run `make demo` (or `make install`) first, then "
                 f"`.venv/bin/python {Path(__file__).relative_to(ROOT)} ...`")
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), __file__, *sys.argv[1:]])
from leantrain.model.tiny_hf import save_example_model  # noqa: E402

OUT = ROOT / "demo-out"
SPECS = {"continue-pretrain": ("continue-pretrain-cpu.yaml", "cp-run", "cp-hf"),
         "finetune-lora": ("finetune-lora-cpu.yaml", "lora-run", "lora-hf"),
         "dpo-lora": ("dpo-lora-cpu.yaml", "dpo-run", "dpo-hf")}


def tiny_model(path: Path) -> None:
    if save_example_model(path):
        print(f"built a tiny random Llama checkpoint in {path}")


def arithmetic_chat(chat_path: Path, mc_path: Path, *, seed: int = 0) -> None:
    """Conversations `What is a + b?` → `a + b = c.`, and a held-out multiple-choice file on the same skill."""
    rng = random.Random(seed)
    with open(chat_path, "w", encoding="utf-8") as out:
        for _ in range(400):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            record = {"messages": [{"role": "system", "content": "You add numbers."},
                                   {"role": "user", "content": f"What is {a} + {b}?"},
                                   {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]}
            out.write(json.dumps(record) + "\n")
    with open(mc_path, "w", encoding="utf-8") as out:
        for _ in range(40):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            wrong = sorted({a + b + 1, a + b + 2, max(0, a + b - 1)} - {a + b})[:2]
            choices = [f"{a} + {b} = {c}." for c in [a + b, *wrong]]
            rng.shuffle(choices)
            out.write(json.dumps({"question": f"What is {a} + {b}?", "choices": choices,
                                  "answer": f"{a} + {b} = {a + b}."}) + "\n")


def arithmetic_preferences(path: Path, *, seed: int = 1) -> None:
    """Pairs for DPO: the same questions, a worked answer chosen over a refusal or a sum that is off by one."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(300):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            rejected = "I cannot do arithmetic." if rng.random() < 0.7 else f"{a} + {b} = {a + b + 1}."
            prompt = [{"role": "system", "content": "You add numbers."},
                      {"role": "user", "content": f"What is {a} + {b}?"}]
            out.write(json.dumps({"prompt": prompt,
                                  "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}."}],
                                  "rejected": [{"role": "assistant", "content": rejected}]}) + "\n")


def run(job: str, *, qlora: bool) -> int:
    spec_name, run_name, export_name = SPECS[job]
    spec = str(ROOT / "examples" / spec_name)
    OUT.mkdir(exist_ok=True)
    tiny_model(OUT / "tiny-llama")
    sets: list[str] = []
    tasks: list[str] = []
    if job == "finetune-lora":
        arithmetic_chat(OUT / "arith-chat.jsonl", OUT / "arith-mc.jsonl")
        tasks = ["--tasks", str(OUT / "arith-mc.jsonl")]
        if qlora:
            sets = ["--set", "finetune.method=qlora"]
    if job == "dpo-lora":  # DPO starts from the SFT model that `finetune-lora` exported (merged) to lora-hf
        if not (OUT / "lora-hf" / "config.json").is_file():
            print("dpo-lora tunes the SFT model: run `scripts/tiny_hf_jobs.py finetune-lora` first")
            return 2
        arithmetic_preferences(OUT / "arith-prefs.jsonl")
        tasks = ["--tasks", str(OUT / "arith-mc.jsonl")]
    for folder in (run_name, export_name):
        shutil.rmtree(OUT / folder, ignore_errors=True)
    steps = [["prepare", spec, *sets], ["train", spec, *sets],
             ["export", str(OUT / run_name), "--out", str(OUT / export_name)],
             ["eval", str(OUT / run_name), *tasks]]
    for argv in steps:
        print(f"$ leantrain {' '.join(argv)}")
        code = leantrain(argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", choices=sorted(SPECS))
    parser.add_argument("--qlora", action="store_true", help="finetune-lora with finetune.method qlora")
    args = parser.parse_args()
    sys.exit(run(args.job, qlora=args.qlora))
