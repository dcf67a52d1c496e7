"""`leantrain eval RUN_DIR|SPEC [--step N] [--base-as-trained] --tasks FILE...`: held-out loss per source and
multiple-choice accuracy.

The model: a run dir's checkpoint (newest committed, or `--step`; a LoRA run's adapters on its hash-checked
base, with `--base-as-trained` a QLoRA run's base in NF4 as it trained), or a spec's `model.init_from`
weights. Evaluation runs in this one process (the whole model in memory): it is for the checkpoints one
machine can hold; bigger ones are evaluated after export by an inference stack.

- Held-out loss and perplexity per source: the data dir's `valid` split, the first `training.eval_batches`
  micro-batches of each source's stream (as the trainer's evaluation, chat sources on assistant tokens only);
  for a DPO run, the valid pairs' preference loss, `rewards/margin` and `rewards/accuracy` per source.
- Multiple choice (a task FILE is JSONL, one `{"question", "choices": [...], "answer"}` per line, the answer
  an index or the text of the right choice), scored as lm-evaluation-harness scores its multiple-choice tasks
  (`output_type: multiple_choice`, `target_delimiter: " "`): context `Question: {question}\\nAnswer:`,
  continuation ` {choice}`, split into tokens as its HF model does (the pair encoded whole, the continuation
  being what follows the context's own tokens; no BOS added). `acc` takes the choice with the highest summed
  log-likelihood of its continuation tokens, `acc_norm` the highest log-likelihood divided by the choice's
  length in characters, `acc_bytes` divided by its length in UTF-8 bytes (the choice without the delimiter:
  lm_eval/api/task.py, `ConfigurableTask.process_results`: `completion_len = len(i)`, `byte_length =
  len(i.encode("utf-8"))`, `pred_norm = np.argmax(lls / completion_len)`); ties go to the first choice.
Results go to RUN_DIR/eval.json (SPEC: its run.dir) and are printed; `leantrain report` lists them.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.ckpt.base_ref import verify_base
from leantrain.ckpt.export import DcpTensors, check_base_as_trained
from leantrain.data.layout import MANIFEST, load_manifest
from leantrain.data.preference import PairBatchSampler
from leantrain.data.sampler import PackedBatchSampler
from leantrain.errors import UserInputError
from leantrain.model.hf_load import fill_from_hf
from leantrain.model.init import init_buffers
from leantrain.model.lora import is_adapter, quantize_base
from leantrain.model.transformer import Transformer, model_args_from_spec
from leantrain.spec import JobSpec, load_spec
from leantrain.spec.hf_config import read_hf_config
from leantrain.train.dpo import adapters_off, pair_loss, sequence_logps
from leantrain.train.dpo import enabled as dpo_enabled
from leantrain.train.finetune import prepare_model, uses_adapters
from leantrain.train.step_metrics import IGNORE_INDEX

EVAL_FILE = "eval.json"


@dataclass(frozen=True)
class Choice:
    question: str
    choices: list[str]
    answer: int


def read_task(path: Path) -> list[Choice]:
    """A multiple-choice JSONL file; a bad line is a UserInputError naming the file, the line and the field.
    Lines are counted at each newline byte, as the data readers count them; each is UTF-8 and one JSON object."""
    items = []
    for number, raw in enumerate(Path(path).read_bytes().split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserInputError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start} of the line); "
                                 "save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserInputError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(record, dict):
            raise UserInputError(f'{where}: expected a JSON object {{"question", "choices", "answer"}}, got '
                                 f"{json.dumps(record)[:40]}")
        choices, answer = record.get("choices"), record.get("answer")
        if not isinstance(record.get("question"), str) or not isinstance(choices, list) or len(choices) < 2 or not all(
                isinstance(c, str) for c in choices):
            raise UserInputError(f"{where}: needs a string 'question' and a list 'choices' of two or more strings")
        if isinstance(answer, str) and answer in choices:
            answer = choices.index(answer)
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise UserInputError(f"{where}: field 'answer' must be a choice's index or text, got {answer!r}")
        if choices.count(choices[answer]) > 1:  # equal choices score equal: the answer's twin decides by its index
            raise UserInputError(f"{where}: the answer {json.dumps(choices[answer])[:40]} is listed more than once "
                                 "in 'choices' (a repeated wrong choice is fine)")
        items.append(Choice(record["question"], choices, answer))
    if not items:
        raise UserInputError(f"{path}: no questions")
    return items


def _load_model(spec: JobSpec, run_dir: Path | None, *, step: int | None, base_as_trained: bool = False
                ) -> tuple[nn.Module, int | None]:
    if run_dir is None and spec.model.init_from is None:
        raise UserInputError("eval SPEC needs model.init_from (or give a run dir with checkpoints)")
    # the checkpoint is opened and checked (intact, and the spec's model) before the model is built
    checkpoint = None if run_dir is None else DcpTensors(spec, run_dir, step=step)
    max_len = spec.data.seq_len  # questions may be longer than training windows: the checkpoint's own limit
    if spec.model.init_from is not None:
        max_len = max(max_len, read_hf_config(spec.model.init_from).max_position_embeddings)
    args = model_args_from_spec(spec.model, max_seq_len=max_len)
    with torch.device("meta"):
        model = Transformer(args)
    prepare_model(model, spec)
    model.to_empty(device=torch.device("cpu"))
    init_buffers(model, args=args, device=torch.device("cpu"))
    if checkpoint is None:
        fill_from_hf(model, Path(str(spec.model.init_from)), args=args, skip=is_adapter)
        return model.eval(), None
    names = [n for n, _ in model.named_parameters() if n in checkpoint.meta]
    if uses_adapters(spec):
        fill_from_hf(model, verify_base(run_dir), args=args, skip=is_adapter)
        if base_as_trained:  # QLoRA: the adapted Linears' base in NF4, exactly as the run trained on it
            quantize_base(model)
    elif len(names) != len(list(model.parameters())):
        raise UserInputError(f"{run_dir}: checkpoint step {checkpoint.entry.step} lacks model weights")
    loaded = checkpoint.load(names, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in loaded:
                param.copy_(loaded[name])
    return model.eval(), checkpoint.entry.step


def _has_valid_split(spec: JobSpec) -> bool:
    """Whether data.dir holds a prepared data dir with held-out tokens (none: nothing to score). Its manifest.json
    is read here so that a damaged one is an error naming it, and every other problem of the split (a missing
    loss mask, another seq_len, an odd DPO micro-batch) is raised by the sampler, never taken for "no validation
    split" (nor skipped without a word with --tasks)."""
    if not (Path(spec.data.dir) / MANIFEST).is_file():
        return False
    return load_manifest(Path(spec.data.dir)).has_tokens("valid")


