"""Fault campaigns against the fault-tolerance layer, rerunnable: tiny models, CPU, gloo, run dirs under a temp dir.

    .venv/bin/python bench/fault_campaign.py [--only NAME ...] [--quick] [--seed N]

Campaigns (NAME): kills (random SIGKILLs at random steps and ranks of a 2-rank gloo job under torchrun, each
resumed by torchrun and compared bit for bit with an uninterrupted 2-rank run), damage (kinds of checkpoint
damage, then a resume: the newest good checkpoint or a one-line exit 2, never a traceback, nothing good
deleted), s3 (storage preflight against a moto S3 server: missing bucket, wrong credentials, dead endpoint,
slowed server: exit-2 error in < 30 s naming url, operation and cause), signals (SIGTERM/SIGINT in the middle of
an async save: exit 143/130, a resume matches the uninterrupted run), specs (mutated example specs through
`leantrain check`: exit 0 or 2, never a traceback; YAML bombs in < 2 s), canaries (a fake credential in the
environment and the spec must not show up in output, events, run-dir files or emitted job files), lease (two
`leantrain train` into one run dir: the second exits 2 naming the holder).

Each check prints one line (PASS/FAIL, campaign, name, detail); each campaign a total; the last line the grand
total. Exit 1 if any check failed. The frozen-rank-with-defaults case is covered by the heavy test
tests/test_launch_local.py (two emulated hosts), not here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' tiny job and S3 server helpers
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
RESULTS: dict[str, list[bool]] = {}
KIND_FILTER: list[str] = []  # --kind: the damage kinds to run (default: all)


def report(campaign: str, name: str, ok: bool, detail: str = "") -> None:
    RESULTS.setdefault(campaign, []).append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {campaign:9s} {name}: {detail}"[:400], flush=True)


def cli(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "leantrain.cli", *args], env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)


def torchrun(args: list[str], *, env: dict[str, str] | None = None, restarts: int = 1) -> subprocess.CompletedProcess:
    """torchrun with the environment `leantrain launch` gives it (launch.resources.TORCHRUN_ENV): without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted workers can read the previous round's gloo addresses from
    torch's shared rendezvous store and time out connecting (seen here: 2 of the first 3 kills)."""
    from leantrain.launch.resources import TORCHRUN_ENV

    return subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", str(restarts), "-m", "leantrain.cli", *args],
                          env={**(env or ENV), **TORCHRUN_ENV},
                          capture_output=True, text=True, timeout=900)


def losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]  # a redone step: its last value
    return out


def job_spec(tmp: Path, *, async_save: bool = False) -> Path:
    from test_resume_exact import write_resume_spec

    return write_resume_spec(tmp, async_save=async_save)


def traceback_in(proc: subprocess.CompletedProcess) -> bool:
    return "Traceback" in proc.stdout or "Traceback" in proc.stderr


# ---- 1. random SIGKILLs ---------------------------------------------------------------------------------------
def kills(tmp: Path, rng: random.Random, quick: bool) -> None:
    from leantrain.ckpt.fault import ENV_DURING_SAVE, ENV_KILL_AT_STEP, ENV_KILL_RANK

    spec = job_spec(tmp, async_save=True)
    ref_dir = tmp / "reference"
    ref = torchrun(["train", str(spec), "--run-dir", str(ref_dir)])
    if ref.returncode != 0:
        report("kills", "reference", False, ref.stderr[-300:])
        return
    reference = losses(ref_dir)
    for i in range(3 if quick else 19):
        step, rank, during = rng.randint(1, 5), rng.randint(0, 1), rng.random() < 0.5
        run_dir = tmp / f"kill-{i}"
        env = {**ENV, ENV_KILL_AT_STEP: str(step), ENV_KILL_RANK: str(rank), ENV_DURING_SAVE: "1" if during else "0"}
        proc = torchrun(["train", str(spec), "--run-dir", str(run_dir)], env=env)
        got = losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
        fired = (run_dir / "fault-injected.json").exists()
        ok = proc.returncode == 0 and fired and got == reference
        report("kills", f"kill step {step} rank {rank}{' mid-save' if during else ''}", ok,
               f"rc {proc.returncode}, fired {fired}, bit for bit {got == reference}")


