"""Sensitive information: a generated labelled set (EN + ZH) for recall / false positives, and the audit rows."""

from __future__ import annotations

import random
import string

import pytest

from leantrain.data.pii import PIIRedactor, bank_card_ok, cn_id_ok, find_pii, luhn_ok, redact

_CN_W = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def _cn_id(rng: random.Random) -> str:
    body = f"{rng.choice(['110101', '310104', '440305', '510107'])}{rng.randint(1950, 2010)}" \
           f"{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}{rng.randint(0, 999):03d}"
    return body + "10X98765432"[sum(int(d) * w for d, w in zip(body, _CN_W, strict=True)) % 11]


def _card(rng: random.Random) -> str:
    prefix = rng.choice(["4", "51", "55", "62", "37", "6011"])
    length = 15 if prefix == "37" else rng.choice([16, 16, 19]) if prefix == "62" else 16
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    check = next(d for d in string.digits if luhn_ok(body + d))
    digits = body + check
    return " ".join(digits[i : i + 4] for i in range(0, len(digits), 4)) if rng.random() < 0.5 else digits


def _phone(rng: random.Random) -> str:
    d = lambda n: "".join(rng.choice(string.digits) for _ in range(n))  # noqa: E731
    return rng.choice([
        f"+1 {rng.randint(201, 989)} {d(3)} {d(4)}", f"+86 13{d(1)} {d(4)} {d(4)}", f"+44 20 {d(4)} {d(4)}",
        f"+{rng.randint(30, 49)}{d(9)}", f"1{rng.randint(3, 9)}{d(9)}", f"({rng.randint(201, 989)}) {d(3)}-{d(4)}",
        f"{rng.randint(201, 989)}-{d(3)}-{d(4)}", f"010-{d(8)}", f"0755-{d(7)}", f"15{d(1)}-{d(4)}-{d(4)}",
    ])


def _secret(rng: random.Random) -> str:
    alnum = string.ascii_letters + string.digits
    pick = lambda chars, n: "".join(rng.choice(chars) for _ in range(n))  # noqa: E731
    return rng.choice([
        "AKIA" + pick(string.ascii_uppercase + string.digits, 16), "ghp_" + pick(alnum, 36),
        "xoxb-" + pick(string.digits, 12) + "-" + pick(alnum, 24), "github_pat_" + pick(alnum + "_", 40),
        "-----BEGIN RSA PRIVATE KEY-----\nMIIE" + pick(alnum, 60) + "\n-----END RSA PRIVATE KEY-----",
    ])


def _value(kind: str, rng: random.Random) -> str:
    h = lambda: f"{rng.randint(0, 65535):x}"  # noqa: E731
    return {
        "email": lambda: f"{rng.choice(['li.na', 'ops', 'j.smith+ml', 'wang_wei'])}{rng.randint(1, 99)}@"
                         f"{rng.choice(['example.com', 'mail.qq.com', 'corp.example.cn'])}",
        "phone": lambda: _phone(rng),
        # not the documentation ranges (192.0.2.0/24, 2001:db8::/32 ...) or loopback: those stay, by design
        "ip": lambda: rng.choice([".".join(str(rng.randint(1 if i == 0 else 0, 126 if i == 0 else 255))
                                           for i in range(4)),
                                  f"2400:cb00:{h()}:{h()}::{h()}", f"fe80::{h()}:{h()}:{h()}:{h()}"]),
        "cn_id": lambda: _cn_id(rng),
        "bank_card": lambda: _card(rng),
        "us_ssn": lambda: f"{rng.randint(1, 665):03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}",
        "secret": lambda: _secret(rng),
    }[kind]()


TEMPLATES_EN = ["Please contact {} about the invoice.", "Record: {}.", "The value {} was logged at noon.",
                "Send it to {} before Friday."]
TEMPLATES_ZH = ["请联系{}处理。", "用户信息：{}，请核对。", "记录显示{}已经登记。", "备注 {} 已确认"]
NEGATIVES = [
    "Released on 2024-01-15 as version 3.10.12.", "发布日期：2024年11月29日，版本 v2.13.0。",
    "Order #20241129000123 shipped.", "订单号 2024112900012345 已发货。", "The meeting is at 12:30:45 UTC.",
    "It costs $1,234.56 in total.", "ISBN 978-3-16-148410-0 is on the shelf.", "Throughput rose 12.5% to 3.4.5.6x",
    "Build 1732838400123 passed.", "Timestamp 1732838400 was recorded.", "第 3 章第 12 节，共 2048 页。",
    "The GPU has 80 GB and 3.35 TB/s.", "Use torch 2.13.0 with CUDA 12.8.1.", "Call ext. 4521 or room 1203.",
    "Batch 4096 × 8 = 32768 tokens.", "坐标 31.2304, 121.4737。", "Ratio 16:9 at 1920x1080.",
    "The password field must not be empty.", "Set token_budget to 2e12.", "Postcode 100086, 北京市海淀区。",
    "Invoice 2023-0045-7781 is overdue.", "Lot 20241129-0007 passed QA.", "See RFC 7231 section 6.5.1.",
    "Serial 1-800-FLOWERS is a brand name.", "He scored 98.6 out of 100.", "Chapter 10.2.3.1 describes it.",
]


