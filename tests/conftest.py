"""Test-wide settings: keep every run registry the tests create out of the user's home."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_run_registry(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEANTRAIN_REGISTRY", str(tmp_path_factory.getbasetemp() / "runs.db"))
