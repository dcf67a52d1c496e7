"""What every `leantrain demo` stage gets: the demo context, and where the bundled examples are.

It sits in the foundation layer so that each stage's own module (plan, data, train, launch, golive) can take a
context without importing the demo runner (demo.py), which imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from leantrain.spec import JobSpec, load_spec

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_SPEC = REPO_ROOT / "examples" / "tiny-cpu.yaml"


@dataclass
class DemoContext:
    """What every demo stage needs: the spec, where to write, and the console."""

    spec_path: Path
    out_dir: Path
    console: Console
    overrides: list[str] = field(default_factory=list)

    def spec(self) -> JobSpec:
        return load_spec(self.spec_path, overrides=self.overrides)