def _labelled(seed: int, per_kind: int) -> tuple[list[tuple[str, str, str]], list[str]]:
    rng = random.Random(seed)
    positives = []
    for kind in ("email", "phone", "ip", "cn_id", "bank_card", "us_ssn", "secret"):
        for i in range(per_kind):
            value = _value(kind, rng)
            template = (TEMPLATES_ZH if i % 2 else TEMPLATES_EN)[i % 4]
            positives.append((kind, value, template.format(value)))
    negatives = [f"{rng.choice(TEMPLATES_EN[:1] + TEMPLATES_ZH[:1]).format('the team')} {neg}" for neg in NEGATIVES]
    rng2 = random.Random(seed + 1)
    for _ in range(300):  # random dates, versions, order numbers, amounts, times
        negatives.append(rng2.choice([
            f"Date {rng2.randint(1990, 2030)}-{rng2.randint(1, 12):02d}-{rng2.randint(1, 28):02d}.",
            f"版本 {rng2.randint(0, 20)}.{rng2.randint(0, 40)}.{rng2.randint(0, 99)} 已发布。",
            f"Order {rng2.randint(2015, 2026)}{rng2.randint(10**9, 10**10 - 1)} confirmed.",
            f"金额 {rng2.randint(1, 99999)}.{rng2.randint(0, 99):02d} 元。",
            f"Time {rng2.randint(0, 23):02d}:{rng2.randint(0, 59):02d}:{rng2.randint(0, 59):02d}.",
            f"Step {rng2.randint(0, 10**6)} loss {rng2.random():.4f}.",
        ]))
    return positives, negatives


def test_recall_and_false_positives_on_labelled_set() -> None:
    positives, negatives = _labelled(seed=11, per_kind=60)
    missed = []
    for kind, value, text in positives:
        hits = [f for f in find_pii(text) if f.kind == kind and text[f.start : f.end] == value]
        if not hits:
            missed.append((kind, value, find_pii(text)))
    recall = 1 - len(missed) / len(positives)
    assert recall >= 0.98, missed[:10]
    for kind in {k for k, _, _ in positives}:  # and per kind
        assert sum(m[0] == kind for m in missed) / sum(k == kind for k, _, _ in positives) <= 0.02, kind
    false_positive = [(text, find_pii(text)) for text in negatives if find_pii(text)]
    assert len(false_positive) / len(negatives) <= 0.01, false_positive


@pytest.mark.parametrize(("kind", "text", "value"), [
    ("phone", "如有问题请拨打13812345678联系值班人员。", "13812345678"),
    ("email", "负责人邮箱：zhang.wei@example.cn。", "zhang.wei@example.cn"),
    ("ip", "node 10.24.3.17 drained", "10.24.3.17"),
    ("secret", "api_key = 'sk_live_abcdef123456'", "sk_live_abcdef123456"),
    ("secret", "password: hunter2hunter2", "hunter2hunter2"),
    ("us_ssn", "SSN 123-45-6789.", "123-45-6789"),
])
def test_examples_found(kind: str, text: str, value: str) -> None:
    (finding,) = find_pii(text)
    assert finding.kind == kind and text[finding.start : finding.end] == value


def test_validators() -> None:
    assert cn_id_ok("11010519491231002X") and not cn_id_ok("110105194912310021")
    assert not cn_id_ok("110105194913310020")  # month 13
    assert bank_card_ok("4111 1111 1111 1111") and not bank_card_ok("4111 1111 1111 1112")
    assert not bank_card_ok("9111111111111111")  # no network prefix
    assert find_pii("IP 999.1.1.1 and v1.2.3.4.5") == []
    assert find_pii("SSN 666-12-3456 and 000-12-3456") == []


def test_redaction_and_audit_never_hold_the_value() -> None:
    redactor = PIIRedactor(types=["email", "phone"], salt=b"s")
    text = "Mail ops@example.com or call +1 415 555 0134. SSN 123-45-6789 stays (type off)."
    out, audit = redactor(text, doc_id="d1", source="en")
    assert out == "Mail <EMAIL> or call <PHONE>. SSN 123-45-6789 stays (type off)."
    assert redactor.counts == {"email": 1, "phone": 1}
    assert [a["type"] for a in audit] == ["email", "phone"]
    assert text[audit[0]["start"] : audit[0]["end"]] == "ops@example.com"  # type: ignore[misc]
    assert "ops@example.com" not in str(audit) and len(str(audit[0]["value_sha256"])) == 32
    other = PIIRedactor(types=["email"], salt=b"t")
    assert other.value_hash("ops@example.com") != redactor.value_hash("ops@example.com")
    assert redact("abc", []) == "abc"
