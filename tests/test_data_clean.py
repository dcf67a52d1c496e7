"""Normalisation and each quality filter, on English and Chinese text."""

from __future__ import annotations

import pytest

from leantrain.data.clean import normalize, quality_problem, text_stats
from leantrain.spec.schema import CleaningSpec

SPEC = CleaningSpec()
GOOD_EN = ("The data loader reads the token shards from local disk and the optimizer updates the weights with "
           "a learning rate that follows the schedule. Each rank measures its step time so that slow nodes are "
           "found early, and the checkpoint writer stores the state to the object store with a hash per file.")
GOOD_ZH = ("数据加载器从本地磁盘读取分片，优化器按照学习率的调度更新权重。"
           "每张卡都会测量自己的步长时间，这样就能尽早发现慢节点。"
           "检查点程序把状态写入对象存储，并且为每个文件记录哈希。")


def test_normalize_controls_spaces_and_unicode() -> None:
    raw = "Ｆｕｌｌ\u00a0width\x00 text\u200b\r\n\r\n\r\n\tnext  line  \x85"
    assert normalize(raw, form="NFC") == "Ｆｕｌｌ width text\n\nnext line"
    assert normalize(raw, form="NFKC") == "Full width text\n\nnext line"
    assert normalize("e\u0301", form="NFC") == "\u00e9" and normalize("e\u0301", form="none") == "e\u0301"


def test_cjk_counts_characters_as_words() -> None:
    stats = text_stats("训练 GPT 模型")
    assert stats.words == ["训", "练", "GPT", "模", "型"] and stats.num_cjk == 4


def test_good_documents_pass() -> None:
    assert quality_problem(GOOD_EN, SPEC) is None
    assert quality_problem(GOOD_ZH, SPEC) is None


@pytest.mark.parametrize(("text", "reason"), [
    ("Too short to keep.", "too_short"),
    ("短文本。", "too_short"),
    (" ".join(["a b c d e f g h i j k l m n o p q r s t u v the and"] * 2), "mean_word_length"),
    (" ".join(["internationalization", "characterization", "the", "and"] * 8), "mean_word_length"),
    (GOOD_EN + " # $ % ^ & * + = | ~ < > @ # # # $ $ $ ... ... … … " * 3, "symbol_ratio"),
    ("\n".join([GOOD_EN[:80]] * 3 + [GOOD_EN[80:]]), "duplicate_lines"),
    (GOOD_EN + " " + " ".join(["buy now"] * 20), "top_2gram"),
    (GOOD_EN + " the shards are read from disk and written back" * 3, "duplicate_5grams"),
    ("Lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt labore magna "
     "aliqua enim minim veniam quis nostrud exercitation ullamco laboris", "no_stop_words"),
    ("好" * 60, "top_2gram"),
    ("集群读取本地磁盘上的分片" * 2 + GOOD_ZH + "集群读取本地磁盘上的分片" * 2, "duplicate_5grams"),
    ("手机 手机壳 苹果 华为 小米 充电器 数据线 耳机 蓝牙 音箱 钢化膜 支架 平板 电脑 键盘 鼠标", "no_stop_words"),
    (GOOD_EN + " $$$ ©©© ™™™ ★★★" * 4, "symbol_ratio"),
])
def test_each_filter_drops_its_case(text: str, reason: str) -> None:
    assert quality_problem(normalize(text, form="NFC"), SPEC) == reason


def test_thresholds_come_from_the_spec() -> None:
    loose = CleaningSpec(min_words=1, min_stop_words=0)
    assert quality_problem("Too short to keep.", loose) is None
    assert quality_problem(GOOD_EN, CleaningSpec(max_words=10)) == "too_long"


PYTHON_DOC = """Augmented assignment statements
*******************************

Augmented assignment is the combination, in a single statement, of a binary operation and an
assignment statement:

   augmented_assignment_stmt ::= augtarget augop (expression_list | yield_expression)
   augop ::= "+=" | "-=" | "*=" | "@=" | "/=" | "//=" | "%=" | "**=" | ">>=" | "<<=" | "&=" | "^=" | "|="

+-----------+----------------+
| Operator  | Description    |
+===========+================+
| "x += 1"  | adds one to x  |
+-----------+----------------+

An augmented assignment evaluates the target and the expression list, performs the binary operation
specific to the type of assignment on the two operands, and assigns the result to the original target."""


def test_code_operators_in_programming_text_are_not_symbols() -> None:
    assert quality_problem(normalize(PYTHON_DOC, form="NFC"), SPEC) is None


@pytest.mark.parametrize("line", ["调度器在每一步之前读取分片，同时记录耗时。", "我们把检查点写入对象存储。",
                                  "他从本地磁盘读取验证集，然后才进入下一步。"])
def test_short_chinese_sentences_keep_their_stop_words(line: str) -> None:
    loose = CleaningSpec(min_words=5)
    assert quality_problem(line, loose) is None
