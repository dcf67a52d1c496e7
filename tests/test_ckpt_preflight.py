"""Storage preflight at start (bucket, list, write+read+delete a probe) and checkpoint.save_timeout_s: a broken
store is one line naming url, operation and cause, exit 2, before anything trains; retries stop in time."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from leantrain.ckpt import CheckpointManager, CheckpointSaveError
from leantrain.ckpt.preflight import preflight_storage, probe_store
from leantrain.ckpt.storage import FsspecStore, LocalStore, open_store
from leantrain.errors import UserInputError
from s3_server import moto_s3_with_test_credentials
from test_ckpt_manager import FailingStore, events, make_app, make_spec, train

pytest.importorskip("s3fs")
pytest.importorskip("moto.moto_server.threaded_moto_server")


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_s3_with_test_credentials(monkeypatch) as endpoint:
        yield endpoint


def s3_spec(endpoint: str, bucket: str = "ckpt-bucket") -> object:
    return make_spec(checkpoint={"storage": "object_store", "url": f"s3://{bucket}/runs/demo", "endpoint_url": endpoint,
                                 "access_key": "${LT_TEST_S3_KEY}", "secret_key": "${LT_TEST_S3_SECRET}"})


def test_a_local_store_passes_and_the_probe_is_gone(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ckpts")
    assert probe_store(store) >= 0
    assert list((tmp_path / "ckpts").iterdir()) == []


def test_a_missing_bucket_is_found_at_start_naming_url_operation_and_cause(tmp_path: Path, s3_env: str) -> None:
    spec = s3_spec(s3_env)
    with pytest.raises(UserInputError) as refused:
        preflight_storage(spec, run_dir=tmp_path)
    message = str(refused.value)
    assert "checkpoint store s3://ckpt-bucket/runs/demo: bucket exists failed" in message
    assert "bucket 'ckpt-bucket' does not exist" in message and "\n" not in message
    store = open_store(spec, run_dir=tmp_path)
    assert isinstance(store, FsspecStore)
    store.fs.mkdir("ckpt-bucket")
    assert preflight_storage(spec, run_dir=tmp_path) >= 0
    assert store.list_dir("") == []  # the probe object was deleted


def test_a_dead_endpoint_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LT_TEST_S3_KEY", "k")
    monkeypatch.setenv("LT_TEST_S3_SECRET", "s")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(UserInputError) as refused:
        preflight_storage(s3_spec(f"http://127.0.0.1:{port}"), run_dir=tmp_path)
    message = str(refused.value)  # the connection error, not a missing bucket (s3fs's exists() would say False)
    assert "checkpoint store s3://ckpt-bucket/runs/demo: bucket exists" in message
    assert "does not exist" not in message and ("EndpointConnectionError" in message or "did not answer" in message)


def test_a_hanging_store_is_cut_off_at_the_deadline(tmp_path: Path) -> None:
    release = threading.Event()

    class Hanging(LocalStore):
        def write_bytes(self, rel: str, data: bytes) -> None:
            release.wait(30)

    try:
        with pytest.raises(UserInputError, match=r"write did not answer within 1 s"):
            probe_store(Hanging(tmp_path / "ckpts"), timeout_s=1.0)
    finally:
        release.set()


def test_train_refuses_a_missing_bucket_before_it_writes_anything(
    tmp_path: Path, s3_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from leantrain.cli import main

    examples = Path(__file__).resolve().parents[1] / "examples"
    run_dir = tmp_path / "run"
    code = main(["train", str(examples / "tiny-cpu.yaml"), "--run-dir", str(run_dir), "--set",
                 "checkpoint.storage=object_store", "--set", "checkpoint.url=s3://nope/run", "--set",
                 f"checkpoint.endpoint_url={s3_env}", "--set", "checkpoint.access_key=${LT_TEST_S3_KEY}",
                 "--set", "checkpoint.secret_key=${LT_TEST_S3_SECRET}", "--set", f"data.dir={tmp_path / 'data'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "s3://nope/run: bucket exists failed" in err and "Traceback" not in err
    assert not run_dir.exists()


def test_save_timeout_bounds_the_retries_of_one_save(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    spec = make_spec(checkpoint={"save_retries": 5, "retry_backoff_s": 0.2, "save_timeout_s": 0.1})
    store = FailingStore(run_dir / "checkpoints", budget_bytes=10)
    store.armed = True
    ckpt = CheckpointManager(spec, run_dir=run_dir, store=store)
    app = make_app()
    train(app, 2)
    with pytest.raises(CheckpointSaveError, match="No space left"):
        ckpt.save(2, app, blocking=True)
    ckpt.close()
    failed = [e for e in events(run_dir) if e["event"] == "checkpoint_failed"]
    assert failed[0]["attempts"] == 1 and failed[0]["save_timeout_s"] == 0.1  # no retry would end in time
    assert not [e for e in events(run_dir) if e["event"] == "checkpoint_retry"]


def test_wrong_credentials_are_one_line(tmp_path: Path, s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys from now on
    monkeypatch.setenv("LT_TEST_S3_KEY", "not-a-known-key")
    with pytest.raises(UserInputError, match=r"s3://ckpt-bucket/runs/demo: bucket exists failed: PermissionError"):
        preflight_storage(s3_spec(s3_env), run_dir=tmp_path)


def data_url_spec(endpoint: str, url: str = "s3://data-bucket/prepared") -> object:
    return make_spec(cluster={"data_url": url, "data_endpoint_url": endpoint})


@pytest.fixture
def data_env(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The data store reads its credentials from the environment, as the staging copy does (s3fs)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    return s3_env


def test_the_data_store_is_probed_read_only_naming_url_operation_and_cause(tmp_path: Path, data_env: str) -> None:
    from leantrain.ckpt.preflight import data_store

    spec = data_url_spec(data_env)
    assert preflight_storage(spec, run_dir=tmp_path) >= 0  # only the checkpoint store unless asked
    with pytest.raises(UserInputError) as refused:
        preflight_storage(spec, run_dir=tmp_path, data=True)
    message = str(refused.value)
    assert message.startswith("data store s3://data-bucket/prepared (cluster.data_url): bucket exists failed")
    assert "bucket 'data-bucket' does not exist (create it, or fix cluster.data_url)" in message
    store = data_store("s3://data-bucket/prepared", endpoint_url=data_env)
    store.fs.mkdir("data-bucket")
    with pytest.raises(UserInputError, match=r"\(cluster.data_url\): read manifest.json failed: FileNotFoundError: "
                                             r"no manifest.json there"):
        preflight_storage(spec, run_dir=tmp_path, data=True)
    store.write_bytes("manifest.json", b"{}")
    assert preflight_storage(spec, run_dir=tmp_path, data=True) >= 0
    assert store.list_dir("") == ["manifest.json"]  # nothing written to the data store


def test_a_dead_data_endpoint_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from leantrain.ckpt.preflight import probe_data_store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(UserInputError) as refused:
        probe_data_store("s3://data-bucket/prepared", endpoint_url=f"http://127.0.0.1:{port}")
    message = str(refused.value)
    assert message.startswith("data store s3://data-bucket/prepared (cluster.data_url): bucket exists")
    assert "\n" not in message and ("EndpointConnectionError" in message or "did not answer" in message)


def test_launch_and_the_staging_step_refuse_a_missing_data_bucket(
    tmp_path: Path, data_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from leantrain.cli import main
    from leantrain.launch import staging

    examples = Path(__file__).resolve().parents[1] / "examples"
    sets = ["--set", "cluster.data_url=s3://nope/data", "--set", f"cluster.data_endpoint_url={data_env}",
            "--set", f"data.dir={tmp_path / 'data'}"]
    for mode in (["--preflight"], ["--nproc", "2"]):
        code = main(["launch", str(examples / "tiny-cpu.yaml"), "--run-dir", str(tmp_path / "run"), *sets, *mode])
        assert code == 2
        err = capsys.readouterr().err
        assert "data store s3://nope/data (cluster.data_url): bucket exists failed" in err and "Traceback" not in err
    assert not (tmp_path / "data").exists()  # nothing was staged
    assert staging.main(["s3://nope/data", str(tmp_path / "staged"), "--endpoint-url", data_env]) == 2
    out = capsys.readouterr().out
    assert "staging failed: data store s3://nope/data (cluster.data_url): bucket exists failed" in out
