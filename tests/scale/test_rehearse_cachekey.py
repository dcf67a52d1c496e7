"""The rehearsal's fake-tensor cache keys (golive/rehearse_cachekey.py) are torch's own, element for element: on
every key of rehearsed jobs (FSDP × TP × PP, fp8, MoE with expert parallelism), and the swap is refused when the
samples show a difference."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
from pins import EXAMPLES

from leantrain.golive import rehearse_cachekey

DENSE = ("parallelism.data_parallel=2", "parallelism.tensor_parallel=2", "parallelism.pipeline_parallel=2",
         "parallelism.zero_stage=3", "hardware.num_nodes=4", "training.global_batch_tokens=4096",
         "hardware.accelerator=H100-SXM", "precision.compute=fp8", "model.tie_embeddings=false")
MOE = ("parallelism.data_parallel=4", "parallelism.expert_parallel=4", "parallelism.zero_stage=3",
       "hardware.num_nodes=4", "training.global_batch_tokens=8192", "hardware.accelerator=H100-SXM",
       "precision.compute=bf16")


def _outcome(prep: Any, mode: Any, args: Any, state: Any) -> tuple[list[object], str | None]:
    from torch._subclasses.fake_tensor import _BypassDispatchCache

    out: list[object] = []
    try:
        prep(mode, out, args, state, [])
    except _BypassDispatchCache as bypass:
        return out, f"bypass: {bypass.reason}"
    return out, None


def _crosscheck(example: str, sets: tuple[str, ...]) -> tuple[int, list[str]]:
    """Rehearse `example` with both key builders run on every key: (keys compared, the first differences)."""
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    built = rehearse_cachekey._fast_prep
    checked: list[int] = []
    differ: list[str] = []

    def crosschecked(layouts: Any) -> Any:
        fast = built(layouts)

        def prep(mode: Any, result: list[object], args: Any, state: Any, ids: list[object]) -> None:
            theirs, their_bypass = _outcome(rehearse_cachekey._TORCH_PREP, mode, args, state)
            ours, our_bypass = _outcome(fast, mode, args, state)
            checked.append(1)
            # a bypassed key is thrown away (torch dispatches without the cache), so only the reason must agree
            same = our_bypass == their_bypass if (our_bypass or their_bypass) else (
                (ours, [type(v) for v in ours]) == (theirs, [type(v) for v in theirs]))
            if not same:
                differ.append(f"{args!r:.200}: ours {ours!r:.300} ({our_bypass}), torch {theirs!r:.300} "
                              f"({their_bypass})")
            rehearse_cachekey._TORCH_PREP(mode, result, args, state, ids)

        return prep

    rehearse_cachekey._fast_prep = crosschecked  # this process is the test's own (below)
    rehearse(load_spec(EXAMPLES / example, overrides=list(sets)), ranks=[0], isolated=False)
    return len(checked), differ[:3]


@pytest.mark.parametrize(("example", "sets"), [("tiny-cpu.yaml", DENSE), ("moe-small-cpu.yaml", MOE)],
                         ids=["fsdp-tp-pp-fp8", "moe-ep"])
def test_every_key_of_a_rehearsal_is_torchs_own(example: str, sets: tuple[str, ...]) -> None:
    """Each key the rehearsal builds is built by both and compared (with the bypass torch raises, if any);
    torch's is the one used, so a difference cannot hide behind a cache that still works. In a process of its
    own: an in-process rehearsal of this TP × PP job leaves torch state behind (DTensor redistribute planners
    holding its fake world's meshes) on which a later in-process rehearsal in the same worker fails."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        checked, differ = pool.apply(_crosscheck, (example, sets))
    assert checked > 1000  # the swap was in place for the whole rehearsal
    assert not differ, differ


def test_the_swap_is_refused_when_the_samples_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """A builder that leaves out one field (requires_grad) fails the samples, and torch's builder stays."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    built = rehearse_cachekey._fast_prep

    def forgetful(layouts: Any) -> Any:
        fast = built(layouts)

        def prep(mode: Any, result: list[object], args: Any, state: Any, ids: list[object]) -> None:
            fast(mode, result, args, state, ids)
            result[:] = [v for v in result if v is not True]  # the grad tensor's requires_grad, and any True

        return prep

    with rehearse_cachekey.fast_cache_keys() as swapped:
        assert swapped and FakeTensorMode._prep_args_for_hash is not rehearse_cachekey._TORCH_PREP
    assert FakeTensorMode._prep_args_for_hash is rehearse_cachekey._TORCH_PREP
    monkeypatch.setattr(rehearse_cachekey, "_fast_prep", forgetful)
    with rehearse_cachekey.fast_cache_keys() as swapped:
        assert not swapped and FakeTensorMode._prep_args_for_hash is rehearse_cachekey._TORCH_PREP
