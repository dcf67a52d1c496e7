"""Multi-process checkpoints on gloo: FSDP2-sharded save at 2 ranks (sync, async, preemption agreement),
then load at 1 and at 4 ranks (DCP resharding) with bit-identical model and optimizer state."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

SPAWN_TIMEOUT_S = 120.0


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    return {"model": model_sd, "optimizer": optim_sd}


def _app(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    from leantrain.ckpt import RankRNGState

    model = _model(seed)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": optimizer, "trainer": {"step": 0},
            "sampler": {"global_sample_index": 0}, "rng": RankRNGState(rank)}


def _train(app: dict[str, Any], num_steps: int) -> None:
    for _ in range(num_steps):
        loss = app["model"](torch.randn(4, 8)).square().mean()
        loss.backward()
        app["optimizer"].step()
        app["optimizer"].zero_grad()
        app["trainer"]["step"] += 1
        app["sampler"]["global_sample_index"] += 8


def _worker(rank: int, world_size: int, phase: str, root: str) -> None:
    from leantrain.ckpt import CheckpointManager
    from test_ckpt_manager import make_spec

    out = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv-{phase}", rank=rank, world_size=world_size)
    torch.manual_seed(100 + rank)  # per-rank data and dropout streams, as in data-parallel training
    # Agreement on every step (the default is every 50): the request below is agreed at step 3.
    spec = make_spec(checkpoint={"interval_steps": 2, "keep_last": 5}, fault={"preempt_check_every": 1})
    ckpt = CheckpointManager(spec, run_dir=out / "run", rank=rank, world_size=world_size)
    if phase == "save":
        app = _app(rank, world_size, seed=0)
        _train(app, 2)
        assert ckpt.should_save(2)
        ckpt.save(2, app, blocking=True)
        # Only rank 0 looks for Slurm's checkpoint.request: should_save makes every rank agree on it.
        assert ckpt.should_save(3, requested=rank == 0) and ckpt.save_requested
        assert not ckpt.should_save(3) and not ckpt.save_requested  # no file seen: no request
        _train(app, 2)
        torch.save(torch.get_rng_state(), out / f"rng-{rank}.pt")
        full = _full_state(app["model"], app["optimizer"])
        ckpt.save(4, app, blocking=False)  # thread async save on the manager's own gloo group
        if rank == 0:
            torch.save({**full, "trainer": dict(app["trainer"]), "sampler": dict(app["sampler"])}, out / "expected.pt")
        _train(app, 1)  # training goes on while the save is written
        if rank == 1:
            ckpt.preemption.request("test")  # only rank 1 is told; should_save makes every rank agree
        assert ckpt.should_save(5) and ckpt.preempt_requested
        ckpt.save(5, app)
        ckpt.close()
    else:
        app = _app(rank, world_size, seed=1)
        assert ckpt.load_latest(app) == 4  # step 5 was un-published by the test
        full = _full_state(app["model"], app["optimizer"])
        if rank == 0:
            torch.save({**full, "trainer": dict(app["trainer"]), "sampler": dict(app["sampler"])},
                       out / f"loaded-{world_size}.pt")
        torch.save(torch.get_rng_state(), out / f"rng-loaded-{world_size}-{rank}.pt")
        ckpt.close()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: a gloo process sometimes aborts there (docs/parallel.md)


def _spawn(world_size: int, phase: str, root: Path) -> None:
    """Start fresh worker processes from a fork server that imported torch and this module once.

    Like spawn, children never inherit pytest's threads; unlike spawn, six children do not each pay
    torch's import (about 20 s on a loaded two-core machine, against 2 s here).
    """
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "leantrain.ckpt", __name__])
    context = mp.start_processes(_worker, args=(world_size, phase, str(root)), nprocs=world_size, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{phase} at {world_size} ranks did not finish within {SPAWN_TIMEOUT_S} s")


def _assert_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.slow
def test_two_rank_save_reshards_to_one_and_four_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.ckpt import CheckpointManager
    from test_ckpt_manager import events, make_spec

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _spawn(2, "save", tmp_path)
    expected = torch.load(tmp_path / "expected.pt", weights_only=False)
    kinds = [e["event"] for e in events(tmp_path / "run")]
    assert kinds.count("checkpoint_saved") == 3 and kinds.count("preemption_requested") == 1
    saved = [e for e in events(tmp_path / "run") if e["event"] == "checkpoint_saved"]
    assert [e["async"] for e in saved] == [False, True, False]

    # One process, no process group: the sharded checkpoint loads into a plain module.
    spec = make_spec(checkpoint={"interval_steps": 2})
    ckpt = CheckpointManager(spec, run_dir=tmp_path / "run")
    app = _app(0, 1, seed=1)
    assert ckpt.load_latest(app) == 5 and app["trainer"]["step"] == 5  # the preemption save
    ckpt.store.remove_file("step-00000005/COMMIT")  # check step 4: its state was recorded exactly
    assert ckpt.load_latest(app) == 4
    ckpt.close()
    _assert_equal({**_full_state(app["model"], app["optimizer"]), "trainer": app["trainer"],
                   "sampler": app["sampler"]}, expected)
    assert torch.equal(torch.get_rng_state(), torch.load(tmp_path / "rng-0.pt"))

    _spawn(4, "load", tmp_path)
    _assert_equal(torch.load(tmp_path / "loaded-4.pt", weights_only=False), expected)
    for rank in (0, 1):  # ranks that existed at save time get their own generator back
        assert torch.equal(torch.load(tmp_path / f"rng-loaded-4-{rank}.pt"), torch.load(tmp_path / f"rng-{rank}.pt"))
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "step-00000002" / "COMMIT")


def _hook_attempts(root: str) -> list[int]:
    """Each rank's restart attempt as the trainer's hook sees it, rank 1 with torchrun's count 1, rank 0 with 0."""
    from types import SimpleNamespace

    from leantrain.ckpt.hook import TrainerCheckpointer
    from test_ckpt_hook import make_trainer
    from test_ckpt_manager import make_spec

    rank = dist.get_rank()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    trainer = make_trainer(make_spec(checkpoint={"interval_steps": 2}), Path(root) / "run")
    trainer.runtime = SimpleNamespace(rank=rank, world_size=2)
    hook = TrainerCheckpointer(trainer)
    try:
        seen = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(seen, torch.tensor([hook.attempt], dtype=torch.int64))
        return [int(t.item()) for t in seen]
    finally:
        hook.close()


