"""Quality filters that keep code and technical text: Gopher's alphabetic-word rule, code-like lines left
out of the prose rules, the code rules (data.sources[].kind: code | auto), indentation kept for code."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest

from leantrain.data.clean import normalize, quality_problem
from leantrain.data.code_rules import code_like, code_share, is_code
from leantrain.data.pipeline import prepare_data
from leantrain.spec.schema import CleaningSpec, DataSource, DataSpec, TokenizerSpec

SPEC = CleaningSpec()
PROSE = ("The data loader reads the token shards from local disk and the optimizer updates the weights with "
         "a learning rate that follows the schedule. Each rank measures its step time so that slow nodes are "
         "found early, and the checkpoint writer stores the state to the object store with a hash per file.")
PROGRAM = textwrap.dedent(inspect.getsource(json.JSONEncoder.iterencode)) + "\n" + \
    textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))


def test_most_words_need_a_letter() -> None:
    numbers = PROSE + " " + " ".join(f"{1000 + 7 * i}" for i in range(40))  # a table of values after a paragraph
    assert quality_problem(numbers, SPEC) == "few_alpha_words"
    assert quality_problem(numbers, CleaningSpec(min_alpha_word_fraction=0.3)) is None
    assert quality_problem(PROSE, SPEC) is None


@pytest.mark.parametrize(("line", "code"), [
    ("def iterencode(self, o, _one_shot=False):", True), ("x = self._split(text)", True),
    ("augop ::= \"+=\" | \"-=\" | \"*=\"", True), ("+-----------+----------+", True), ("}", False),
    ("if (a && b) {", True), (">>> print(1)", True), ("The encoder returns a string (see below).", False),
    ("Use the \"async for\" statement in a coroutine.", False), ("### $$$ ### $$$ ### @@@", False),
])
def test_code_like_lines(line: str, code: bool) -> None:
    assert code_like(line) is code


def test_a_program_passes_the_code_rules_and_fails_gopher() -> None:
    assert code_share(PROGRAM) > 0.5 and is_code(PROGRAM, "auto") and not is_code(PROGRAM, "prose")
    assert not is_code(PROSE, "auto") and is_code(PROSE, "code")
    code = normalize(PROGRAM, form="NFC", keep_indent=True)
    assert "\n    " in code and "\t" not in PROGRAM  # indentation survives normalisation
    assert quality_problem(code, SPEC, code=True) is None
    assert quality_problem(normalize(PROGRAM, form="NFC"), SPEC, code=False) is not None  # Gopher drops it


def test_the_code_rules_drop_minified_blobs_and_copy_paste() -> None:
    minified = "var a=1;" + "function f(x){return x*2};" * 60 + "\nvar b=2;\nvar c=3;"
    assert quality_problem(minified, SPEC, code=True) == "long_lines"
    blob = "data = '''\n" + "\n".join("+/=+/=+/=+/=+/=+/=+/=+/=+/=+/=+/=+/=+/=" for _ in range(30)) + "\n'''"
    assert quality_problem(blob + "\n" + "value = compute(first, second)\n" * 5, SPEC, code=True) == "low_alnum"
    pasted = PROGRAM + "\n" + "    result = compute_the_value(first_argument, second_argument)\n" * 40
    assert quality_problem(pasted, SPEC, code=True) == "duplicate_code_lines"
    braces = PROGRAM + "\n" + "}\n" * 40 + "end\n" * 10  # short lines repeat in every program
    assert quality_problem(braces, SPEC, code=True) is None


def test_a_tutorial_is_judged_by_its_prose() -> None:
    """Repeated code lines and operators in a document that is mostly prose: without leaving the code lines
    out, `duplicate_lines` and `symbol_ratio`/`few_alpha_words` would drop it."""
    block = "\n".join(["x = load(path)", "assert x == {}"] * 4)
    prose = PROSE.replace(". ", ".\n").replace(", and", ",\nand").split("\n") + [
        "To load a shard, open it by path and check that its header has the expected magic bytes.",
        "If the check fails, the loader reports the file name and stops before any step runs.",
        "Then compare the result with an empty mapping, which is what a fresh folder should hold.",
        "A second call with the same path returns the same object from the cache of the process.",
        "This is why the example repeats the call: the assertion must hold both times.",
        "Nothing else in the folder is read, and the files of other formats are named in the report.",
    ]
    tutorial = "\n".join(prose[:5] + block.split("\n") + prose[5:])
    assert not is_code(tutorial, "auto")
    assert quality_problem(tutorial, SPEC) is None
    as_prose = tutorial.replace("x = load(path)", "The loader loads it.").replace("assert x == {}", "It is empty.")
    assert quality_problem(as_prose, SPEC) == "duplicate_lines"


def _decoded(data_dir: Path) -> list[str]:
    from tokenizers import Tokenizer

    from leantrain.data.layout import load_manifest
    from leantrain.data.shards import ShardReader

    manifest = load_manifest(data_dir)
    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    readers = [ShardReader(data_dir / shard.path) for shard in manifest.shards]
    return [tokenizer.decode(r.doc(i).tolist()[:-1]) for r in readers for i in range(r.num_docs)]


def test_prepare_keeps_code_with_its_indentation(tmp_path: Path) -> None:
    rows = [{"id": "prog", "text": PROGRAM}, {"id": "prose", "text": PROSE}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {}
    for kind in ("auto", "prose"):
        spec = DataSpec(tokens_total=1e5, seq_len=32, tokenizer=TokenizerSpec(kind="byte"), workers=1,
                        valid_fraction=0.0, sources=[DataSource(name="c", path=tmp_path / "c.jsonl", kind=kind)])
        result = prepare_data(spec, data_dir=tmp_path / kind)
        results[kind] = result.report["sources"][0]
    assert results["auto"]["docs_out"] == 2 and results["prose"]["docs_out"] == 1
    program = next(d for d in _decoded(tmp_path / "auto") if d.startswith("def iterencode"))
    assert program == normalize(PROGRAM, form="NFC", keep_indent=True) and "\n        " in program
