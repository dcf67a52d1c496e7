"""Text normalisation and quality filters in the spirit of Gopher (Rae et al. 2021, App. A) and C4.

Words: a Han or kana character is one word; any other run of letters/digits is one word. So the length,
n-gram and stop-word rules work on Chinese/Japanese text (no spaces) the same way as on English; the
n-gram rules use n-grams of 2n characters for CJK-dominant text (a Chinese word averages about two
characters), so "2-gram" and "5-gram" mean roughly the same amount of text in both scripts.
Each filter returns the name of the first rule a document breaks (the drop reason), or None. Code and
documentation with code blocks: `kind` (data.sources[].kind) chooses the code rules or leaves code-like
lines out of the prose rules (code_rules.py).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

from leantrain.data.code_rules import code_problem, code_share, prose_part
from leantrain.spec.schema import CleaningSpec

CJK_CLASS = r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
WORD_RE = re.compile(rf"[{CJK_CLASS}]|[^\W_{CJK_CLASS}]+")
CJK_CHAR_RE = re.compile(rf"[{CJK_CLASS}]")
ASCII_WORD_RE = re.compile(r"[A-Za-z0-9]+")  # WORD_RE on ASCII text
NON_WORD_RE = re.compile(r"[^\w\s]")
SPACES_RE = re.compile(r"[^\S\n]+")  # whitespace other than newline
MANY_NEWLINES_RE = re.compile(r"\n{3,}")
# a whitespace-separated token with at least one letter (Gopher: 80 % of words contain one)
ALPHA_TOKEN_RE = re.compile(r"\S*[^\W\d_]\S*")
# Gopher's list and ellipsis rules (Rae et al. 2021, App. A: drop a document with more than 90 % of its lines
# starting with a bullet point, or more than 30 % ending with an ellipsis). Defaults as datatrove's
# GopherQualityFilter (datatrove/pipeline/filters/gopher_quality_filter.py, 0.10: max_bullet_lines_ratio 0.9,
# max_ellipsis_lines_ratio 0.3; it counts "•" and "-" as bullets, over all lines). Here: non-blank lines, Unicode
# bullet characters, and -, *, +, – or — when a space follows (a Markdown list item, not "-5" or "**bold**").
BULLET_LINE_RE = re.compile(r"^[^\S\n]*(?:[•‣◦⁃∙●○▪▫■□►▸◆◇]|[-*+–—](?=\s|$))", re.MULTILINE)
ELLIPSIS_LINE_RE = re.compile(r"(?:\.\.\.|…)[^\S\n]*$", re.MULTILINE)
NON_BLANK_LINE_RE = re.compile(r"^[^\S\n]*\S", re.MULTILINE)
# Gopher's English stop words; for Chinese, frequent function characters (particles, pronouns, prepositions,
# conjunctions), without those that mostly occur inside nouns (中, 上, 时, 可, 能: 中国, 上海, 时间 …), so a
# keyword list still has none. Calibrated on the bundled demo-zh sentences (docs/data.md): the 13-character
# list dropped 13.3% of natural one-sentence lines, this one 4.1%, and keyword spam is still dropped.
EN_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
ZH_STOP_WORDS = frozenset("的了是在和有不这也就都与及着为我他你们个到把被对从以而或等要会将于其之所")
# Symbol categories that count against a document: currency (Sc), modifiers (Sk) and other symbols (So:
# ©, ™, arrows, emoji). Not math symbols (Sm: = + < > | ~), which are the operators of code and the rules
# of reST/Markdown tables; counting them dropped 14 of the 79 Python reference documents.
_COUNTED_SYMBOLS = frozenset({"Sc", "Sk", "So"})
CJK_NGRAM_SCALE = 2
_ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"
_CONTROL_TABLE = {
    **{c: None for c in range(0x20) if chr(c) not in "\n\t"},
    0x7F: None,
    **{c: None for c in range(0x80, 0xA0)},
    **{ord(c): None for c in _ZERO_WIDTH},
    ord("\t"): " ",
}
_CODE_CONTROL_TABLE = {k: v for k, v in _CONTROL_TABLE.items() if k != ord("\t")}


def normalize(text: str, *, form: str, keep_indent: bool = False) -> str:
    """Unicode normal form, control/zero-width characters removed, spaces collapsed, line ends unified.
    `keep_indent` (code): tabs and leading spaces stay, only trailing spaces go."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if form != "none":
        text = unicodedata.normalize(form, text)
    if keep_indent:
        text = "\n".join(line.rstrip() for line in text.translate(_CODE_CONTROL_TABLE).split("\n"))
        return MANY_NEWLINES_RE.sub("\n\n", text).strip("\n")
    text = text.translate(_CONTROL_TABLE)
    text = SPACES_RE.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    return MANY_NEWLINES_RE.sub("\n\n", text).strip()


@dataclass(frozen=True)
class TextStats:
    """What the filters look at, computed once per document."""

    words: list[str]
    num_cjk: int

    @property
    def cjk_share(self) -> float:
        return self.num_cjk / len(self.words) if self.words else 0.0


def text_stats(text: str) -> TextStats:
    if text.isascii():  # the same words, found twice as fast by a plain character class
        return TextStats(words=ASCII_WORD_RE.findall(text), num_cjk=0)
    return TextStats(words=WORD_RE.findall(text), num_cjk=len(CJK_CHAR_RE.findall(text)))


