"""Code and markup in the quality filters: which lines look like code, and the rules for code documents.

Gopher's rules were written for web prose: on source code or on documentation with code blocks they
drop good documents (operators are "symbols", `}` and `return None` are "duplicate lines", a grammar rule
repeats its 5-grams). Two modes, by `data.sources[].kind`:
- `prose`: Gopher's rules, but lines that look like code (see `code_like`) are left out of the symbol,
  bullet/ellipsis-line, duplicate-line, n-gram repetition and alphabetic-word rules (they still count as
  words for the length and stop-word rules), so a tutorial with code blocks is judged by its prose;
- `code`: rules as code datasets use them (StarCoder/The Stack preprocessing: maximum and mean line
  length, alphanumeric share) and one repetition rule that knows code: the share of characters in long
  lines (>= 20 characters) that repeat an earlier line — generated tables and copy-paste, not the short
  `}`/`end`/`pass` lines every program repeats;
- `auto` (default): `code` for a document whose non-blank lines mostly look like code, else `prose`.
Code documents keep their indentation through normalisation (Python depends on it).
"""

from __future__ import annotations

import re

# Characters that code lines are dense in and prose lines are not.
# (not quotes, *, - or : : prose quotes names, reST emphasises and lists with them)
_CODE_CHARS_RE = re.compile(r"[{}\[\]()<>=;&|#/\\%^~$@_]")
_ALNUM_RE = re.compile(r"[^\W_]")
_CODE_START_RE = re.compile(
    r"^(?:>>>|\.\.\.(?: |$)|\$ |#include|#!|//|/\*|\*/|(?:async|await|def|class|import|from|return|if|elif|else|"
    r"for|while|try|except|with|fn|func|let|const|var|pub|public|private|static|package|using|namespace|struct|"
    r"enum|switch|case|print|echo|select|SELECT)\b)"
)
_TERMINAL = (".", "!", "?", "。", "！", "？", '."', ".)")
# `name = ...`, `self.x += 1`, `items[0] = v`: an assignment statement
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z_][\w.]*(?:\[[^\]]*\])?\s*(?:[-+*/%|&^]|<<|>>|//)?=(?!=)\s*\S")
_CODE_ENDS = ("{", "}", ";", "(", "[", "]", "):", "]:")
_CODE_OPERATORS_RE = re.compile(r"::=|->|=>|==|!=|&&|\|\||::|\+\+|<=|>=")
# table borders and heading underlines: +----+----+, ======, ******, | --- |
_MARKUP_RE = re.compile(r"[-+=*_~^#|:. ]{3,}")
CODE_LINE_SYMBOL_SHARE = 0.12
CODE_DOC_LINE_SHARE = 0.5
LONG_LINE_CHARS = 20
MIN_CODE_LINES = 3


def code_like(line: str) -> bool:
    """A stripped line that reads as code or markup rather than a sentence: a table border or heading
    underline (`+----+`, `=====`); a line that starts like a statement (`def `, `>>> `, `//`, `#include`),
    assigns (`x = ...`) or holds an operator (`::=`, `->`, `==`, `&&`); or, when at least a quarter of
    its non-space characters are letters or digits (a row of ### or $$$ is spam, not code), one that ends
    like code (`{`, `;`, `):`) or whose non-space characters are at least 12 % code characters
    ({}[]()<>=;&|#/\\%^~$@_) without ending like a sentence."""
    if not line:
        return False
    if _MARKUP_RE.fullmatch(line) and len(set(line) - {" "}) <= 3:
        return True
    if _CODE_START_RE.match(line) or _ASSIGNMENT_RE.match(line) or _CODE_OPERATORS_RE.search(line):
        return True
    non_space = len(line) - line.count(" ")
    if len(_ALNUM_RE.findall(line)) < 0.25 * non_space:
        return False
    if line.endswith(_CODE_ENDS):
        return True
    if line.endswith(_TERMINAL):
        return False
    dense = len(_CODE_CHARS_RE.findall(line))
    return dense >= 2 and dense >= CODE_LINE_SYMBOL_SHARE * non_space


def code_share(text: str) -> float:
    """Share of non-blank lines that look like code (0 for most prose, found by one regex pass)."""
    symbols = len(_CODE_CHARS_RE.findall(text))
    if symbols < 0.02 * len(text) and "\n" in text and not _CODE_START_RE.search(text):
        return 0.0
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    if len(lines) < MIN_CODE_LINES:
        return 0.0  # one or two lines: a sentence with symbols (or symbol spam), not a program
    return sum(map(code_like, lines)) / len(lines)


def is_code(text: str, kind: str) -> bool:
    """Whether a document of a source of this `kind` (prose, code, auto) is judged by the code rules."""
    return kind == "code" or (kind == "auto" and code_share(text) >= CODE_DOC_LINE_SHARE)


def prose_part(text: str) -> str:
    """The text without its code-like lines (what the prose rules judge for repetition and symbols)."""
    lines = text.split("\n")
    kept = [line for line in lines if not code_like(line.strip())]
    return text if len(kept) == len(lines) else "\n".join(kept)


def code_problem(text: str, *, max_line_chars: int, max_mean_line_chars: float, min_alnum_fraction: float,
                 max_duplicate_line_fraction: float) -> str | None:
    """The first code rule a code document breaks, or None."""
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return "empty"
    lengths = [len(line) for line in lines]
    if max(lengths) > max_line_chars or sum(lengths) / len(lengths) > max_mean_line_chars:
        return "long_lines"  # minified or generated code, data in a code file
    non_space = len(text) - text.count(" ") - text.count("\n") - text.count("\t")
    alnum = sum(1 for ch in text if ch.isalnum())
    if alnum < min_alnum_fraction * max(non_space, 1):
        return "low_alnum"  # encoded blobs, ASCII art, tables of symbols
    seen: set[str] = set()
    repeated = total = 0
    for line in lines:
        stripped = line.strip()
        if len(stripped) < LONG_LINE_CHARS:
            continue
        total += len(stripped)
        if stripped in seen:
            repeated += len(stripped)
        seen.add(stripped)
    if total and repeated / total > max_duplicate_line_fraction:
        return "duplicate_code_lines"
    return None
