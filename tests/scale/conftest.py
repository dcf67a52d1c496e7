"""Rehearsals shared by the scale lane: each job is rehearsed once per test session (they take seconds to a
minute each), with layers cut to a few while widths, vocabulary, experts and world size stay real."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from pins import EXAMPLES


@functools.cache
def rehearsal(example: str, *, world: int | None = None, ranks: tuple[int, ...] | None = None,
              sets: tuple[str, ...] = ()) -> dict[str, Any]:
    from leantrain.golive.rehearse import rehearse
    from leantrain.spec import load_spec

    spec = load_spec(EXAMPLES / example, overrides=list(sets))
    return rehearse(spec, world_size=world, ranks=list(ranks) if ranks else None)


@pytest.fixture(scope="session")
def rehearse_job() -> Any:
    return rehearsal