def _symbol_ratio(text: str, num_words: int) -> float:
    # only non-word, non-space characters can be symbols: a C-speed regex finds them first
    symbols = sum(1 for ch in NON_WORD_RE.findall(text) if ch in "#…" or unicodedata.category(ch) in _COUNTED_SYMBOLS)
    return (symbols + text.count("...")) / max(num_words, 1)


def _duplicate_line_fraction(text: str) -> float:
    lines = [line for line in text.split("\n") if line]
    if len(lines) < 2:
        return 0.0
    return 1.0 - len(set(lines)) / len(lines)


def _top_ngram_fraction(words: list[str], n: int) -> float:
    """Share of word characters covered by the most frequent n-gram (Gopher's top n-gram rule)."""
    if len(words) < n + 1:
        return 0.0
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    (top, count), = grams.most_common(1)
    if count < 2:
        return 0.0
    return min(1.0, count * sum(len(w) for w in top) / sum(len(w) for w in words))


def _duplicate_ngram_fraction(words: list[str], n: int) -> float:
    """Share of word characters inside n-grams that occur more than once (Gopher's duplicate n-gram rule)."""
    if len(words) < 2 * n:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = bytearray(len(words))
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i : i + n] = b"\x01" * n
    total = sum(len(w) for w in words)
    return sum(len(w) for w, c in zip(words, covered, strict=True) if c) / total


def _line_fractions(text: str) -> tuple[float, float]:
    """(share of non-blank lines starting with a bullet, share ending with an ellipsis `...`/`…`)."""
    bullets = len(BULLET_LINE_RE.findall(text))
    ellipses = len(ELLIPSIS_LINE_RE.findall(text)) if ("..." in text or "…" in text) else 0
    if not bullets and not ellipses:
        return 0.0, 0.0
    lines = max(len(NON_BLANK_LINE_RE.findall(text)), 1)
    return bullets / lines, ellipses / lines


def _stop_words_present(stats: TextStats) -> int:
    if stats.cjk_share >= 0.5:
        return len(ZH_STOP_WORDS.intersection(stats.words))
    return len(EN_STOP_WORDS.intersection(w.lower() for w in stats.words))


def _alpha_word_fraction(text: str, stats: TextStats) -> float:
    """Share of words with a letter: whitespace-separated tokens for Latin script (as Gopher counts them,
    so "=" or "3.14" is a word without one), the character words of CJK-dominant text."""
    if stats.cjk_share >= 0.5:
        return sum(1 for w in stats.words if not w.isdigit()) / max(len(stats.words), 1)
    tokens = len(text.split())
    return len(ALPHA_TOKEN_RE.findall(text)) / tokens if tokens else 1.0


def quality_problem(text: str, spec: CleaningSpec, stats: TextStats | None = None, *, code: bool = False
                    ) -> str | None:
    """The first quality rule `text` breaks (a drop reason), or None when it passes all of them. `code`: the
    document is judged by the code rules (code_rules.py); otherwise its code-like lines are left out of the
    symbol, bullet/ellipsis-line, alphabetic-word and repetition rules."""
    stats = stats if stats is not None else text_stats(text)
    num_words = len(stats.words)
    if num_words < spec.min_words:
        return "too_short"
    if num_words > spec.max_words:
        return "too_long"
    if code:
        return code_problem(text, max_line_chars=spec.max_code_line_chars,
                            max_mean_line_chars=spec.max_code_mean_line_chars,
                            min_alnum_fraction=spec.min_code_alnum_fraction,
                            max_duplicate_line_fraction=spec.max_code_duplicate_line_fraction)
    if stats.cjk_share < 0.5:
        num_latin = num_words - stats.num_cjk
        mean_length = (sum(map(len, stats.words)) - stats.num_cjk) / max(num_latin, 1)
        if not spec.min_mean_word_length <= mean_length <= spec.max_mean_word_length:
            return "mean_word_length"
    prose, prose_stats = text, stats
    if code_share(text) > 0:  # documentation with code blocks: the rules below judge its prose
        prose = prose_part(text)
        prose_stats = text_stats(prose)
    if _symbol_ratio(prose, len(prose_stats.words)) > spec.max_symbol_ratio:
        return "symbol_ratio"
    bullet_share, ellipsis_share = _line_fractions(prose)
    if bullet_share > spec.max_bullet_line_fraction:
        return "bullet_lines"
    if ellipsis_share > spec.max_ellipsis_line_fraction:
        return "ellipsis_lines"
    if _alpha_word_fraction(prose, prose_stats) < spec.min_alpha_word_fraction:
        return "few_alpha_words"
    if _duplicate_line_fraction(prose) > spec.max_duplicate_line_fraction:
        return "duplicate_lines"
    # A Chinese word is about two characters, so CJK text uses n-grams of twice as many characters.
    scale = CJK_NGRAM_SCALE if stats.cjk_share >= 0.5 else 1
    if _top_ngram_fraction(prose_stats.words, 2 * scale) > spec.max_top_2gram_fraction:
        return "top_2gram"
    if _duplicate_ngram_fraction(prose_stats.words, 5 * scale) > spec.max_duplicate_5gram_fraction:
        return "duplicate_5grams"
    if _stop_words_present(stats) < spec.min_stop_words:
        return "no_stop_words"
    return None
