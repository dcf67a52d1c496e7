"""Write the bundled demo corpora as jsonl files for inspection (prepare builds them on demand anyway).

Run: python scripts/make_demo_corpus.py [OUT_DIR]   (default: demo-out/corpus/)
The text comes from `leantrain.data.demo_corpus` (generated English/Chinese with planted duplicates, junk and
personal data, plus CPython's bundled reference topics), so what you inspect is exactly what `prepare` reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from leantrain.data.demo_corpus import materialize

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "demo-out" / "corpus"


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    for builtin, name in (("demo-en", "en"), ("demo-zh", "zh"), ("pydoc", "pydoc")):
        path = materialize(builtin, out / f"{name}.jsonl")
        print(f"{path}: {len(path.read_text(encoding='utf-8').splitlines())} documents")


if __name__ == "__main__":
    main(sys.argv[1:])