@pytest.mark.slow
def test_the_ranks_agree_on_the_restart_attempt(tmp_path: Path) -> None:
    """torchrun counts a restart only on the agent whose workers failed (a membership change is no restart), so
    the ranks of two nodes can see different counts: every rank takes the highest (rank 0 records the restart)."""
    import functools

    from parallel_harness import spawn_gloo

    assert spawn_gloo(functools.partial(_hook_attempts, str(tmp_path)), world_size=2, out_dir=tmp_path) == [1, 1]


def _command_attempts() -> list[int]:
    """`leantrain train`'s job attempt on each rank, rank 1 with torchrun's count 1, rank 0 with 0."""
    from leantrain.train.command import job_attempt
    from test_ckpt_manager import make_spec

    rank = dist.get_rank()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    os.environ["WORLD_SIZE"] = "2"
    seen = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(seen, torch.tensor([job_attempt(make_spec()).number], dtype=torch.int64))
    return [int(t.item()) for t in seen]


@pytest.mark.slow
def test_train_agrees_on_the_attempt_before_the_lease_and_first_start_check(tmp_path: Path) -> None:
    """The count train/command.py gives the lease's takeover rule and the first-start check is the highest of any
    rank, not rank 0's own (torchrun counts a restart only on the failing node)."""
    from parallel_harness import spawn_gloo

    assert spawn_gloo(_command_attempts, world_size=2, out_dir=tmp_path) == [1, 1]
