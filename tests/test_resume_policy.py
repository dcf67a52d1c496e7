"""checkpoint.interval_steps: auto starts from the planner's Young/Daly interval and re-tunes from measured saves."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.ckpt.manager import CheckpointManager
from leantrain.ckpt.policy import young_daly_interval_s
from leantrain.demo_context import DEMO_SPEC
from leantrain.plan.budget import checkpoint_interval
from leantrain.plan.inputs import plan_inputs
from leantrain.spec import load_spec


@pytest.mark.parametrize("async_save", [False, True])
def test_auto_interval_starts_at_the_planners_young_daly_and_retunes(tmp_path: Path, async_save: bool) -> None:
    spec = load_spec(DEMO_SPEC, overrides=["checkpoint.interval_steps=auto", f"checkpoint.async_save={async_save}",
                                           "fault.failures_per_gpu_day=100", "security.audit_log=false"])
    planned = checkpoint_interval(spec, plan_inputs(spec), num_gpus=4, step_s=1.0)
    now = [0.0]
    ckpt = CheckpointManager(spec, run_dir=tmp_path, world_size=4, clock=lambda: now[0])
    try:
        assert ckpt.auto is not None
        # δ is what a save blocks: the whole write, or for async saves only the device-to-host copy.
        assert ckpt.auto.save_s == pytest.approx(planned["blocking_s"])
        assert ckpt.auto.interval_s == pytest.approx(planned["recommended_interval_s"])
        ckpt.auto.observe(stall_s=2.0, write_s=3.0)  # what the first real save measured
        assert ckpt.auto.interval_s == pytest.approx(young_daly_interval_s(save_s=2.0, mtbf_s=planned["mtbf_s"]))
    finally:
        ckpt.close()