# ---- 2. checkpoint damage -------------------------------------------------------------------------------------
def _ckpts(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _newest(run_dir: Path) -> Path:
    return sorted(p for p in _ckpts(run_dir).iterdir() if p.name.startswith("step-"))[-1]


def _a_shard(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[0]


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 2)])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _manifest(folder: Path) -> Path:
    names = [p for p in folder.iterdir() if p.name.startswith("manifest") or p.name == "MANIFEST.json"]
    return names[0] if names else folder / "manifest.json"


def damage_kinds(other_run: Path) -> dict[str, Callable[[Path], None]]:
    def newest(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        return lambda run: fn(_newest(run))

    def all_steps(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        return lambda run: [fn(p) for p in sorted(_ckpts(run).glob("step-*"))]

    def rename(run: Path) -> None:
        n = _newest(run)
        n.rename(n.with_name("step-00000099"))

    def symlink(run: Path) -> None:
        n = _newest(run)
        (n.parent / "step-00000098").symlink_to(n.name)

    def swap_names(run: Path) -> None:
        a, b = sorted(_ckpts(run).glob("step-*"))[-2:]
        a.rename(a.with_name("x")), b.rename(a), (a.with_name("x")).rename(b)

    def other_model(run: Path) -> None:
        src = _newest(other_run)
        shutil.copytree(src, _ckpts(run) / "step-00000097")

    def as_file(run: Path) -> None:
        shutil.rmtree(_ckpts(run))
        _ckpts(run).write_text("not a folder")

    def unreadable(run: Path) -> None:
        _newest(run).chmod(0)

    return {
        "truncated shard": newest(lambda f: _truncate(_a_shard(f))),
        "flipped shard byte": newest(lambda f: _flip(_a_shard(f))),
        "empty shard": newest(lambda f: _a_shard(f).write_bytes(b"")),
        "missing shard": newest(lambda f: _a_shard(f).unlink()),
        "missing manifest": newest(lambda f: _manifest(f).unlink()),
        "garbled manifest": newest(lambda f: _manifest(f).write_text("{not json")),
        "manifest not an object": newest(lambda f: _manifest(f).write_text("[1, 2]")),
        "flipped manifest byte": newest(lambda f: _flip(_manifest(f))),
        "missing commit marker": newest(lambda f: (f / "COMMIT").unlink()),
        "garbled commit marker": newest(lambda f: (f / "COMMIT").write_text("\x00garbage")),
        "missing .metadata": newest(lambda f: (f / ".metadata").unlink()),
        "truncated .metadata": newest(lambda f: _truncate(f / ".metadata")),
        "extra junk file": newest(lambda f: (f / "junk.bin").write_bytes(os.urandom(64))),
        "renamed step folder": rename,
        "symlinked step folder": symlink,
        "two step folders swapped": swap_names,
        "another model's checkpoint beside": other_model,
        "checkpoints path is a file": as_file,
        "empty step folder": lambda run: (_ckpts(run) / "step-00000096").mkdir(),
        "half-written .tmp folder": lambda run: shutil.copytree(_newest(run), _ckpts(run) / ".tmp-step-00000095"),
        "step folder unreadable": unreadable,
        "every step's shard truncated": all_steps(lambda f: _truncate(_a_shard(f))),
        "every commit marker missing": all_steps(lambda f: (f / "COMMIT").unlink()),
        "stray file named step-N": lambda run: (_ckpts(run) / "step-00000094").write_text("x"),
        "lineage.json garbled": lambda run: (run / "lineage.json").write_text("{"),
    }


def damage(tmp: Path, rng: random.Random, quick: bool) -> None:
    """Each kind on a copy of one killed run; `--kind WORDS` keeps the kinds whose name holds WORDS."""
    spec = job_spec(tmp)
    base = tmp / "base"
    from leantrain.ckpt.fault import ENV_KILL_AT_STEP

    # The base run is SIGKILLed after step 5 (checkpoints at steps 2 and 4): every resume below trains on.
    made = cli(["train", str(spec), "--run-dir", str(base)], env={**ENV, ENV_KILL_AT_STEP: "5"})
    made.returncode = 0 if made.returncode == -signal.SIGKILL else made.returncode or 1
    other_spec = tmp / "other.yaml"
    raw = yaml.safe_load(spec.read_text())
    raw["model"]["d_model"] = raw["model"]["d_model"] * 2
    other_spec.write_text(yaml.safe_dump(raw))
    other = tmp / "other"
    made_other = cli(["train", str(other_spec), "--run-dir", str(other)])
    if made.returncode or made_other.returncode:
        report("damage", "setup", False, (made.stderr + made_other.stderr)[-300:])
        return
    kinds = list(damage_kinds(other).items())
    if quick:
        kinds = kinds[:: 4]
    if KIND_FILTER:
        kinds = [(name, hurt) for name, hurt in kinds if any(word in name for word in KIND_FILTER)]
    for name, hurt in kinds:
        run = tmp / ("d-" + name.replace(" ", "_").replace("'", ""))
        shutil.copytree(base, run, symlinks=True)
        (run / "fault-injected.json").unlink(missing_ok=True)  # the base's drill marker: the copy just resumes
        good_before = {p.name for p in _ckpts(run).glob("step-*")}
        try:
            hurt(run)
        except OSError as err:
            report("damage", name, False, f"could not plant: {err}")
            continue
        proc = cli(["train", str(spec), "--run-dir", str(run)])
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        one_line = proc.returncode != 2 or len(lines) <= 3
        with_folder = _ckpts(run).is_dir()
        if with_folder:
            (_ckpts(run)).chmod(0o755)
            for p in _ckpts(run).iterdir():
                if not p.is_symlink():
                    p.chmod(0o755)
        kept = {p.name for p in _ckpts(run).glob("step-*")} if with_folder else set()
        lost = {n for n in good_before - kept if n not in name}  # a folder the damage itself moved is not lost
        if name == "checkpoints path is a file":
            lost = set()  # the damage itself replaced the folder by a file: nothing the resume could keep
        if name == "renamed step folder":
            lost.discard(sorted(good_before)[-1])
        ok = proc.returncode in (0, 2) and not traceback_in(proc) and one_line and not lost
        reached = max(losses(run)) if (run / "metrics.jsonl").exists() else "?"
        detail = f"rc {proc.returncode}; " + (lines[-1][:160] if lines and proc.returncode else
                                              f"resumed to step {reached}")
        why = [w for w, bad in (("traceback", traceback_in(proc)), (f"{len(lines)} stderr lines", not one_line),
                                (f"exit {proc.returncode}", proc.returncode not in (0, 2))) if bad]
        report("damage", name, ok, (f"[{', '.join(why)}] " if why else "") + detail
               + (f"; LOST {sorted(lost)}" if lost else ""))
        if not ok:
            print("    " + "\n    ".join(lines[-12:]), flush=True)


# ---- 3. S3 faults ---------------------------------------------------------------------------------------------
def s3(tmp: Path, rng: random.Random, quick: bool) -> None:
    from leantrain.ckpt.preflight import preflight_storage
    from leantrain.errors import LeantrainError
    from s3_server import moto_s3
    from test_ckpt_manager import make_spec

    os.environ.update({"LT_CAMPAIGN_KEY": "testing-key", "LT_CAMPAIGN_SECRET": "testing-secret",
                       "AWS_DEFAULT_REGION": "us-east-1"})

    def spec(endpoint: str, bucket: str = "ckpt", key: str = "${LT_CAMPAIGN_KEY}") -> Any:
        return make_spec(checkpoint={"storage": "object_store", "url": f"s3://{bucket}/runs/x",
                                     "endpoint_url": endpoint, "access_key": key,
                                     "secret_key": "${LT_CAMPAIGN_SECRET}"})

    def expect_refusal(name: str, the_spec: Any, *words: str) -> None:
        start = time.monotonic()
        try:
            preflight_storage(the_spec, run_dir=tmp / "s3run")
            report("s3", name, False, "preflight passed")
            return
        except LeantrainError as err:
            took = time.monotonic() - start
            msg = str(err)
            ok = err.exit_code == 2 and took < 30 and "\n" not in msg and all(w in msg for w in words)
            report("s3", name, ok, f"exit {err.exit_code} in {took:.1f} s: {msg[:200]}")
        except Exception as err:  # noqa: BLE001 - a raw exception is the failure this campaign looks for
            report("s3", name, False, f"raw {type(err).__name__}: {err}")

    with moto_s3() as endpoint:
        import boto3

        expect_refusal("missing bucket", spec(endpoint), "s3://ckpt/runs/x", "does not exist")
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s").create_bucket(
            Bucket="ckpt")
        try:
            preflight_storage(spec(endpoint), run_dir=tmp / "s3run")
            report("s3", "healthy bucket passes", True, "probe written, read, deleted")
        except Exception as err:  # noqa: BLE001
            report("s3", "healthy bucket passes", False, str(err)[:200])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    expect_refusal("dead endpoint", spec(dead), dead.split("//")[1].split(":")[0], "s3://ckpt/runs/x")
    # A server that accepts connections and never answers (slowed to a stop).
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.5)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        expect_refusal("slowed server (accepts, never answers)", spec(f"http://127.0.0.1:{server.getsockname()[1]}"),
                       "s3://ckpt/runs/x")
    finally:
        stop.set()
        thread.join()
        server.close()
        for conn in held:
            conn.close()
    # Wrong credentials need a server that checks them; moto accepts any key until its authentication is on
    # (moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0, read per request by the server threads of this process;
    # the environment variable of the same name is read once, at moto's import, so setting it here is too late).
    import moto.settings

    with moto_s3() as endpoint:
        os.environ["LT_CAMPAIGN_BADKEY"] = "wrong-key"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing-key",
                     aws_secret_access_key="testing-secret").create_bucket(Bucket="ckpt")
        saved = moto.settings.INITIAL_NO_AUTH_ACTION_COUNT
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        try:
            expect_refusal("wrong credentials", spec(endpoint, key="${LT_CAMPAIGN_BADKEY}"), "s3://ckpt/runs/x")
        finally:
            moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = saved