@torch.no_grad()
def held_out_loss(model: nn.Module, spec: JobSpec) -> dict[str, dict[str, float]]:
    """Mean loss and perplexity per source over the valid split's first `eval_batches` micro-batches."""
    if not _has_valid_split(spec):
        return {}
    sampler = PackedBatchSampler(spec.data.dir, seq_len=spec.data.seq_len, micro_batch=spec.training.micro_batch,
                                 dp_rank=0, dp_size=1, seed=spec.training.seed, split="valid")
    sums = torch.zeros(len(sampler.source_names), dtype=torch.float64)
    counts = torch.zeros_like(sums)
    for _ in range(spec.training.eval_batches):
        batch = sampler.next_batch()
        logits = model(batch.tokens[:, :-1])  # (batch, seq, vocab)
        token_loss = F.cross_entropy(logits.float().flatten(0, 1), batch.tokens[:, 1:].flatten(), reduction="none")
        mask = batch.loss_mask
        keep = torch.ones_like(token_loss, dtype=torch.bool) if mask is None else mask[:, 1:].flatten()
        sources = batch.source_ids[:, 1:].flatten()
        sums.index_add_(0, sources[keep], token_loss[keep].double())
        counts.index_add_(0, sources[keep], torch.ones(int(keep.sum()), dtype=torch.float64))
    return {name: {"loss": float(sums[i] / counts[i]), "perplexity": math.exp(min(float(sums[i] / counts[i]), 50.0)),
                   "tokens": int(counts[i])}
            for i, name in enumerate(sampler.source_names) if counts[i] > 0}


