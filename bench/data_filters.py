"""Quality filters against datatrove's Gopher + C4 filters on the same documents.

For each corpus: how many documents each side keeps, the agreement (same keep/drop decision), and the
disagreements with both sides' reasons (the first few printed, to judge which side is right).
- ours: `clean.normalize` + `clean.quality_problem` with `kind: auto` (code rules for a document whose lines
  mostly look like code; otherwise Gopher's rules with code-like lines left out of the symbol, alphabetic-word
  and repetition rules), the spec's default thresholds except `min_words` (see below);
- datatrove 0.10: GopherRepetitionFilter, GopherQualityFilter and C4QualityFilter (filter_no_terminal_punct
  off, as FineWeb runs it; C4's line removal counts as kept when text is left), default thresholds, with
  the corpus's language.
Corpora: English prose (the bundled demo-en generator, 700 documents), lists and teasers (330 of them one
sentence per line, a share of 0 to 1 of the lines made bullet items or ending in an ellipsis), code
documentation (Python's reference topics, `pydoc_data`, 79), Python source (the first 150 modules of this
interpreter's standard library), Chinese prose (demo-zh, 500). `min_words` is 20 on both sides
(datatrove's Gopher default 50 would drop the short demo sentences on its side only).
Run: .venv/bin/python bench/data_filters.py [--show N]
"""

from __future__ import annotations

import glob
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

from leantrain.data.clean import normalize, quality_problem
from leantrain.data.code_rules import is_code
from leantrain.data.demo_corpus import builtin_rows
from leantrain.spec.schema import CleaningSpec

LINE_MARKS = ("• ", "- ", "* ", "...", "…")


def lists_and_teasers(rows: list[dict[str, str]], count: int = 330) -> list[tuple[str, str]]:
    """demo-en documents one sentence per line, a share 0, 0.1 … 1 of their lines (the first ones) made list
    items (`•`, `-`, `*`) or trailing off (`...`, `…`): Gopher's bullet-line and ellipsis-line rules."""
    docs = []
    for i, row in enumerate(rows[:count]):
        mark, share = LINE_MARKS[i % len(LINE_MARKS)], (i // len(LINE_MARKS)) % 11 / 10
        lines = [s.rstrip(".") for s in row["text"].split(". ")]
        marked = round(share * len(lines))
        lines = [(mark + line + "." if mark.endswith(" ") else line + mark) if j < marked else line + "."
                 for j, line in enumerate(lines)]
        docs.append((f"{row['id']}{mark.strip()}{share:.1f}", "\n".join(lines)))
    return docs


def corpora() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    stdlib = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:150]
    code = [(Path(p).name, Path(p).read_text(encoding="utf-8", errors="replace")) for p in stdlib]
    return {
        "English prose (demo-en)": ("en", [(r["id"], r["text"]) for r in builtin_rows("demo-en")]),
        "lists and teasers (demo-en lines)": ("en", lists_and_teasers(list(builtin_rows("demo-en")))),
        "code docs (pydoc topics)": ("en", [(r["id"], r["text"]) for r in builtin_rows("pydoc")]),
        "Python source (stdlib)": ("en", code),
        "Chinese prose (demo-zh)": ("zh", [(r["id"], r["text"]) for r in builtin_rows("demo-zh")]),
    }


def ours(text: str, spec: CleaningSpec) -> str | None:
    code = is_code(text, "auto")
    cleaned = normalize(text, form="NFC", keep_indent=code)
    return quality_problem(cleaned, spec, code=code) if cleaned.strip() else "empty"


def datatrove_filters(language: str) -> list[Any]:
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter

    return [GopherRepetitionFilter(language=language), GopherQualityFilter(min_doc_words=20, language=language),
            C4QualityFilter(filter_no_terminal_punct=False, language=language)]


def theirs(text: str, filters: list[Any]) -> str | None:
    from datatrove.data import Document

    doc = Document(text=text, id="x")
    for flt in filters:
        verdict = flt.filter(doc)
        ok, reason = verdict if isinstance(verdict, tuple) else (verdict, flt.name)
        if not ok:
            return str(reason)
        if not doc.text.strip():
            return "c4_empty"
    return None


def main() -> None:
    show = int(sys.argv[sys.argv.index("--show") + 1]) if "--show" in sys.argv else 4
    spec = CleaningSpec()
    rows = []
    for name, (language, docs) in corpora().items():
        filters = datatrove_filters(language)
        decisions = [(doc_id, ours(text, spec), theirs(text, filters)) for doc_id, text in docs]
        agree = sum((a is None) == (b is None) for _, a, b in decisions)
        kept_ours = sum(a is None for _, a, _ in decisions)
        kept_theirs = sum(b is None for _, _, b in decisions)
        rows.append((name, len(docs), kept_ours, kept_theirs, agree / len(docs)))
        print(f"{name}: {len(docs)} docs, kept ours {kept_ours}, datatrove {kept_theirs}, agreement "
              f"{agree / len(docs):.3f}", flush=True)
        split = Counter(("ours keeps" if a is None else f"ours drops ({a})") + " / " +
                        ("datatrove keeps" if b is None else f"datatrove drops ({b})")
                        for _, a, b in decisions if (a is None) != (b is None))
        for what, count in split.most_common():
            print(f"  {count:4d}  {what}")
        for doc_id, a, b in [d for d in decisions if (d[1] is None) != (d[2] is None)][:show]:
            print(f"    e.g. {doc_id}: ours {a or 'keep'}, datatrove {b or 'keep'}")
    print("\n| corpus | docs | kept (ours) | kept (datatrove) | agreement |\n|---|---|---|---|---|")
    for name, n, a, b, agreement in rows:
        print(f"| {name} | {n} | {a} | {b} | {agreement:.3f} |")


if __name__ == "__main__":
    main()
