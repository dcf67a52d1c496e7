"""PII in the formats people write (IPs, phones, e-mails, secrets, bank cards, resident IDs), in English and
Chinese context, and the look-alikes that must stay (versions, order numbers, timestamps, hashes, documentation
IPs)."""

from __future__ import annotations

import string
from collections import Counter

import pytest

from leantrain.data.pii import cn_id_ok, find_pii, luhn_ok

_CN_W = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def _with_luhn(body: str) -> str:
    return body + next(d for d in string.digits if luhn_ok(body + d))


def _id_check(body: str) -> str:
    return "10X98765432"[sum(int(d) * w for d, w in zip(body, _CN_W, strict=True)) % 11]


def _id_that_passes_luhn(*, valid: bool) -> str:
    """An 18-digit resident-ID-shaped number starting 62 (a UnionPay prefix) that passes Luhn."""
    for order in range(1000):
        body = f"62010219850312{order:03d}"
        check = _id_check(body)
        if not valid:
            check = next(d for d in string.digits if d != check and luhn_ok(body + d))
        if check.isdigit() and luhn_ok(body + check) and cn_id_ok(body + check) == valid:
            return body + check
    raise AssertionError("no such number")


UNIONPAY_19 = _with_luhn("621234567890123456")
UNIONPAY_19_GROUPED = " ".join([UNIONPAY_19[i : i + 4] for i in range(0, 16, 4)] + [UNIONPAY_19[16:]])
AMEX = "3782 822463 10005"
JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ.SflKxwRJSMeKKF2QT4fw"
PEM = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n-----END OPENSSH PRIVATE KEY-----"
FULL_WIDTH_MOBILE = "１３８１２３４５６７８"

