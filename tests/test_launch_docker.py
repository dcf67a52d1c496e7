"""The training image's files: Dockerfile instructions pin the base and install only from the hashed lock;
the lock pins torch to the same version as the Makefile and carries the communication library (NCCL)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), " ".join(rest.split())))
    return found


def lock_pins() -> dict[str, str]:
    pins = {}
    for block in re.split(r"\n(?=[a-z0-9])", (DOCKER / "requirements.lock").read_text()):
        first = block.splitlines()[0]
        if "==" in first:
            name, _, version = first.split(" ")[0].partition("==")
            assert "--hash=sha256:" in block, f"{name} has no hash in the lock"
            pins[name] = version
    return pins


def test_dockerfile_pins_base_installs_from_lock_and_runs_as_non_root() -> None:
    steps = instructions((DOCKER / "Dockerfile").read_text())
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", args["PYTHON_IMAGE"])
    assert [a for kind, a in steps if kind == "FROM"] == ["${PYTHON_IMAGE}"]
    runs = " ".join(a for kind, a in steps if kind == "RUN")
    assert "pip install --require-hashes --no-deps -r /tmp/requirements.lock" in runs
    assert "pip install --no-deps --no-build-isolation ." in runs  # leantrain itself adds nothing unpinned
    assert "/etc/leantrain/image.json" in runs
    assert ("USER", "1000:1000") in steps
    assert steps[-2][0] == "ENTRYPOINT" and "tini" in steps[-2][1]
    pins = lock_pins()
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["NCCL_VERSION"] == next(v for k, v in pins.items() if k.startswith("nvidia-nccl"))


def test_lock_pins_every_package_and_matches_the_dev_torch_pin() -> None:
    pins = lock_pins()
    dev_pin = re.search(r"^torch==([\w.]+)", (REPO / "constraints.txt").read_text(), flags=re.M).group(1)
    assert pins["torch"] == dev_pin
    wanted = {re.split(r"[=<>]", line)[0].lower() for line in (DOCKER / "requirements.in").read_text().splitlines()
              if line and not line.startswith("#")}
    assert wanted <= set(pins), wanted - set(pins)
    assert {"fsspec", "s3fs", "tokenizers", "pyarrow"} <= set(pins)  # data dependencies
