"""Per-source statistics of a prepare run, `report.json`, and the final table.

report.json: `sources[]` (docs in/out, drop reasons, duplicate rate, PII counts by type, tokens, mean
document length in tokens, read problems with file:line examples), `dedup` (counts, LSH settings and
S-curve), `pii` (totals by type), `tokenizer`, `timings_s`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.data.readers import ReadStats


@dataclass
class SourceStats:
    """Counters for one source during the clean stage."""

    name: str
    weight: float
    read: ReadStats
    docs_in: int = 0
    chars_in: int = 0
    chars_out: int = 0
    docs_out: Counter[str] = field(default_factory=Counter)
    drops: Counter[str] = field(default_factory=Counter)
    pii: Counter[str] = field(default_factory=Counter)
    # damaged files (data.on_bad_input: skip): where each broke, the documents read before it (kept) and the
    # compressed bytes after it (not decodable)
    bad_inputs: list[dict[str, Any]] = field(default_factory=list)
    docs_lost_to_bad_input: int = 0  # documents the damage cut short (a partial last line)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "weight": self.weight, "docs_in": self.docs_in,
            "docs_out": sum(self.docs_out.values()), "docs": {"train": self.docs_out["train"],
                                                               "valid": self.docs_out["valid"]},
            "chars_in": self.chars_in, "chars_out": self.chars_out, "drops": dict(sorted(self.drops.items())),
            "pii": dict(sorted(self.pii.items())), "tokens": {"train": 0, "valid": 0},
            "read_problems": dict(self.read.problems), "read_problem_examples": self.read.examples,
            "files": self.read.files, "bytes_read": self.read.bytes_read, "bad_inputs": self.bad_inputs,
            "docs_lost_to_bad_input": self.docs_lost_to_bad_input,
        }


def build_report(*, sources: list[dict[str, Any]], dedup: dict[str, Any], tokenizer: dict[str, Any],
                 timings: dict[str, float]) -> dict[str, Any]:
    for source in sources:
        dups = source["drops"].get("exact_duplicate", 0) + source["drops"].get("near_duplicate", 0)
        source["dup_rate"] = round(dups / max(source["docs_in"], 1), 4)
        tokens = source["tokens"]["train"] + source["tokens"]["valid"]
        source["mean_doc_tokens"] = round(tokens / max(source["docs_out"], 1), 1)
    pii: Counter[str] = Counter()
    for source in sources:
        pii.update(source["pii"])
    dedup = {**dedup,
             "exact_duplicates": sum(s["drops"].get("exact_duplicate", 0) for s in sources),
             "near_duplicates": sum(s["drops"].get("near_duplicate", 0) for s in sources)}
    return {"sources": sources, "dedup": dedup, "pii": dict(sorted(pii.items())), "tokenizer": tokenizer,
            "timings_s": {k: round(v, 3) for k, v in timings.items()}}


def damage_line(bad: dict[str, Any]) -> str:
    """One line for a damaged file read under data.on_bad_input: skip: what, where, what was kept and lost."""
    where = f"line {bad['line']:,}, " if bad.get("line") is not None else ""
    unread = bad.get("bytes_unread")
    rest = f"; {unread:,} bytes after it not readable" if unread else ""
    return (f"{bad['problem']} at {where}compressed byte {bad['offset']:,}; kept the {bad.get('docs_before', 0):,} "
            f"documents before it{rest}")


def render_report(report: dict[str, Any], *, console: Console) -> None:
    sources = report["sources"]
    table = Table(title="prepare: per source")
    for column in ("source", "weight", "docs in", "docs out", "dup rate", "train tokens", "valid tokens",
                   "mean doc tokens"):
        table.add_column(column, justify="left" if column == "source" else "right")
    for s in sources:
        table.add_row(s["name"], f"{s['weight']:g}", f"{s['docs_in']:,}", f"{s['docs_out']:,}", f"{s['dup_rate']:.1%}",
                      f"{s['tokens']['train']:,}", f"{s['tokens']['valid']:,}", f"{s['mean_doc_tokens']:.0f}")
    console.print(table)
    for title, key in (("dropped documents by reason", "drops"), ("redacted values by type", "pii")):
        kinds = sorted({k for s in sources for k in s[key]})
        if not kinds:
            console.print(f"{title}: none")
            continue
        counts = Table(title=title)
        counts.add_column("reason" if key == "drops" else "type")
        for s in sources:
            counts.add_column(s["name"], justify="right")
        for kind in kinds:
            counts.add_row(kind, *[f"{s[key].get(kind, 0):,}" for s in sources])
        console.print(counts)
    for s in sources:
        for bad in s.get("bad_inputs", []):
            console.print(f"[yellow]{s['name']}: {bad['file']}: {damage_line(bad)} (data.on_bad_input: skip)")
        for kind, count in s.get("read_problems", {}).items():
            examples = ", ".join(s["read_problem_examples"].get(kind, []))
            console.print(f"[yellow]{s['name']}: skipped {count} ({kind}), e.g. {examples}")
    dedup = report["dedup"]
    curve = Table(title=f"near-dedup LSH S-curve: {dedup['bands']} bands × {dedup['rows']} rows "
                        f"(threshold ≈ {dedup['s_curve']['threshold']}), confirm at ≥ {dedup['verify_jaccard']}")
    points = [k for k in dedup["s_curve"] if k != "threshold"]
    curve.add_column("Jaccard s")
    for point in points:
        curve.add_column(point, justify="right")
    curve.add_row("P(cand.)", *[f"{dedup['s_curve'][p]:.2f}" for p in points])
    console.print(curve)
    console.print(f"duplicates removed: exact {dedup['exact_duplicates']}, near {dedup['near_duplicates']} "
                  f"(LSH candidates {dedup['lsh_candidates']}, rejected on verify {dedup['rejected_by_verify']}); "
                  f"tokenizer vocab {report['tokenizer']['vocab_size']}, sha256 {report['tokenizer']['sha256'][:12]}")
