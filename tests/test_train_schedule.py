"""LR schedules: warm-up, cosine, WSD and constant, as pure functions of the step."""

from __future__ import annotations

import math

import pytest
import torch

from leantrain.spec.schema import TrainingSpec
from leantrain.train.schedule import build_scheduler, lr_factor


def factor(step: int, schedule: str) -> float:
    return lr_factor(step, warmup_steps=10, max_steps=110, schedule=schedule, min_lr_ratio=0.1, decay_fraction=0.2)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_and_reaches_the_peak(schedule: str) -> None:
    assert [factor(s, schedule) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(10, schedule) == pytest.approx(1.0)


def test_cosine_halfway_and_end() -> None:
    assert factor(60, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)
    assert factor(110, "cosine") == pytest.approx(0.1)
    assert factor(500, "cosine") == pytest.approx(0.1)  # past the end it stays at the floor


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction() -> None:
    assert factor(87, "wsd") == 1.0  # decay starts at 110 - 22 = 88
    assert factor(99, "wsd") == pytest.approx(1 - 0.9 * 11 / 22)
    assert factor(110, "wsd") == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scheduler = build_scheduler(optimizer, TrainingSpec(lr=0.5, warmup_steps=2, max_steps=4), max_steps=4)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected_cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 1 / 2))
    assert seen == pytest.approx([0.25, 0.5, 0.5, 0.5 * expected_cos])
