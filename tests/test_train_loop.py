"""The trainer on a tiny model and a tiny data dir built in the test (through the real sampler)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from leantrain.data.layout import write_token_data_dir
from leantrain.spec import JobSpec, spec_from_dict
from leantrain.train.trainer import TRAIN_INFO_FILE, Trainer, TrainingDiverged

VOCAB = 64
SEQ = 16
DESIGN_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s", "data_wait_s", "comm_s",
               "mem_bytes"}


def make_data(path: Path) -> Path:
    """Two sources: 'easy' counts up by 1 (learnable), 'noise' is uniform random (not learnable)."""
    rng = np.random.default_rng(0)
    easy = [[int((s + i) % (VOCAB - 1)) + 1 for i in range(40)] for s in rng.integers(0, VOCAB, 60)]
    noise = [[int(t) for t in rng.integers(1, VOCAB, 40)] for _ in range(60)]
    write_token_data_dir(path, {"easy": easy, "noise": noise}, vocab_size=VOCAB, eos_id=0,
                         valid_docs_by_source={"easy": easy[:5], "noise": noise[:5]})
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"))


def tiny_spec(data_dir: Path, *, moe: bool = False, **training: Any) -> JobSpec:
    model: dict[str, Any] = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64,
                             "vocab_size": VOCAB, "tie_embeddings": True}
    if moe:
        model |= {"architecture": "moe", "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16,
                                                 "balance": "aux_free"}}
    raw = {
        "model": model,
        "precision": {"compute": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(data_dir)},
        "training": {"global_batch_tokens": 4 * SEQ, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2,
                     "max_steps": 6, "device": "cpu", "log_every": 1, "deterministic": True, "eval_every": 0,
                     **training},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 1, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
    }
    return spec_from_dict(raw)


def test_accumulating_k_micro_batches_equals_one_big_batch(data_dir: Path, tmp_path: Path) -> None:
    big = Trainer(tiny_spec(data_dir, micro_batch=4), run_dir=tmp_path / "big")
    small = Trainer(tiny_spec(data_dir, micro_batch=1), run_dir=tmp_path / "small")
    assert (big.accum_steps, small.accum_steps) == (1, 4)
    big_step, small_step = big.train_step(), small.train_step()
    torch.testing.assert_close(small_step.loss, big_step.loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(big.model.named_parameters(), small.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def losses(records: list[dict[str, Any]]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def test_deterministic_reruns_are_bitwise_identical(data_dir: Path, tmp_path: Path) -> None:
    first = Trainer(tiny_spec(data_dir, moe=True), run_dir=tmp_path / "a").train()
    second = Trainer(tiny_spec(data_dir, moe=True), run_dir=tmp_path / "b").train()
    assert len(losses(first)) == 6 and losses(first) == losses(second)
    assert losses(first)[-1] < losses(first)[0]


def test_resume_from_state_dict_continues_bit_for_bit(data_dir: Path, tmp_path: Path) -> None:
    straight = losses(Trainer(tiny_spec(data_dir), run_dir=tmp_path / "a").train())
    interrupted = Trainer(tiny_spec(data_dir), run_dir=tmp_path / "b")
    interrupted.max_steps = 3  # stop half way, with the 6-step schedule (as a crash would)
    head = losses(interrupted.train())
    fresh = Trainer(tiny_spec(data_dir), run_dir=tmp_path / "c")
    fresh.load_state_dict(copy.deepcopy(interrupted.state_dict()))
    tail = losses(fresh.train())
    assert head + tail == straight
    assert fresh.tokens_seen == 6 * 4 * SEQ and fresh.sampler.global_sample_index == 6 * 4


def test_metrics_records_per_source_loss_eval_and_tensorboard(data_dir: Path, tmp_path: Path) -> None:
    spec = tiny_spec(data_dir, max_steps=20, log_every=5, eval_every=10)
    spec.monitoring.tensorboard = True
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    trainer.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in steps] == [5, 10, 15, 20] and [r["step"] for r in evals] == [10, 20]
    assert all(r.keys() >= DESIGN_KEYS for r in steps)
    assert all(r["mem_bytes"] > 0 and r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    last = steps[-1]["loss_by_source"]
    assert set(last) == {"easy", "noise"} and last["easy"] < last["noise"]  # the bad source shows up
    assert math.isclose(evals[-1]["eval_perplexity"], math.exp(evals[-1]["eval_loss"]), rel_tol=1e-9)
    held_out = evals[-1]["eval_loss_by_source"]  # each source's held-out loss, which the report plots over steps
    assert set(held_out) == {"easy", "noise"} and held_out["easy"] < held_out["noise"]
    assert min(held_out.values()) <= evals[-1]["eval_loss"] <= max(held_out.values())
    info = json.loads((tmp_path / "run" / TRAIN_INFO_FILE).read_text())
    assert info["num_params"] == info["planner_total_params"] and info["peak_flops"] == 1e11
    assert any((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_moe_metrics_report_expert_load(data_dir: Path, tmp_path: Path) -> None:
    records = Trainer(tiny_spec(data_dir, moe=True, max_steps=2), run_dir=tmp_path / "run").train()
    record = records[-1]
    assert len(record["moe_expert_load"]) == 2 and len(record["moe_expert_load"][0]) == 4
    assert math.isclose(sum(record["moe_expert_load"][0]), 1.0, rel_tol=1e-4)
    assert record["moe_load_max_over_min"] >= 1.0


def test_nonfinite_gradients_skip_the_optimizer_step(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_spec(data_dir), run_dir=tmp_path / "run")
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    adam_steps = [s["step"].clone() for s in trainer.optimizer.state.values()]
    hook = trainer.model.norm.weight.register_hook(lambda g: g * math.inf)
    result = trainer.train_step()
    hook.remove()
    assert result.skipped and math.isfinite(float(result.loss)) and not math.isfinite(float(result.grad_norm))
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert [s["step"] for s in trainer.optimizer.state.values()] == adam_steps
    assert trainer.skipped_steps == 1 and not trainer.train_step().skipped  # training goes on


def test_nonfinite_loss_stops_when_asked(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_spec(data_dir, on_nonfinite="stop"), run_dir=tmp_path / "run")
    with torch.no_grad():
        trainer.model.tok_embeddings.weight.fill_(math.nan)
    with pytest.raises(TrainingDiverged, match="non-finite"):
        trainer.train_step()


class RecordingCheckpointer:
    """A stand-in for the checkpoint manager: records the calls, asks to stop after step 2."""

    def __init__(self, trainer: Trainer) -> None:
        self.calls: list[tuple[str, int, bool]] = []

    def load_latest(self, trainer: Trainer) -> bool:
        self.calls.append(("load", trainer.step, False))
        return False

    def maybe_save(self, trainer: Trainer, *, force: bool = False) -> None:
        self.calls.append(("save", trainer.step, force))

    @property
    def preempt_requested(self) -> bool:
        return len(self.calls) == 3

    def close(self) -> None:
        self.calls.append(("close", -1, False))


def test_checkpointer_hook_is_called_every_step_and_can_stop_the_loop(data_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_spec(data_dir), run_dir=tmp_path / "run", checkpointer_factory=RecordingCheckpointer)
    trainer.train()
    trainer.close()
    calls = trainer.checkpointer.calls  # type: ignore[union-attr]
    assert calls == [("load", 0, False), ("save", 1, False), ("save", 2, False), ("close", -1, False)]
    assert trainer.step == 2  # the preemption request ended the loop before max_steps (6)


def test_eval_time_is_reported_apart_and_kept_out_of_the_step_time(data_dir: Path, tmp_path: Path) -> None:
    spec = tiny_spec(data_dir, max_steps=6, log_every=3, eval_every=2, eval_batches=8)
    records = Trainer(spec, run_dir=tmp_path / "run").train()
    evals = [r for r in records if "eval_loss" in r]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6] and all(r["eval_s"] > 0 for r in evals)
    # The evaluations at steps 2 and 4 fall inside the windows logged at steps 3 and 6: reported, not counted.
    assert steps[0]["eval_s"] == pytest.approx(evals[0]["eval_s"])
    assert steps[1]["eval_s"] == pytest.approx(evals[1]["eval_s"])
    for record in steps:
        training_s = record["step_time_s"] * record["steps_timed"]
        assert training_s + record["eval_s"] + record["ckpt_save_s"] + record["profile_step_s"] == pytest.approx(
            record["window_s"], rel=1e-9)
        assert record["tokens_per_s"] == pytest.approx(spec.training.global_batch_tokens / record["step_time_s"])


def test_max_steps_zero_records_model_ready_and_trains_nothing(data_dir: Path, tmp_path: Path) -> None:
    spec = tiny_spec(data_dir)
    trainer = Trainer(spec, run_dir=tmp_path / "run", max_steps=0)
    assert trainer.train() == [] and trainer.step == 0
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    ready = [e for e in events if e["kind"] == "model_ready"]
    assert len(ready) == 1
    (rank,) = ready[0]["ranks"]
    assert rank["rank"] == 0 and rank["param_bytes_local"] == ready[0]["param_bytes_total"]
    assert ready[0]["param_bytes_total"] == 4 * sum(p.numel() for p in trainer.model.parameters())
    assert rank["host_rss_peak_bytes"] >= rank["host_rss_base_bytes"] > 0 and rank["device_mem_peak_bytes"] > 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()
