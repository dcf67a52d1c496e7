"""finetune.method dpo on format: preference data: pairs prepared through the cleaning/PII/dedup path with masks on
the responses only, step-0 loss ln 2 (policy = reference), rising reward margins on a learnable preference set,
the reference as the adapters-off base (LoRA) or a frozen copy (full), a bit-for-bit resume, bad input refused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer

from leantrain.data.preference import PairBatchSampler, parse_preference
from leantrain.errors import UserInputError
from leantrain.spec import spec_from_dict

transformers = pytest.importorskip("transformers")
SEQ = 64


def preference_records(num: int = 24) -> list[dict[str, Any]]:
    """A learnable preference: the chosen answer repeats the prompt's digit, the rejected one says something else."""
    records = []
    for i in range(num):
        digit = i % 10
        records.append({"prompt": f"Say {digit} ({i})", "chosen": f"{digit} {digit} {digit}",
                        "rejected": f"no, {(digit + 3) % 10}"})
    return records


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_spec(root: Path, hf_dir: Path, *, weights: str = "lora", loss: str = "sigmoid", beta: float = 0.1,
             **training: Any) -> dict[str, Any]:
    return {
        "task": "finetune",
        "finetune": {"method": "dpo", "dpo": {"weights": weights, "beta": beta, "loss": loss},
                     "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0}},
        "model": {"init_from": str(hf_dir)},
        "precision": {"compute": "fp32"},
        # near dedup would fold the toy pairs (they differ in a digit); exact dedup and PII run as for any source
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(root / "data"), "valid_fraction": 0.0, "workers": 1,
                 "dedup": {"near": False},
                 "sources": [{"name": "prefs", "path": str(root / "prefs.jsonl"), "format": "preference"}]},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 0,
                     "schedule": "constant", "weight_decay": 0.0, "max_steps": 10, "device": "cpu", "log_every": 1,
                     "deterministic": True, "eval_every": 0, **training},
        "checkpoint": {"interval_steps": 5},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
        "run": {"dir": str(root / "run")},
    }


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny chat model and a prepared preference data dir (through `leantrain prepare`)."""
    from leantrain.cli import main
    from leantrain.model.tiny_hf import save_tiny_hf

    root = tmp_path_factory.mktemp("dpo")
    hf_dir = save_tiny_hf(root / "hf", vocab_size=320, hidden_size=64, intermediate_size=128)
    records = preference_records()
    records.append(records[0])  # an exact duplicate: dropped by dedup
    records.append({"prompt": "Where do I write?", "chosen": "Mail bob@example.com", "rejected": "Nowhere."})
    records.append({"prompt": "Which?", "chosen": "This one.", "rejected": "This one."})  # a tie: dropped
    write_jsonl(root / "prefs.jsonl", records)
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(dpo_spec(root, hf_dir)))
    assert main(["prepare", str(spec)]) == 0
    return root, hf_dir


def test_records_in_the_three_layouts() -> None:
    strings = parse_preference({"prompt": "hi", "chosen": "hello", "rejected": "go away"}, where="f:1")
    assert strings.prompt == [{"role": "user", "content": "hi"}]
    assert strings.chosen == [{"role": "assistant", "content": "hello"}]
    conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    implicit = parse_preference({"chosen": [*conversation, {"role": "assistant", "content": "hello"}],
                                 "rejected": [*conversation, {"role": "assistant", "content": "go away"}]}, where="f:2")
    assert implicit.prompt == conversation and implicit.rejected == [{"role": "assistant", "content": "go away"}]
    explicit = parse_preference({"prompt": conversation, "chosen": [{"role": "assistant", "content": "hello"}],
                                 "rejected": "go away"}, where="f:3")
    assert explicit == implicit
    with pytest.raises(UserInputError, match="p.jsonl:4: a preference record needs fields 'chosen' and 'rejected'"):
        parse_preference({"prompt": "x", "chosen": "y"}, where="p.jsonl:4")
    with pytest.raises(UserInputError, match="f:5: field 'rejected' must end with an assistant turn"):
        parse_preference({"prompt": "x", "chosen": "y", "rejected": [{"role": "user", "content": "z"}]}, where="f:5")


def test_a_long_pair_loses_the_start_of_its_prompt_first(tmp_path: Path) -> None:
    from leantrain.data.chat import ChatRenderer, template_for
    from leantrain.data.preference import encode_pair
    from leantrain.model.tiny_hf import save_tokenizer

    save_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    renderer = ChatRenderer(tokenizer, template=template_for(tmp_path / "tokenizer.json"),
                            eos_id=tokenizer.token_to_id("<|endoftext|>"))
    decode = lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
    long_prompt = parse_preference({"prompt": "x" * 100 + " the question?", "chosen": "yes, indeed",
                                    "rejected": "no"}, where="f:1")
    ids, mask = encode_pair(renderer, long_prompt, seq_len=SEQ)
    chosen, rejected = ids[: SEQ + 1], ids[SEQ + 1:]
    assert decode(chosen[mask[: SEQ + 1] == 1]) == "yes, indeed<|im_end|>\n"  # whole responses
    assert decode(rejected[mask[SEQ + 1:] == 1]) == "no<|im_end|>\n"
    start = int(np.argmax(mask[: SEQ + 1]))
    assert np.array_equal(chosen[:start], rejected[:start]) and decode(chosen[:start]).endswith(
        "the question?<|im_end|>\n<|im_start|>assistant\n")
    long_answer = parse_preference({"prompt": "q?", "chosen": "y" * 200, "rejected": "n"}, where="f:2")
    ids, mask = encode_pair(renderer, long_answer, seq_len=SEQ)
    assert decode(ids[: SEQ + 1]).startswith("<|im_start|>user\nq?") and mask[: SEQ + 1].sum() > SEQ // 2


def test_prepare_writes_whole_pairs_with_masks_on_the_responses(prepared: tuple[Path, Path]) -> None:
    from leantrain.data.layout import load_manifest

    root, hf_dir = prepared
    manifest = load_manifest(root / "data")
    entry = manifest.sources[0]
    assert entry["preference"] and entry["pair_seq_len"] == SEQ and entry["pad_multiple"] == 2 * (SEQ + 1)
    assert entry["docs"]["train"] == 25 and entry["drops"]["exact_duplicate"] == 1
    assert entry["drops"]["tied_pair"] == 1  # chosen == rejected teaches nothing (was kept and trained on)
    assert entry["pii"]["email"] == 1
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    sampler = PairBatchSampler(root / "data", seq_len=SEQ, micro_batch=4, dp_rank=0, dp_size=1, seed=0)
    seen = 0
    for _ in range(12):
        batch = sampler.next_batch()
        assert batch.tokens.shape == (4, SEQ + 1) and batch.loss_mask is not None
        for pair in range(2):
            chosen, rejected = batch.tokens[pair], batch.tokens[pair + 2]
            chosen_mask, rejected_mask = batch.loss_mask[pair], batch.loss_mask[pair + 2]
            decode = lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
            prompt_end = int(torch.nonzero(chosen_mask)[0])  # both rows share the prompt up to the response
            assert torch.equal(chosen[:prompt_end], rejected[:prompt_end]) and not rejected_mask[:prompt_end].any()
            assert decode(chosen[:prompt_end]).endswith("<|im_start|>assistant\n")
            learned_chosen, learned_rejected = decode(chosen[chosen_mask]), decode(rejected[rejected_mask])
            assert learned_chosen.endswith("<|im_end|>\n") and learned_rejected.endswith("<|im_end|>\n")
            if "EMAIL" in learned_chosen:
                assert "example.com" not in learned_chosen and learned_rejected == "Nowhere.<|im_end|>\n"
            else:
                digit = learned_chosen[0]
                assert learned_chosen == f"{digit} {digit} {digit}<|im_end|>\n"
                assert learned_rejected == f"no, {(int(digit) + 3) % 10}<|im_end|>\n"
                assert f"Say {digit} (" in decode(chosen[:prompt_end])
            seen += 1
    assert seen == 24
    with pytest.raises(UserInputError, match="must be even"):
        PairBatchSampler(root / "data", seq_len=SEQ, micro_batch=3, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(UserInputError, match="prepared for data.seq_len 64, the run has 32"):
        PairBatchSampler(root / "data", seq_len=32, micro_batch=4, dp_rank=0, dp_size=1, seed=0)



def test_preference_shards_record_their_largest_token_id_for_the_start_time_check(prepared: tuple[Path, Path]
                                                                                  ) -> None:
    """Preference (and chat) shards carry max_token_id in the manifest as text shards do, so the trainer's check
    at start covers DPO data: a model whose vocabulary stops at that id is refused, naming the shard."""
    from leantrain.data.layout import load_manifest
    from leantrain.data.sampler import check_token_ids
    from leantrain.data.shards import ShardReader

    root, _ = prepared
    manifest = load_manifest(root / "data")
    assert manifest.shards
    for shard in manifest.shards:
        assert shard.max_token_id == int(np.asarray(ShardReader(root / "data" / shard.path).tokens).max())
    top, path = max((s.max_token_id, s.path) for s in manifest.shards if s.max_token_id is not None)
    check_token_ids(manifest, root / "data", model_vocab_size=top + 1)
    with pytest.raises(UserInputError, match=f"manifest.json: shard {path} holds token ids up to {top}"):
        check_token_ids(manifest, root / "data", model_vocab_size=top)


def run_dpo(root: Path, hf_dir: Path, run_dir: Path, **overrides: Any) -> list[dict[str, Any]]:
    from leantrain.train.command import train

    raw = dpo_spec(root, hf_dir, **{k: v for k, v in overrides.items() if k in ("weights", "loss", "beta")})
    raw["training"].update({k: v for k, v in overrides.items() if k not in ("weights", "loss", "beta")})
    spec = spec_from_dict(raw)
    train(spec, run_dir=run_dir, max_steps=None, console=None)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.parametrize("weights", ["lora", "qlora", "full"])
def test_step_zero_is_ln2_and_margins_rise_on_a_learnable_preference(prepared: tuple[Path, Path], tmp_path: Path,
                                                                     weights: str) -> None:
    root, hf_dir = prepared
    lr = 1e-3 if weights == "full" else 1e-2
    records = run_dpo(root, hf_dir, tmp_path / "run", weights=weights, lr=lr)
    assert len(records) == 10
    first, last = records[0], records[-1]
    # LoRA/QLoRA start with B = 0 (the reference: the same NF4 base, adapters off); full DPO's reference is the
    # init: policy = reference at step 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    margins = [r["rewards/margin"] for r in records]
    assert sum(margins[-3:]) > sum(margins[:3]) + 1.0 and last["rewards/accuracy"] == 1.0, margins
    assert last["loss"] < 0.8 * math.log(2)
    assert last["rewards/margin"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], abs=1e-5)
    assert all(k in last for k in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"))


def test_ipo_loss_starts_at_its_target_gap(prepared: tuple[Path, Path], tmp_path: Path) -> None:
    root, hf_dir = prepared
    records = run_dpo(root, hf_dir, tmp_path / "run", loss="ipo", beta=0.5, max_steps=3)
    assert records[0]["loss"] == pytest.approx((1 / (2 * 0.5)) ** 2, abs=1e-6)  # Δ = 0: (0 − 1/(2β))²
    assert records[-1]["loss"] < records[0]["loss"]


def test_a_dpo_run_resumes_bit_for_bit(prepared: tuple[Path, Path], tmp_path: Path) -> None:
    from leantrain.ckpt.hook import TrainerCheckpointer
    from leantrain.train.trainer import Trainer

    root, hf_dir = prepared
    whole = run_dpo(root, hf_dir, tmp_path / "whole")
    stopped = Trainer(spec_from_dict(dpo_spec(root, hf_dir)), run_dir=tmp_path / "split",
                      checkpointer_factory=TrainerCheckpointer)
    try:  # five steps, then a save as at a preemption (the process stops there)
        for _ in range(5):
            stopped.train_step()
        assert stopped.checkpointer is not None
        stopped.checkpointer.maybe_save(stopped, force=True)
    finally:
        stopped.close()
    resumed = run_dpo(root, hf_dir, tmp_path / "split")  # resumes at the step-5 checkpoint
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    for ours, theirs in zip(whole[5:], resumed, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "grad_norm"):
            assert ours[key] == theirs[key], (ours["step"], key)


def test_bad_preference_input_exits_2_naming_the_line_and_field(prepared: tuple[Path, Path], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from leantrain.cli import main

    root, hf_dir = prepared
    raw = dpo_spec(tmp_path, hf_dir)
    write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a"}])
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    assert main(["prepare", str(tmp_path / "spec.yaml")]) == 2
    assert f"{tmp_path / 'prefs.jsonl'}:2: a preference record needs fields 'chosen' and 'rejected'" in \
        capsys.readouterr().err
    assert not (tmp_path / "data" / "manifest.json").exists()
    raw["data"]["sources"][0]["format"] = "chat"
    with pytest.raises(UserInputError, match=r"data.sources\[prefs\].format: chat, but finetune.method dpo"):
        spec_from_dict(raw)


@pytest.mark.slow
def test_loss_and_margins_equal_trls_dpo_trainer_over_ten_steps(tmp_path: Path) -> None:
    """TRL's DPOTrainer (peft LoRA on transformers' model, the same tiny checkpoint, pairs in the order our sampler
    reads them, beta, AdamW settings and LoRA init) against our trainer: per-step loss and reward margins in fp32."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    import re

    from datasets import Dataset

    from leantrain.cli import main
    from leantrain.model.hf import to_hf_name
    from leantrain.model.tiny_hf import save_tiny_hf
    from leantrain.train.trainer import Trainer

    hf_dir = save_tiny_hf(tmp_path / "hf", vocab_size=320, hidden_size=64, intermediate_size=128)
    records = preference_records()
    write_jsonl(tmp_path / "prefs.jsonl", records)
    raw = dpo_spec(tmp_path, hf_dir)
    raw["checkpoint"] = {"interval_steps": 1000}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    assert main(["prepare", str(tmp_path / "spec.yaml")]) == 0
    spec = spec_from_dict(raw)
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    # the pairs in the order our trainer reads them (one process: 2 pairs per step)
    sampler = PairBatchSampler(tmp_path / "data", seq_len=SEQ, micro_batch=4, dp_rank=0, dp_size=1,
                               seed=spec.training.seed)
    order = []
    for _ in range(10):
        batch = sampler.next_batch()
        for row in range(2):
            text = tokenizer.decode(batch.tokens[row].tolist(), skip_special_tokens=False)
            order.append(int(re.search(r"Say \d \((\d+)\)", text).group(1)))  # type: ignore[union-attr]
    ours = Trainer(spec, run_dir=tmp_path / "run")
    try:
        adapters = {name: p.detach().clone() for name, p in ours.model.named_parameters() if name.endswith("lora_a")}
        logged = [r for r in ours.train() if "loss" in r]
    finally:
        ours.close()

    class Recording(trl.DPOTrainer):  # type: ignore[misc]
        steps: list[tuple[float, float, float]] = []

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            metrics = self._metrics["train"]
            self.steps.append((float(loss.detach()), metrics["rewards/margins"][-1], metrics["rewards/chosen"][-1]))
            return loss

    conversation = lambda r: {  # noqa: E731
        "prompt": [{"role": "user", "content": r["prompt"]}], "chosen": [{"role": "assistant", "content": r["chosen"]}],
        "rejected": [{"role": "assistant", "content": r["rejected"]}]}
    dataset = Dataset.from_list([conversation(records[i]) for i in order])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, gradient_accumulation_steps=1,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, max_steps=10, beta=0.1, loss_type=["sigmoid"],
        logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
        train_sampling_strategy="sequential", dataloader_num_workers=0, seed=spec.training.seed)
    theirs = Recording(model=model, args=config, train_dataset=dataset,
                       processing_class=transformers.AutoTokenizer.from_pretrained(hf_dir), peft_config=lora)
    with torch.no_grad():  # the same adapter init (B is zero in both)
        params = dict(theirs.model.named_parameters())
        for name, value in adapters.items():
            module = to_hf_name(name.removesuffix(".lora_a") + ".weight").removesuffix(".weight")
            params[f"base_model.model.{module}.lora_A.default.weight"].copy_(value)
    theirs.train()
    assert len(theirs.steps) == 10 == len(logged)
    assert theirs.steps[0][0] == pytest.approx(math.log(2), abs=1e-6)
    for step, (record, (loss, margin, chosen)) in enumerate(zip(logged, theirs.steps, strict=True)):
        assert record["loss"] == pytest.approx(loss, abs=1e-5), step
        assert record["rewards/margin"] == pytest.approx(margin, abs=1e-5), step
        assert record["rewards/chosen"] == pytest.approx(chosen, abs=1e-5), step
    assert logged[-1]["rewards/margin"] > 0.5  # the comparison covers a run that moved far from the reference


