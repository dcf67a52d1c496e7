"""Check that the installed torch is the pinned one (constraints.txt) and the expected build (cpu or cuda).

`make install` runs it last, so an install step that swapped torch for another build fails loudly instead of
leaving a multi-GB CUDA build (or the wrong version) behind.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path


def pinned_version(constraints: Path) -> str:
    for line in constraints.read_text().splitlines():
        match = re.match(r"^\s*torch==([^\s#]+)", line)
        if match:
            return match.group(1)
    raise SystemExit(f"{constraints}: no torch==VERSION line")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--expect", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--constraints", type=Path, default=Path(__file__).resolve().parents[1] / "constraints.txt")
    args = parser.parse_args()
    want = pinned_version(args.constraints)
    have = metadata.version("torch")
    problems = []
    if have.split("+")[0] != want.split("+")[0]:
        problems.append(f"torch {have} installed, constraints.txt pins {want}")
    cuda_wheels = sorted(d.metadata["Name"] for d in metadata.distributions()
                         if (d.metadata["Name"] or "").lower().startswith("nvidia-"))
    if args.expect == "cpu" and cuda_wheels:
        problems.append(f"CPU build expected but {len(cuda_wheels)} CUDA wheels are installed ({cuda_wheels[0]}, ...)")
    if problems:
        print("torch check failed: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"torch {have} ({args.expect} build) as pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
