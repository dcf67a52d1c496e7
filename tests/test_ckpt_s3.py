"""Checkpoints on an S3-compatible store: a real S3 server (moto's server mode) on loopback, reached through s3fs."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from leantrain.ckpt import CheckpointManager, CheckpointSaveError
from leantrain.ckpt.storage import FsspecStore, open_store
from leantrain.errors import UserInputError
from leantrain.spec.schema import SecuritySpec
from s3_server import moto_s3_with_test_credentials
from test_ckpt_manager import assert_same, events, make_app, make_spec, resume, snapshot, train

moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server")
pytest.importorskip("s3fs")


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An S3 HTTP server on 127.0.0.1 (any free port) with credentials only in the environment."""
    with moto_s3_with_test_credentials(monkeypatch) as endpoint:
        yield endpoint


def s3_spec(endpoint: str) -> object:
    return make_spec(checkpoint={
        "storage": "object_store", "url": "s3://ckpt-bucket/runs/demo", "endpoint_url": endpoint,
        "access_key": "${LT_TEST_S3_KEY}", "secret_key": "${LT_TEST_S3_SECRET}", "keep_last": 2,
    })


@pytest.mark.parametrize("encrypted", [False, True])
def test_s3_round_trip_retention_and_half_written_fallback(
    tmp_path: Path, s3_endpoint: str, encrypted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = s3_spec(s3_endpoint)
    if encrypted:  # set after loading: see test_ckpt_crypto.encrypted_spec
        monkeypatch.setenv("LT_TEST_CKPT_KEY", "ab" * 32)
        spec.security = SecuritySpec(encrypt_checkpoints=True, encryption_key="${LT_TEST_CKPT_KEY}")
    store = open_store(spec, run_dir=tmp_path)
    assert isinstance(store, FsspecStore)
    store.fs.mkdir("ckpt-bucket")
    run_dir = tmp_path / "run"
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=run_dir)
    states = {}
    for step in (2, 4, 6):
        train(app, 2)
        ckpt.save(step, app, blocking=step != 6)
        states[step] = snapshot(app)
    ckpt.close()
    listing = store.list_dir("")
    assert listing == ["step-00000004", "step-00000006"]  # keep_last=2 on the object store too
    assert {"COMMIT", "manifest.json", ".metadata"} <= set(store.list_dir("step-00000006"))
    assert store.read_bytes("step-00000006/.metadata").startswith(b"LTENC1") == encrypted

    fresh = make_app(seed=7)
    assert resume(spec, run_dir, fresh) == 6
    assert_same(snapshot(fresh), states[6])

    store.remove_file("step-00000006/COMMIT")  # as if the writer died before publishing
    fresh = make_app(seed=8)
    assert resume(spec, run_dir, fresh) == 4
    assert_same(snapshot(fresh), states[4])
    assert any(e["event"] == "checkpoint_invalid" and e["step"] == 6 for e in events(run_dir))


def test_s3_credentials_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = s3_spec("http://127.0.0.1:9")
    monkeypatch.delenv("LT_TEST_S3_KEY", raising=False)
    with pytest.raises(UserInputError, match="LT_TEST_S3_KEY"):
        open_store(spec, run_dir=tmp_path)