POSITIVES = [
    # IPs next to CJK characters and punctuation
    ("ip", "联系23.45.67.89。", "23.45.67.89"),
    ("ip", "服务器地址为10.24.3.17，请勿外传", "10.24.3.17"),
    ("ip", "节点2400:cb00:2048:1::6810:1a2b已下线", "2400:cb00:2048:1::6810:1a2b"),
    ("ip", "the node at 172.16.254.1 drained", "172.16.254.1"),
    # IPv6 with an embedded IPv4 tail: mapped, compatible, NAT64 (64:ff9b::/96), SIIT, all eight groups
    ("ip", "peer ::ffff:11.215.58.218 connected", "::ffff:11.215.58.218"),
    ("ip", "客户端::FFFF:23.45.67.89已断开", "::FFFF:23.45.67.89"),
    ("ip", "legacy ::11.215.58.218 route", "::11.215.58.218"),
    ("ip", "via NAT64 64:ff9b::11.215.58.218.", "64:ff9b::11.215.58.218"),
    ("ip", "SIIT ::ffff:0:11.215.58.218 seen", "::ffff:0:11.215.58.218"),
    ("ip", "full 0:0:0:0:0:ffff:11.215.58.218 form", "0:0:0:0:0:ffff:11.215.58.218"),
    ("ip", "listen [::ffff:11.215.58.218]:443", "::ffff:11.215.58.218"),
    # international numbers with spaces or dashes, prefix included
    ("phone", "电话+86 138 1234 5678请回电", "+86 138 1234 5678"),
    ("phone", "call +86-138-1234-5678 today", "+86-138-1234-5678"),
    ("phone", "London office: +44 20 7946 0958.", "+44 20 7946 0958"),
    ("phone", "Berlin: +49 30 12345678", "+49 30 12345678"),
    ("phone", "Berlin: +49-30-1234-5678.", "+49-30-1234-5678"),
    ("phone", "東京 +81 3-1234-5678 まで", "+81 3-1234-5678"),
    ("phone", "携帯 +81 90 1234 5678", "+81 90 1234 5678"),
    # landlines with area codes and brackets
    ("phone", "办公室电话(010) 6552 9988转总机", "(010) 6552 9988"),
    ("phone", "请拨打（0755）8888-1234咨询", "（0755）8888-1234"),
    ("phone", "总机 010-65529988。", "010-65529988"),
    ("phone", "客服 0755 8888 1234", "0755 8888 1234"),
    # full-width digits
    ("phone", f"手机：{FULL_WIDTH_MOBILE}，白天可打", FULL_WIDTH_MOBILE),
    ("email", "邮箱ｌｉ．ｎａ＠ｅｘａｍｐｌｅ．ｃｏｍ。", "ｌｉ．ｎａ＠ｅｘａｍｐｌｅ．ｃｏｍ"),
    # US numbers with spaces
    ("phone", "Call 415 555 0134 after six.", "415 555 0134"),
    ("phone", "Call (415) 555 0134.", "(415) 555 0134"),
    # key/secret assignments: prefixes, any case, after Chinese text
    ("secret", "aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCY"),
    ("secret", "export AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI/K7MDENG"),
    ("secret", "db_password: Tr0ub4dor&3", "Tr0ub4dor&3"),
    ("secret", "GITHUB_TOKEN=abcdef1234567890abcdef", "abcdef1234567890abcdef"),
    ("secret", "配置文件里写着DB_PASSWORD=s3cr3t-pass，别提交", "s3cr3t-pass"),
    ("secret", '{"client_secret": "f00b4rb4zqux"}', "f00b4rb4zqux"),
    ("secret", "数据库密码：Passw0rd!2024，请妥善保管", "Passw0rd!2024"),
    # JWTs and provider key formats
    ("secret", f"Authorization: Bearer {JWT}", JWT),
    ("secret", "OPENAI_KEY sk-proj-Ab12Cd34Ef56Gh78Ij90Kl12", "sk-proj-Ab12Cd34Ef56Gh78Ij90Kl12"),
    ("secret", "key sk-Ab12Cd34Ef56Gh78Ij90Kl12Mn34 leaked", "sk-Ab12Cd34Ef56Gh78Ij90Kl12Mn34"),
    ("secret", "stripe sk_live_4eC39HqLyjWDarjtT1zdp7dc", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("secret", "google AIzaSyA1bC2dE3fG4hI5jK6lM7nO8pQ9rS0tU1v used", "AIzaSyA1bC2dE3fG4hI5jK6lM7nO8pQ9rS0tU1v"),
    ("secret", "token ghp_" + "a1B2" * 9 + " here", "ghp_" + "a1B2" * 9),
    ("secret", "slack xoxb-123456789012-abcdefABCDEF1234 ok", "xoxb-123456789012-abcdefABCDEF1234"),
    ("secret", "密钥AKIAIOSFODNN7EXAMPLE已轮换", "AKIAIOSFODNN7EXAMPLE"),
    ("secret", f"key:\n{PEM}\nend", PEM),
    # cards: Amex 4-6-5, 19-digit UnionPay, grouped and not
    ("bank_card", f"Amex {AMEX} expires 09/27", AMEX),
    ("bank_card", f"银联卡号{UNIONPAY_19}，请核对", UNIONPAY_19),
    ("bank_card", f"卡号 {UNIONPAY_19_GROUPED} 已绑定", UNIONPAY_19_GROUPED),
    # a valid resident ID that also passes Luhn with a card prefix is an ID, not a card
    ("cn_id", f"身份证号{_id_that_passes_luhn(valid=True)}。", _id_that_passes_luhn(valid=True)),
]

LOOK_ALIKES = [
    "Upgrade to version 10.2.3.4 today.", "版本1.2.3.4已发布", "Order 2024112900012345 shipped.",
    "订单号20241129000123已发货", "Timestamp 1732838400123 was logged.", "At 2024-11-29T12:30:45Z it ran.",
    "commit 3f2a9c1d4111111111111111e0b7a6c5d4e3f2a1", "sha256 a94a8fe5ccb19ba61c4c0873d391e987982fbbd3",
    "See the example 192.0.2.15 in RFC 5737.", "文档示例地址198.51.100.7不是真实地址",
    "Docs use 2001:db8::1 as an example.",
    # embedded documentation and loopback IPv4 (nor the IPv4 tail alone) are no values either
    "mapped doc address ::ffff:192.0.2.1 here", "mapped loopback ::ffff:127.0.0.1", "nat64 doc 2001:db8::198.51.100.7",
    "Listen on 127.0.0.1 and 0.0.0.0.", "Batch 4096 x 8 = 32768 tokens.", "max_token = 40960000",
    "num_tokens=123456789", "Set token_budget to 2e12.", "ISBN 978-3-16-148410-0",
    f"number {_id_that_passes_luhn(valid=False)} has a bad ID check digit",  # look-alike: neither ID nor card
    "Room 415 555 at 0134 hours", "call ext. 4521", "坐标 31.2304, 121.4737。",
]


@pytest.mark.parametrize(("kind", "text", "value"), POSITIVES)
def test_each_format_is_found(kind: str, text: str, value: str) -> None:
    findings = [(f.kind, text[f.start : f.end]) for f in find_pii(text)]
    assert (kind, value) in findings, findings


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_look_alikes_stay(text: str) -> None:
    assert find_pii(text) == []


def test_every_kind_has_cases_in_both_languages() -> None:
    kinds = Counter(kind for kind, _, _ in POSITIVES)
    assert set(kinds) == {"ip", "phone", "email", "secret", "bank_card", "cn_id"}
    for kind in ("ip", "phone", "secret", "bank_card"):
        texts = [t for k, t, _ in POSITIVES if k == kind]
        assert any(any("\u4e00" <= c <= "\u9fff" for c in t) for t in texts), kind
        assert any(not any("\u4e00" <= c <= "\u9fff" for c in t) for t in texts), kind


@pytest.mark.parametrize("text", ["peer ::ffff:11.215.58.218 connected", "64:ff9b::11.215.58.218",
                                  "a ::11.215.58.218, b 11.215.58.218", "节点::ffff:11.215.58.218。"])
def test_ipv4_mapped_ipv6_is_redacted_whole(text: str) -> None:
    """The overlap case: the IPv6 hex prefix and the IPv4 inside both match; no octet may be left behind."""
    from leantrain.data.pii import redact

    out = redact(text, find_pii(text))
    assert "215" not in out and "58" not in out and "218" not in out, out
    assert ".<" not in out and ">." not in out, out
    assert all(f.kind == "ip" for f in find_pii(text))
