"""Masked (chat) loss normalised by the step's global count of valid tokens: the same per-step loss whatever the
micro-batch size and the data-parallel layout (1 process with micro_batch 1 = 1 with micro_batch 8 = 2 ranks
with micro_batch 4), where a per-micro-batch mean would weigh a token by how many answer tokens share its row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from leantrain.data.chat import write_chat_data_dir
from leantrain.spec import spec_from_dict
from leantrain.train.trainer import Trainer
from parallel_harness import torchrun_train

VOCAB, SEQ, STEPS = 64, 16, 4


class CountingChat:
    """Conversations → (ids, mask): a prompt of counting tokens, then an answer whose length varies a lot from
    one conversation to the next (1 to 14 tokens), so rows hold very different numbers of loss targets."""

    eos_id = 0

    def encode(self, conversation: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        start, answer = int(conversation[0]["content"]), int(conversation[1]["content"])
        prompt = [(start + i) % (VOCAB - 2) + 1 for i in range(3)]
        reply = [(start + 3 + i) % (VOCAB - 2) + 1 for i in range(answer)]
        ids = np.array([*prompt, *reply, self.eos_id], dtype=np.int64)
        mask = np.array([0] * len(prompt) + [1] * (answer + 1), dtype=np.uint8)
        return ids, mask


def chat_dir(path: Path) -> Path:
    rng = np.random.default_rng(0)
    conversations = [[{"role": "user", "content": str(int(s))}, {"role": "assistant", "content": str(int(n))}]
                     for s, n in zip(rng.integers(0, 60, 48), rng.integers(1, 12, 48), strict=True)]
    write_chat_data_dir(path, {"chat": conversations}, renderer=CountingChat(), vocab_size=VOCAB, seq_len=SEQ)
    return path


def job(data_dir: Path, *, micro_batch: int, **parallelism: Any) -> dict[str, Any]:
    return {
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64,
                  "vocab_size": VOCAB, "tie_embeddings": False},
        "parallelism": parallelism,
        "precision": {"compute": "fp32", "optimizer_state": "fp32"},
        "data": {"tokens_total": 1e5, "seq_len": SEQ, "dir": str(data_dir)},
        "training": {"global_batch_tokens": 8 * SEQ, "micro_batch": micro_batch, "lr": 3e-3, "warmup_steps": 1,
                     "max_steps": STEPS, "device": "cpu", "log_every": 1, "deterministic": True, "eval_every": 0},
        "checkpoint": {"interval_steps": 1000},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "num_nodes": 1, "peak_flops": 1e11},
        "budget": {"num_gpus": 1, "target_days": None},
        "monitoring": {"tensorboard": False},
    }


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"grad_norm"' in line]


def train_one_process(data_dir: Path, run_dir: Path, *, micro_batch: int) -> list[float]:
    trainer = Trainer(spec_from_dict(job(data_dir, micro_batch=micro_batch)), run_dir=run_dir)
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses(run_dir)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_dir(tmp_path_factory.mktemp("chat"))


def test_rows_hold_different_numbers_of_targets(data_dir: Path) -> None:
    from leantrain.data.sampler import PackedBatchSampler

    sampler = PackedBatchSampler(data_dir, seq_len=SEQ, micro_batch=8, dp_rank=0, dp_size=1, seed=0)
    batch = sampler.next_batch()
    assert batch.loss_mask is not None
    per_row = batch.loss_mask[:, 1:].sum(dim=1).tolist()
    assert max(per_row) >= 2 * max(1, min(per_row)), per_row  # a per-row mean would weigh tokens unevenly


def test_micro_batch_size_does_not_change_the_loss(data_dir: Path, tmp_path: Path) -> None:
    one = train_one_process(data_dir, tmp_path / "mb1", micro_batch=1)
    eight = train_one_process(data_dir, tmp_path / "mb8", micro_batch=8)
    assert len(one) == STEPS
    assert one == pytest.approx(eight, rel=1e-5, abs=1e-6)
    assert one[-1] < one[0]


@pytest.mark.slow
def test_two_ranks_with_micro_batch_4_match_one_process_with_micro_batch_1(data_dir: Path, tmp_path: Path) -> None:
    reference = train_one_process(data_dir, tmp_path / "mb1", micro_batch=1)
    raw = job(data_dir, micro_batch=4, data_parallel=2)
    torchrun_train(raw, tmp_path / "fsdp")
    assert losses(tmp_path / "fsdp") == pytest.approx(reference, rel=1e-5, abs=1e-6)