@pytest.mark.parametrize("cut", ["before_commit", "mid_write"])
def test_endpoint_cut_mid_save_fails_cleanly_and_keeps_the_last_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """The S3 server goes away during a save: one clean CheckpointSaveError naming the url and the operation
    (no botocore traceback), a checkpoint_failed event and alert after the bounded retries, the last good
    checkpoint untouched; once the endpoint is back the next save works and the run resumes from it."""
    monkeypatch.setenv("LT_TEST_S3_KEY", "testing-key")
    monkeypatch.setenv("LT_TEST_S3_SECRET", "testing-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10).close()
    spec = s3_spec(endpoint)
    spec.checkpoint.save_retries, spec.checkpoint.retry_backoff_s = 1, 0.0
    # Few botocore retries, short timeouts: a dead endpoint fails in seconds (production keeps s3fs's defaults).
    options = {"endpoint_url": endpoint, "key": "testing-key", "secret": "testing-secret",
               "config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}}

    class CuttableStore(FsspecStore):
        armed = False

        def open_write(self, rel: str) -> Any:
            if self.armed and cut == "mid_write" and rel.endswith(".distcp"):
                server.stop()
            return super().open_write(rel)

    store = CuttableStore(spec.checkpoint.url, storage_options=options)
    store.fs.mkdir("ckpt-bucket")
    run_dir = tmp_path / "run"
    alerts: list[dict] = []
    ckpt = CheckpointManager(spec, run_dir=run_dir, store=store, on_alert=lambda _n, rec: alerts.append(rec))
    app = make_app()
    try:
        train(app, 2)
        ckpt.save(2, app, blocking=True)
        good = snapshot(app)
        before = {name: store.read_bytes(f"step-00000002/{name}") for name in store.list_dir("step-00000002")}
        train(app, 2)
        store.armed = True
        if cut == "before_commit":
            ckpt.before_commit = lambda _step: server.stop()
        with pytest.raises(CheckpointSaveError) as raised:
            ckpt.save(4, app, blocking=True)
        message = str(raised.value)
        assert "s3://ckpt-bucket/runs/demo/step-00000004" in message
        # The retry found the endpoint still gone at its first step (listing the store to prepare).
        assert "failed (prepare): preparing s3://ckpt-bucket/runs/demo/step-00000004: EndpointConnectionError" \
            in message
        assert "\n" not in message and "Traceback" not in message
        failed = [e for e in events(run_dir) if e["event"] == "checkpoint_failed"]
        assert len(failed) == 1 and failed[0]["attempts"] == 2 and "Traceback" not in failed[0]["error"]
        retries = [e for e in events(run_dir) if e["event"] == "checkpoint_retry"]
        assert [e["operation"] for e in retries] == ["commit" if cut == "before_commit" else "write"]
        assert "EndpointConnectionError" in retries[0]["error"] and "\n" not in retries[0]["error"]
        assert [a["event"] for a in alerts if a["event"] == "checkpoint_failed"] == ["checkpoint_failed"]

        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # the endpoint is back (moto keeps its buckets in process memory)
        ckpt.before_commit = None
        store.armed = False
        assert {name: store.read_bytes(f"step-00000002/{name}") for name in store.list_dir("step-00000002")} \
            == before  # the last good checkpoint was never touched
        fresh = make_app(seed=5)
        assert CheckpointManager(spec, run_dir=run_dir, store=store).load_latest(fresh) == 2
        assert_same(snapshot(fresh), good)
        ckpt.save(6, app, blocking=True)  # the next interval saves again
        assert CheckpointManager(spec, run_dir=run_dir, store=store).load_latest(make_app(seed=6)) == 6
    finally:
        ckpt.close()
        server.stop()


def test_resume_from_an_s3_location_that_cannot_be_listed_is_exit_2_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--resume s3://...` without credentials: the location the user named cannot be listed; one line, exit 2
    (the user's input), naming the URL and the cause. (This run's own store failing to list stays exit 1.)"""
    from leantrain.ckpt import CheckpointLoadError
    from leantrain.ckpt.resume import source_location

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup: nothing leaves the host
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    spec = make_spec()
    source, step = source_location(spec, "s3://ckpt-bucket/other-run/step-00000002")
    assert step == 2
    ckpt = CheckpointManager(spec, run_dir=tmp_path / "run")
    try:
        with pytest.raises(CheckpointLoadError) as raised:
            ckpt.load_latest(make_app(), step=step, source=source)
    finally:
        ckpt.close()
    message = str(raised.value)
    assert raised.value.exit_code == 2
    assert message.startswith("--resume s3://ckpt-bucket/other-run: cannot list the checkpoints there: "
                              "NoCredentialsError")
    assert "AWS_ACCESS_KEY_ID" in message and "\n" not in message and "Traceback" not in message


def test_resume_from_s3_uses_the_specs_endpoint_and_the_bounded_client_whatever_the_runs_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--resume s3://...` from a run whose own checkpoints are local got an S3 client with no options: none of
    the timeouts and retry limits (a dead endpoint hung for minutes in botocore's retries), and the spec's
    checkpoint.endpoint_url and keys ignored."""
    from leantrain.ckpt.resume import source_location
    from leantrain.ckpt.storage import S3_CONNECT_TIMEOUT_S
    from leantrain.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml", overrides=[
        "checkpoint.endpoint_url=http://127.0.0.1:9", "checkpoint.access_key=${LT_TEST_KEY}",
        "checkpoint.secret_key=${LT_TEST_SECRET}"])
    monkeypatch.setenv("LT_TEST_KEY", "k")
    monkeypatch.setenv("LT_TEST_SECRET", "s")
    assert spec.checkpoint.storage == "local"
    store, step = source_location(spec, "s3://bucket/other-run/step-00000040")
    options = store.fs.storage_options
    assert (store.url.rstrip("/"), step) == ("s3://bucket/other-run", 40)
    assert options["endpoint_url"] == "http://127.0.0.1:9" and (options["key"], options["secret"]) == ("k", "s")
    assert options["config_kwargs"]["connect_timeout"] == S3_CONNECT_TIMEOUT_S


def test_a_checkpoints_sizes_on_s3_come_from_one_listing_not_a_request_per_file(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """export/eval check every file of the manifest before reading: a checkpoint has a file per writing rank, and
    a HEAD request each (16,384 at 16,384 ranks) took minutes on S3. The sizes come from listing the folder; a
    file cut short or missing is still named."""
    from leantrain.ckpt import integrity as integ

    spec = s3_spec(s3_endpoint)
    store = open_store(spec, run_dir=tmp_path)
    store.fs.mkdir("ckpt-bucket")
    app = make_app()
    ckpt = CheckpointManager(spec, run_dir=tmp_path / "run")
    train(app, 2)
    ckpt.save(2, app, blocking=True)
    ckpt.close()
    folder = "step-00000002"
    manifest = integ.read_manifest(store, folder)
    assert len(manifest["files"]) >= 3
    per_file: list[str] = []
    for name in ("size", "info", "exists", "head_object"):
        if hasattr(store.fs, name):
            real = getattr(store.fs, name)
            monkeypatch.setattr(store.fs, name, lambda path, *a, _real=real, **k: (per_file.append(path),
                                                                                   _real(path, *a, **k))[1])
    integ.check_sizes(store, folder, manifest)
    assert per_file == []
    shard = sorted(n for n in manifest["files"] if n.endswith(".distcp"))[0]
    store.write_bytes(f"{folder}/{shard}", store.read_bytes(f"{folder}/{shard}")[:100])
    with pytest.raises(integ.IntegrityError, match=f"{folder}/{shard}: 100 bytes, manifest says"):
        integ.check_sizes(store, folder, manifest)
    store.remove_file(f"{folder}/{shard}")
    with pytest.raises(integ.IntegrityError, match=f"{folder}/{shard}: missing"):
        integ.check_sizes(store, folder, manifest)
