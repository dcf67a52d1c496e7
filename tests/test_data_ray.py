"""prepare on Ray as a cluster: a start or connection that fails is one message with what to try (exit 2);
a two-node cluster on this machine (two `ray start`, token authentication as Ray 2.60 does it) gives the
byte-identical data dir of the local executor, also when the worker node is killed mid-prepare."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from leantrain.cli import main
from leantrain.data.executor import ray_start_error

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel import _contents, _write_corpus  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_ray_address_is_one_message_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    port = _free_port()  # closed again: nothing listens there
    code = main(["prepare", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(tmp_path / "d"),
                 "--set", "data.executor=ray", "--set", f"data.ray_address=127.0.0.1:{port}"])
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert code == 2, out
    assert f"data.ray_address 127.0.0.1:{port}: nothing answers there" in out
    for hint in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "ray status", "data.workers", "data.executor: local"):
        assert hint in out, hint
    assert "Traceback" not in out


def test_start_and_token_errors_say_what_to_try() -> None:
    timed_out = ray_start_error(None, Exception("The current node timed out during startup. This could happen "
                                                "because some of the Ray processes failed to startup.\nmore"))
    assert "could not start an embedded Ray" in str(timed_out) and "timed out during startup" in str(timed_out)
    assert "more" not in str(timed_out) and "data.workers" in str(timed_out)
    cause = RuntimeError("Authentication failed: InvalidAuthToken")
    refused = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
    refused.__cause__ = cause
    message = str(ray_start_error("10.0.0.1:6379", refused))
    assert "data.ray_address 10.0.0.1:6379 (token authentication)" in message and "RAY_AUTH_TOKEN" in message


class _Node:
    """One `ray start --block` in its own process group (stopped by killing that group: only what it started)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        self.proc = subprocess.Popen([ray, "start", "--block", "--num-cpus=1", "--disable-usage-stats", *args],
                                     env=env, start_new_session=True, stdout=open(log, "w"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _alive_nodes(address: str, env: dict[str, str]) -> int:
    code = f"import ray; ray.init(address={address!r}); print(sum(n['Alive'] for n in ray.nodes()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else 0


def _wait_for(address: str, env: dict[str, str], nodes: int) -> None:
    for _ in range(60):
        if _alive_nodes(address, env) == nodes:
            return
        time.sleep(2)
    raise AssertionError(f"the Ray cluster at {address} never had {nodes} nodes")


_PREPARE = """
import sys
from pathlib import Path
from leantrain.data.pipeline import prepare_data
from leantrain.spec.schema import DataSpec
prepare_data(DataSpec.model_validate_json(Path(sys.argv[1]).read_text()), data_dir=Path(sys.argv[2]))
"""


@pytest.mark.heavy
@pytest.mark.slow
def test_two_node_cluster_with_token_auth_and_a_node_killed_mid_prepare(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    monkeypatch.setenv("LEANTRAIN_PII_SALT", "salt")
    # 400 documents a file: a clean task takes ~0.2 s here, so the kill below lands while tasks are still
    # running even on a machine several times faster (60 documents took ~30 ms, and CI once saw all ten
    # tasks finish between two polls)
    spec = _write_corpus(tmp_path / "raw", files=8, docs_per_file=400)
    from leantrain.data.pipeline import prepare_data

    prepare_data(spec.model_copy(update={"workers": 1}), data_dir=tmp_path / "local")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "LEANTRAIN_PII_SALT": "salt", "OMP_NUM_THREADS": "1"}
    temp = tempfile.mkdtemp(prefix="ltray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    head = _Node(["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
                  "--node-ip-address=127.0.0.1"], env, tmp_path / "head.log")
    worker = None
    try:
        _wait_for(address, env, 1)
        worker = _Node([f"--address={address}", "--node-ip-address=127.0.0.1"], env, tmp_path / "worker.log")
        _wait_for(address, env, 2)
        # without the cluster's token the connection is refused, as one message
        wrong = subprocess.run([sys.executable, "-m", "leantrain.cli", "prepare",
                                str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(tmp_path / "wrong"),
                                "--set", "data.executor=ray", "--set", f"data.ray_address={address}"],
                               env={**env, "RAY_AUTH_TOKEN": "not-the-token"}, capture_output=True, text=True,
                               timeout=300)
        assert wrong.returncode == 2 and "RAY_AUTH_TOKEN" in wrong.stdout + wrong.stderr, wrong.stderr[-2000:]
        on_ray = spec.model_copy(update={"executor": "ray", "ray_address": address, "workers": None})
        (tmp_path / "spec.json").write_text(on_ray.model_dump_json())
        run = subprocess.run([sys.executable, "-c", _PREPARE, str(tmp_path / "spec.json"), str(tmp_path / "ray")],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert _contents(tmp_path / "ray") == _contents(tmp_path / "local")
        # the worker node dies once the first clean task is done: its tasks run again on the head node
        killed = subprocess.Popen([sys.executable, "-c", _PREPARE, str(tmp_path / "spec.json"),
                                   str(tmp_path / "killed")], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        tasks = tmp_path / "killed" / "_work" / "tasks"
        deadline = time.time() + 300
        while time.time() < deadline and killed.poll() is None and not any(tasks.glob("*/clean.json")):
            time.sleep(0.01)
        done_before = len(list(tasks.glob("*/clean.json")))
        worker.kill(signal.SIGKILL)
        _, err = killed.communicate(timeout=600)
        assert killed.returncode == 0, err[-3000:]
        assert 0 < done_before < 10, done_before  # the kill came mid-prepare (8 + 2 clean tasks)
        assert _contents(tmp_path / "killed") == _contents(tmp_path / "local")
    finally:
        for node in (worker, head):
            if node is not None:
                node.kill()
        pattern = f"127.0.0.1:{port}|{temp}"
        leftovers = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        for pid in leftovers:  # processes of these two nodes only (their command lines name the port or temp dir)
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["shards"]
