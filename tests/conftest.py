"""Test-wide settings: keep every run registry the tests create out of the user's home, and name a failing
test the moment it fails (a long run otherwise names it only in the summary at the end)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_run_registry(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEANTRAIN_REGISTRY", str(tmp_path_factory.getbasetemp() / "runs.db"))



_terminal_reporter = None


@pytest.hookimpl(trylast=True)  # after the terminal reporter has registered
def pytest_configure(config: pytest.Config) -> None:
    global _terminal_reporter
    _terminal_reporter = config.pluginmanager.get_plugin("terminalreporter")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """`FAILED nodeid: first line of the error` as soon as a test fails, between the progress lines."""
    if not report.failed or hasattr(report, "wasxfail") or _terminal_reporter is None:
        return
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    why = f": {crash.message.splitlines()[0][:200]}" if crash is not None and crash.message else ""
    phase = "" if report.when == "call" else f" (in {report.when})"
    _terminal_reporter.write_line(f"\nFAILED {report.nodeid}{phase}{why}", red=True)
