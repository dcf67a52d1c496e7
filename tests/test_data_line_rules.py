"""Gopher's bullet-line and ellipsis-line rules (`data.cleaning.max_bullet_line_fraction`,
`max_ellipsis_line_fraction`): a document that breaks each, one that passes, and code that is not dropped."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from leantrain.data.clean import normalize, quality_problem
from leantrain.data.code_rules import is_code
from leantrain.data.pipeline import prepare_data
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec

SPEC = CleaningSpec()
ITEMS = [
    "the loader reads every shard of the source from the local disk and checks its hash",
    "the optimizer updates the weights with the learning rate of the schedule",
    "each rank measures the time of its step so that a slow node is found early",
    "the checkpoint writer stores the state of the run in the object store",
    "a resumed run reads the data position and continues with the same tokens",
    "the planner chooses the layout that fits the memory of the devices",
    "the report names each file that could not be read and the reason",
    "the tokenizer is trained on a sample of the cleaned text of every source",
    "the validation split is drawn by hash so that it never changes between runs",
    "the trainer writes one line of metrics to the log after every step",
]
INTRO = "What the pipeline does, in the order that the steps run on each of the nodes:"


def test_a_list_of_bullets_is_dropped_and_a_document_with_a_list_is_kept() -> None:
    bullets = "\n".join(f"• {item}." for item in ITEMS)  # every line a bullet (Gopher: > 90 %)
    assert quality_problem(bullets, SPEC) == "bullet_lines"
    dashes = INTRO + "\n" + "\n".join(f"- {item}" for item in ITEMS)  # 10 of 11 lines: 0.91 > 0.9
    assert quality_problem(dashes, SPEC) == "bullet_lines"
    assert quality_problem(dashes, CleaningSpec(max_bullet_line_fraction=0.95)) is None
    article = "\n".join([INTRO, *(f"- {item}" for item in ITEMS[:4]), *(f"{item.capitalize()}." for item in ITEMS[4:])])
    assert quality_problem(article, SPEC) is None  # a list inside prose
    # not bullets: a negative number, emphasis, an option
    lines = "\n".join([INTRO, *(f"{start}{item}." for start, item in zip(["-5 degrees: ", "**Note** ", "--fast: "] * 4,
                                                                           ITEMS, strict=False))])
    assert quality_problem(lines, SPEC) is None


def test_lines_that_trail_off_are_dropped() -> None:
    teasers = "\n".join(f"{item.capitalize()} and then..." if i % 2 else f"{item.capitalize()}."
                        for i, item in enumerate(ITEMS))  # 5 of 10 lines end with "..." (Gopher: > 30 %)
    assert quality_problem(teasers, SPEC) == "ellipsis_lines"
    unicode = teasers.replace("...", "…")
    assert quality_problem(unicode, SPEC) == "ellipsis_lines"
    assert quality_problem(teasers, CleaningSpec(max_ellipsis_line_fraction=0.5)) is None
    one = "\n".join(f"{item.capitalize()} and then..." if i == 3 else f"{item.capitalize()}."
                    for i, item in enumerate(ITEMS))  # one line of ten, and "..." inside a line
    assert quality_problem(one.replace("the data position", "the data position... and"), SPEC) is None


STUBS = textwrap.dedent('''\
    from typing import Protocol


    class Reader(Protocol):
        """What a source reader provides."""

        def open(self, path: str) -> None: ...
        def read(self, size: int) -> bytes: ...
        def close(self) -> None: ...
        def seek(self, offset: int) -> int: ...
        def tell(self) -> int: ...


    def values(grid):
        return grid[..., 0] + grid[..., 1]
    ''')
YAML = "\n".join(["steps:"] + [f"  - name: step_{i}\n    run: python -m tool --stage {i} --out ./out/{i}"
                               for i in range(8)])


def test_code_is_not_dropped_by_the_line_rules() -> None:
    assert is_code(STUBS, "auto")
    code = normalize(STUBS, form="NFC", keep_indent=True)
    assert quality_problem(code, SPEC, code=True) is None  # 5 of 12 lines end with "..."
    yaml = normalize(YAML, form="NFC", keep_indent=True)  # half the lines start with "- "
    assert quality_problem(yaml, SPEC, code=True) is None
    # documentation with a code block of stubs: the stub lines are code-like, left out of the prose rules
    doc = "\n".join(f"{item.capitalize()}." for item in ITEMS[:6]) + "\n" + "\n".join(
        f"def {name}(self) -> None: ..." for name in ("open", "read", "close", "seek"))
    assert not is_code(doc, "auto") and quality_problem(doc, SPEC) is None
    teaser = doc.replace("def open(self) -> None: ...", "It opens...").replace("def read(self) -> None: ...",
                                                                              "It reads...")
    teaser = teaser.replace("def close(self) -> None: ...", "It closes...").replace("def seek(self) -> None: ...",
                                                                                 "It seeks...")
    assert quality_problem(teaser, SPEC) == "ellipsis_lines"  # the same lines as prose


def test_prepare_counts_the_line_rules_and_reads_them_from_the_spec(tmp_path: Path) -> None:
    rows = [{"id": "bullets", "text": "\n".join(f"• {item}." for item in ITEMS)},
            {"id": "teasers", "text": "\n".join(f"{item.capitalize()} and then..." for item in ITEMS)},
            {"id": "stubs", "text": STUBS},
            {"id": "prose", "text": " ".join(f"{item.capitalize()}." for item in reversed(ITEMS))}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def prepared(cleaning: dict[str, float], out: str) -> dict[str, object]:
        spec = DataSpec(tokens_total=1e5, seq_len=32, tokenizer=TokenizerSpec(kind="byte"), workers=1,
                        valid_fraction=0.0, cleaning=cleaning,
                        sources=[DataSource(name="d", path=tmp_path / "d.jsonl")])
        return prepare_data(spec, data_dir=tmp_path / out).report["sources"][0]  # type: ignore[no-any-return]

    report = prepared({}, "default")
    assert report["drops"] == {"bullet_lines": 1, "ellipsis_lines": 1} and report["docs_out"] == 2
    report = prepared({"max_bullet_line_fraction": 1.0, "max_ellipsis_line_fraction": 1.0}, "off")
    assert report["drops"] == {} and report["docs_out"] == 4