@torch.no_grad()
def held_out_preferences(model: nn.Module, spec: JobSpec) -> dict[str, dict[str, float]]:
    """DPO runs: the valid pairs' preference loss, reward margin and accuracy per source over the first
    `eval_batches` micro-batches, the reference as in training (train/dpo.py): the adapters-off base, the
    init_from weights for full DPO, none for ORPO."""
    if not _has_valid_split(spec):
        return {}
    sampler = PairBatchSampler(spec.data.dir, seq_len=spec.data.seq_len, micro_batch=spec.training.micro_batch,
                               dp_rank=0, dp_size=1, seed=spec.training.seed, split="valid")
    settings = spec.finetune.dpo
    reference = None
    if settings.loss != "orpo" and not uses_adapters(spec):
        reference = _load_model(spec.model_copy(update={"finetune": spec.finetune.model_copy(update={
            "method": "full"})}), None, step=None)[0]
    sums = torch.zeros(4, len(sampler.source_names), dtype=torch.float64)  # loss, margin, correct, pairs
    for _ in range(spec.training.eval_batches):
        batch = sampler.next_batch()
        assert batch.loss_mask is not None
        inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:].masked_fill(~batch.loss_mask[:, 1:], IGNORE_INDEX)
        policy, counts = sequence_logps(model(inputs), targets)
        reference_logps = None
        if settings.loss != "orpo":
            with adapters_off([model]) if reference is None else contextlib.nullcontext():
                reference_logps = sequence_logps((reference or model)(inputs), targets)[0]
        per_pair, chosen, rejected = pair_loss(policy, reference_logps, counts, beta=settings.beta, loss=settings.loss)
        sources = batch.source_ids[: len(per_pair), 0]
        values = torch.stack([per_pair, chosen - rejected, (chosen > rejected).float(), torch.ones_like(per_pair)])
        sums.index_add_(1, sources, values.double())
    return {name: {"loss": float(sums[0, i] / sums[3, i]), "rewards/margin": float(sums[1, i] / sums[3, i]),
                   "rewards/accuracy": float(sums[2, i] / sums[3, i]), "pairs": int(sums[3, i])}
            for i, name in enumerate(sampler.source_names) if sums[3, i] > 0}


def _tokenizer(spec: JobSpec) -> Any:
    from tokenizers import Tokenizer

    candidates = [Path(spec.model.init_from) / "tokenizer.json"] if spec.model.init_from else []
    candidates.append(Path(spec.data.dir) / "tokenizer.json")
    for path in candidates:
        if path.is_file():
            return Tokenizer.from_file(str(path))
    raise UserInputError(f"eval: no tokenizer.json in {' or '.join(str(c.parent) for c in candidates)}")


@torch.no_grad()
def continuation_logprob(model: nn.Module, context: list[int], continuation: list[int]) -> float:
    """Summed log-probability of `continuation` after `context` (one forward over context + continuation;
    as lm-evaluation-harness, the input keeps the last max_seq_len + 1 tokens)."""
    limit = model.args.max_seq_len + 1  # type: ignore[union-attr]
    context = context[-(limit - len(continuation)):] if len(context) + len(continuation) > limit else context
    tokens = torch.tensor([context + continuation])
    logprobs = F.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0]  # (seq, vocab)
    start = len(context) - 1
    picked = logprobs[start:].gather(-1, torch.tensor(continuation)[:, None])
    return float(picked.sum())


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness's HF model splits a request: trailing
    whitespace of the context moves to the continuation, the pair is encoded whole, and the continuation is
    what follows the context's own tokens (so a merge across the boundary is scored as the model sees it)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    return context_ids, whole[len(context_ids):]


def choice_log_likelihoods(model: nn.Module, item: Choice, tokenizer: Any) -> list[float]:
    """Each choice's summed log-likelihood as the continuation ` {choice}` of `Question: …\\nAnswer:`."""
    context = f"Question: {item.question}\nAnswer:"
    return [continuation_logprob(model, *encode_pair(tokenizer, context, f" {choice}")) for choice in item.choices]