@pytest.mark.slow
def test_dpo_under_fsdp_on_two_ranks_matches_one_process(prepared: tuple[Path, Path], tmp_path: Path) -> None:
    """LoRA DPO (adapters-off reference) and full DPO (a frozen, sharded reference copy) under FSDP2 on 2 gloo ranks:
    the same losses and rewards per step as one process taking both ranks' pairs as two micro-batches."""
    import subprocess
    import time

    from leantrain.launch import torchrun
    from leantrain.launch.resources import TrainCommand

    root, hf_dir = prepared
    single: dict[str, list[dict[str, Any]]] = {}
    procs = {}
    for weights in ("lora", "full"):
        lr = 1e-3 if weights == "full" else 1e-2
        single[weights] = run_dpo(root, hf_dir, tmp_path / f"single_{weights}", weights=weights, lr=lr,
                                  global_batch_tokens=8 * SEQ, max_steps=4)
        raw = dpo_spec(root, hf_dir, weights=weights)
        raw["training"].update(lr=lr, global_batch_tokens=8 * SEQ, max_steps=4)
        raw["parallelism"] = {"zero_stage": 3}
        raw["hardware"]["gpus_per_node"] = 2
        raw["run"] = {"dir": str(tmp_path / f"fsdp_{weights}")}
        spec_path = tmp_path / f"fsdp_{weights}.yaml"
        spec_path.write_text(yaml.safe_dump(raw))
        argv = torchrun.torchrun_argv(spec_from_dict(raw), train=TrainCommand(spec_path=spec_path),
                                      run_dir=tmp_path / f"fsdp_{weights}", nproc=2, max_restarts=0)
        procs[weights] = subprocess.Popen(argv, env=torchrun.torchrun_env() | {"OMP_NUM_THREADS": "1"},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    outputs = {k: p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for k, p in procs.items()}
    for weights, proc in procs.items():
        assert proc.returncode == 0, f"{weights}:\n{outputs[weights][-4000:]}"
        lines = (tmp_path / f"fsdp_{weights}" / "metrics.jsonl").read_text().splitlines()
        sharded = [json.loads(line) for line in lines if "loss" in json.loads(line)]
        assert len(sharded) == len(single[weights]) == 4
        assert sharded[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        for ours, theirs in zip(sharded, single[weights], strict=True):
            for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
                assert ours[key] == pytest.approx(theirs[key], abs=1e-5), (weights, ours["step"], key)
        assert sharded[-1]["rewards/margin"] > sharded[0]["rewards/margin"]


def test_the_plan_counts_the_reference_model() -> None:
    """LoRA DPO: the reference is the adapters-off base (no memory); full DPO: a frozen copy of the weights, sharded
    like the policy. Both add the reference forward (2 FLOPs per parameter per token) to the step."""
    from leantrain.plan.inputs import plan_inputs
    from leantrain.plan.layout import Layout
    from leantrain.plan.memory import memory_per_gpu

    def inputs(method: str, weights: str = "lora") -> Any:
        return plan_inputs(spec_from_dict({
            "task": "finetune", "finetune": {"method": method, "dpo": {"weights": weights}},
            "model": {"n_layers": 32, "d_model": 4096, "n_heads": 32, "vocab_size": 32000},
            "data": {"tokens_total": 1e8, "seq_len": 1024},
            "training": {"global_batch_tokens": 64 * 1024, "micro_batch": 2, "activation_checkpointing": "full"},
            "precision": {"compute": "bf16"}, "hardware": {"accelerator": "A100-80GB", "gpus_per_node": 8},
            "parallelism": {"data_parallel": 8, "zero_stage": 3}, "budget": {"target_days": None, "num_gpus": 8}}))

    layout = Layout(dp=8, tp=1, pp=1, zero=3, micro_batch=2, recompute="full")
    memory = {name: memory_per_gpu(i, layout, num_microbatches=4)
              for name, i in (("lora", inputs("lora")), ("dpo_lora", inputs("dpo")), ("full", inputs("full")),
                              ("dpo_full", inputs("dpo", "full")))}
    assert memory["dpo_lora"].to_dict() == memory["lora"].to_dict()
    # the copy: the policy's sharded weights once more (params also holds a small buffer that is not copied)
    assert memory["dpo_full"].params - memory["full"].params == pytest.approx(memory["full"].params, rel=1e-3)
    assert memory["dpo_full"].optimizer == memory["full"].optimizer and memory["dpo_full"].grads == memory["full"].grads
    full, dpo_full = inputs("full"), inputs("dpo", "full")
    recompute = layout.recompute
    assert dpo_full.hardware_flops_per_token(recompute) - full.hardware_flops_per_token(recompute) == pytest.approx(
        full.flops.matmul / 3)


def test_orpo_matches_trls_odds_ratio_loss_and_trains_without_a_reference(prepared: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """loss: orpo against TRL's ORPOTrainer.odds_ratio_loss (and its NLL, the chosen responses' token mean) on the
    same log-probabilities; a full-weights ORPO run holds no reference copy and its margins rise."""
    from leantrain.train.dpo import orpo_loss

    trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3.0, 7.0, 5.0, 4.0, 2.0, 6.0])  # rows: 3 chosen, then 3 rejected
    policy = -torch.rand(6, generator=generator) * counts * 2  # summed log-probabilities
    ours, chosen, rejected = orpo_loss(policy, counts, beta=0.25)

    class Stub:
        beta = 0.25
        accelerator = type("Accelerator", (), {"device": torch.device("cpu")})()

    mean_logps = policy / counts
    losses, their_chosen, their_rejected, _, _ = trl_orpo.ORPOTrainer.odds_ratio_loss(
        Stub(), mean_logps[:3], mean_logps[3:])
    nll = -policy[:3].sum() / counts[:3].sum()
    torch.testing.assert_close(ours.mean(), nll - losses.mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(chosen, their_chosen)
    torch.testing.assert_close(rejected, their_rejected)

    from leantrain.train.trainer import Trainer

    root, hf_dir = prepared
    raw = dpo_spec(root, hf_dir, weights="full", loss="orpo", beta=0.5)
    raw["training"].update(lr=1e-3, max_steps=8)
    trainer = Trainer(spec_from_dict(raw), run_dir=tmp_path / "run")
    try:
        assert trainer.objective is not None and trainer.objective.reference is None  # no frozen copy
        records = [r for r in trainer.train() if "loss" in r]
    finally:
        trainer.close()
    margins = [r["rewards/margin"] for r in records]
    # each step's margin is its own batch's: the last three steps' mean against the first (one batch is noisy)
    assert records[-1]["loss"] < records[0]["loss"] and sum(margins[-3:]) / 3 > margins[0] + 0.1, margins


@pytest.mark.parametrize("weights", ["lora", "full"])
def test_leantrain_eval_scores_held_out_pairs_as_the_trainer_does(tmp_path: Path, weights: str) -> None:
    from leantrain.cli import main
    from leantrain.golive.eval import evaluate
    from leantrain.model.tiny_hf import save_tiny_hf

    hf_dir = save_tiny_hf(tmp_path / "hf", vocab_size=320, hidden_size=64, intermediate_size=128)
    write_jsonl(tmp_path / "prefs.jsonl", preference_records(40))
    raw = dpo_spec(tmp_path, hf_dir, weights=weights)
    raw["data"]["valid_fraction"] = 0.3
    raw["training"].update(max_steps=4, eval_every=4, eval_batches=2, lr=1e-2 if weights == "lora" else 1e-3)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    assert main(["prepare", str(tmp_path / "spec.yaml")]) == 0
    assert main(["train", str(tmp_path / "spec.yaml")]) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(line) for line in lines if "eval_loss" in line]
    assert evals and not any("eval_perplexity" in r for r in evals)  # exp(a DPO loss) is no perplexity
    trained = evals[-1]["eval_loss"]
    held_out = evaluate(tmp_path / "run", tasks=[])["held_out"]["prefs"]
    assert held_out["loss"] == pytest.approx(trained, abs=1e-5) and held_out["pairs"] == 2 * 2
    assert held_out["loss"] < math.log(2) - 0.01 and 0 <= held_out["rewards/accuracy"] <= 1
    from leantrain.observe.report import render_html
    from leantrain.observe.report_data import load_run

    assert f"reward margin {held_out['rewards/margin']:.3f}" in render_html(load_run(tmp_path / "run"))