# ---- 4. SIGTERM / SIGINT mid-save -----------------------------------------------------------------------------
def signals(tmp: Path, rng: random.Random, quick: bool) -> None:
    spec = job_spec(tmp, async_save=True)
    ref_dir = tmp / "reference"
    if cli(["train", str(spec), "--run-dir", str(ref_dir)]).returncode:
        report("signals", "reference", False, "reference run failed")
        return
    reference = losses(ref_dir)
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)) * (1 if quick else 2):
        run_dir = tmp / f"sig-{sig.name}-{rng.randint(0, 10**6)}"
        proc = subprocess.Popen([PY, "-m", "leantrain.cli", "train", str(spec), "--run-dir", str(run_dir)],
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        ckpts = run_dir / "checkpoints"
        while time.monotonic() < deadline and proc.poll() is None:  # the first save has started
            # a save's folder, not the storage preflight's probe file (written before the signal handlers)
            if ckpts.is_dir() and any("step-" in p.name for p in ckpts.iterdir()):
                break
            time.sleep(0.005)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
        resumed = cli(["train", str(spec), "--run-dir", str(run_dir)])
        same = resumed.returncode == 0 and losses(run_dir) == reference
        ok = proc.returncode in (code, 0) and "Traceback" not in err and same
        report("signals", f"{sig.name} at the first save", ok,
               f"exit {proc.returncode}; resumed rc {resumed.returncode}, bit for bit {same}; "
               f"{(err.strip().splitlines() or [''])[-1][:150]}")


# ---- 5. mutated specs -----------------------------------------------------------------------------------------
BOMBS = {
    "nested 50,000 deep list": "model: " + "[" * 50000 + "]" * 50000 + "\n",
    "nested 5,000 deep mapping": "model: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
    "self-referencing alias": "model: &s [*s]\n",
    "billion laughs": "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "model: *i\n",
}


def _mutations(raw: dict[str, Any], rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    leaves: list[tuple[list[str], Any]] = []

    def walk(node: Any, path: list[str]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, [*path, str(key)])
        else:
            leaves.append((path, node))

    walk(raw, [])
    out = []
    for path, value in leaves:
        for kind in ("wrong type", "out of range", "unknown key", "null"):
            new = json.loads(json.dumps(raw))
            parent = new
            for part in path[:-1]:
                parent = parent[part]
            if kind == "wrong type":
                parent[path[-1]] = {"nested": [1, 2]} if not isinstance(value, dict) else "text"
            elif kind == "out of range":
                parent[path[-1]] = (-10**18 if isinstance(value, (int, float)) and not isinstance(value, bool)
                                    else "x" * 10000)
            elif kind == "unknown key":
                parent[path[-1] + "_typo"] = value
            else:
                parent[path[-1]] = None
            out.append((f"{'.'.join(path)}: {kind}", new))
    rng.shuffle(out)
    return out


def specs(tmp: Path, rng: random.Random, quick: bool) -> None:
    from leantrain.cli import main

    def check(path: Path) -> tuple[int | str, float]:
        start = time.monotonic()
        try:
            code = main(["check", str(path)])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as err:  # noqa: BLE001 - a traceback is what this campaign looks for
            code = f"raised {type(err).__name__}: {str(err)[:100]}"
        return code, time.monotonic() - start

    examples = ["tiny-cpu.yaml", "moe-small-cpu.yaml", "finetune-lora-cpu.yaml", "llama3-8b-h100.yaml",
                "seed-10b.yaml"]
    cases: list[tuple[str, dict[str, Any]]] = []
    for name in examples:
        raw = yaml.safe_load((ROOT / "examples" / name).read_text())
        cases += [(f"{name} {label}", mutated) for label, mutated in _mutations(raw, rng)[: 6 if quick else 30]]
    for i, (label, mutated) in enumerate(cases):
        path = tmp / f"m{i}.yaml"
        path.write_text(yaml.safe_dump(mutated))
        (tmp / "examples").exists() or shutil.copytree(ROOT / "examples", tmp / "examples")
        shutil.copy(path, tmp / "examples" / path.name)  # relative paths resolve as beside the example
        code, took = check(tmp / "examples" / path.name)
        report("specs", label, code in (0, 2), f"exit {code} in {took:.2f} s")
    for label, text in BOMBS.items():
        path = tmp / "bomb.yaml"
        path.write_text(text)
        code, took = check(path)
        report("specs", f"bomb: {label}", code == 2 and took < 2, f"exit {code} in {took:.2f} s")


# ---- 6. secret canaries ---------------------------------------------------------------------------------------
def canaries(tmp: Path, rng: random.Random, quick: bool) -> None:
    env_canary, spec_canary = "CANARYENV" + os.urandom(6).hex(), "CANARYSPEC" + os.urandom(6).hex()
    spec = job_spec(tmp)
    raw = yaml.safe_load(spec.read_text())
    raw.setdefault("checkpoint", {})["secret_key"] = "${LT_CANARY_SECRET}"
    spec.write_text(yaml.safe_dump(raw))
    env = {**ENV, "LT_CANARY_SECRET": spec_canary, "AWS_SECRET_ACCESS_KEY": env_canary,
           "HF_TOKEN": env_canary, "WANDB_API_KEY": env_canary}
    run_dir = tmp / "run"
    runs = {
        "train": cli(["train", str(spec), "--run-dir", str(run_dir), "--max-steps", "2"], env=env),
        "check": cli(["check", str(spec)], env=env),
        "launch --emit slurm": cli(["launch", str(spec), "--emit", "slurm", "--out", str(tmp / "job.sbatch"),
                                    "--run-dir", str(tmp / "emit-run")], env=env),
        "launch --emit k8s": cli(["launch", str(spec), "--emit", "k8s", "--out", str(tmp / "job-k8s.yaml"),
                                  "--run-dir", str(tmp / "emit-run")], env=env),
        "validate": cli(["validate", str(run_dir)], env=env),
    }
    for name, proc in runs.items():
        text = proc.stdout + proc.stderr
        leaks = [c for c in (env_canary, spec_canary) if c in text]
        report("canaries", f"{name} output", not leaks and not traceback_in(proc), f"rc {proc.returncode}, "
               f"{len(leaks)} leaks; {(proc.stderr.strip().splitlines() or [''])[-1][:120]}")
    files = [p for p in tmp.rglob("*") if p.is_file() and p.name != spec.name]
    leaked = [str(p.relative_to(tmp)) for p in files
              if env_canary.encode() in p.read_bytes() or spec_canary.encode() in p.read_bytes()]
    report("canaries", f"{len(files)} files written (run dir, events, emitted jobs)", not leaked,
           f"{len(leaked)} leaks {leaked[:5]}")


# ---- 7. one run per run dir -----------------------------------------------------------------------------------
def lease(tmp: Path, rng: random.Random, quick: bool) -> None:
    spec = job_spec(tmp)
    raw = yaml.safe_load(spec.read_text())
    raw["training"]["max_steps"] = 100000
    raw["checkpoint"]["interval_steps"] = 100000
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp / "run"
    first = subprocess.Popen([PY, "-m", "leantrain.cli", "train", str(spec), "--run-dir", str(run_dir)], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        for command in ("train", "launch"):
            extra = ["--nproc", "1"] if command == "launch" else []
            second = cli([command, str(spec), "--run-dir", str(run_dir), *extra])
            ok = second.returncode == 2 and f"pid {first.pid}" in second.stderr and not traceback_in(second)
            report("lease", f"second {command} into a running run dir", ok,
                   f"exit {second.returncode}: {second.stderr.strip()[-200:]}")
        before = len((run_dir / "metrics.jsonl").read_text().splitlines())
        report("lease", "the first keeps running", first.poll() is None, f"{before} metrics records")
    finally:
        first.kill()
        first.wait()
    after_kill = cli(["train", str(spec), "--run-dir", str(run_dir), "--max-steps", "1"])
    report("lease", "a SIGKILLed holder's lease is taken over", "is in use by" not in after_kill.stderr,
           f"exit {after_kill.returncode}")


CAMPAIGNS = {"kills": kills, "damage": damage, "s3": s3, "signals": signals, "specs": specs,
             "canaries": canaries, "lease": lease}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=list(CAMPAIGNS))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (the totals say how many ran)")
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--kind", action="append", default=[], help="damage: only the kinds whose name holds this")
    args = parser.parse_args()
    KIND_FILTER.extend(args.kind)
    rng = random.Random(args.seed)
    for name in args.only or list(CAMPAIGNS):
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"campaign-{name}-") as tmp:
            try:
                CAMPAIGNS[name](Path(tmp), rng, args.quick)
            except Exception as err:  # noqa: BLE001 - a campaign that breaks is one failed check, not the end
                report(name, "campaign", False, f"{type(err).__name__}: {err}")
        results = RESULTS.get(name, [])
        print(f"TOTAL {name}: {sum(results)}/{len(results)} passed, {len(results) - sum(results)} failed, "
              f"{time.monotonic() - start:.0f} s", flush=True)
    every = [ok for results in RESULTS.values() for ok in results]
    print(f"TOTAL all: {len(every)} checks, {sum(every)} passed, {len(every) - sum(every)} failed")
    return 0 if all(every) else 1


if __name__ == "__main__":
    sys.exit(main())