def predictions(log_likelihoods: list[float], choices: list[str]) -> dict[str, int]:
    """The choice each metric picks: `acc` by log-likelihood, `acc_norm` per character, `acc_bytes` per byte."""
    lls = np.asarray(log_likelihoods, dtype=np.float64)
    chars = np.asarray([float(len(c)) for c in choices])
    num_bytes = np.asarray([float(len(c.encode("utf-8"))) for c in choices])
    return {"acc": int(np.argmax(lls)), "acc_norm": int(np.argmax(lls / chars)),
            "acc_bytes": int(np.argmax(lls / num_bytes))}


def multiple_choice(model: nn.Module, items: list[Choice], tokenizer: Any) -> dict[str, float]:
    """acc, acc_norm and acc_bytes over the items, as lm-evaluation-harness defines them (module docstring)."""
    correct = {"acc": 0, "acc_norm": 0, "acc_bytes": 0}
    for item in items:
        picked = predictions(choice_log_likelihoods(model, item, tokenizer), item.choices)
        for metric, choice in picked.items():
            correct[metric] += int(choice == item.answer)
    return {**{metric: count / len(items) for metric, count in correct.items()}, "num_questions": len(items)}


def evaluate(target: Path, *, tasks: list[Path], step: int | None = None, base_as_trained: bool = False,
             sets: list[str] | None = None, profile: str | None = None) -> dict[str, Any]:
    """Evaluate a run dir (its checkpoint) or a spec (its init_from weights); writes eval.json; returns it.
    `base_as_trained`: a QLoRA run's adapters on its NF4 base, as it trained (else on the stored base).
    `sets`, `profile`: `--set` overrides and `--profile` of the spec (the run dir's spec.yaml too)."""
    target = Path(target)
    run_dir = target if target.is_dir() else None
    spec = load_spec(target / "spec.yaml" if run_dir else target, profile=profile, overrides=sets or [])
    if base_as_trained:
        if run_dir is None:
            raise UserInputError("--base-as-trained evaluates a QLoRA run dir's checkpoint; give RUN_DIR")
        check_base_as_trained(spec, run_dir)
    items = {Path(t).stem: read_task(Path(t)) for t in tasks}  # bad task files fail before the model loads
    model, loaded_step = _load_model(spec, run_dir, step=step, base_as_trained=base_as_trained)
    result: dict[str, Any] = {"step": loaded_step, "base_as_trained": base_as_trained,
                              "held_out": (held_out_preferences if dpo_enabled(spec) else held_out_loss)(model, spec),
                              "tasks": {}}
    if items:
        tokenizer = _tokenizer(spec)
        result["tasks"] = {name: multiple_choice(model, task, tokenizer) for name, task in items.items()}
    out_dir = run_dir or Path(spec.run.dir)
    if not result["held_out"] and not items:  # nothing scored: an earlier eval.json is not overwritten with nothing
        raise UserInputError(f"data.dir {spec.data.dir}: no prepared validation split to score there (a typo, or "
                             "data.valid_fraction 0), and no --tasks were given: nothing to evaluate; "
                             f"{out_dir / EVAL_FILE} is left as it was")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / EVAL_FILE).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    result["path"] = str(out_dir / EVAL_FILE)
    return result


def run(*, console: Any, target: Path, tasks: list[Path], step: int | None, base_as_trained: bool = False,
        sets: list[str] | None = None, profile: str | None = None) -> None:
    """The `leantrain eval` command."""
    result = evaluate(target, tasks=tasks, step=step, base_as_trained=base_as_trained, sets=sets, profile=profile)
    for source, values in result["held_out"].items():
        detail = (f"ppl {values['perplexity']:.2f}" if "perplexity" in values else
                  f"margin {values['rewards/margin']:.3f}  accuracy {values['rewards/accuracy']:.3f} (pairs)")
        console.print(f"held-out {source:<16} loss {values['loss']:.4f}  {detail}", highlight=False)
    for name, values in result["tasks"].items():
        console.print(f"task {name:<20} acc {values['acc']:.3f}  acc_norm {values['acc_norm']:.3f}  "
                      f"acc_bytes {values['acc_bytes']:.3f}  ({values['num_questions']} questions)", highlight=False)
    console.print(f"results in {result['path']}", highlight=False)
