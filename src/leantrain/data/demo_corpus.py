"""The bundled demo corpus, generated on demand (deterministic), so every `prepare` step has work to show.

- `pydoc`: the Python reference topics that ship with CPython (`pydoc_data.topics`, the text `help()`
  shows), one document per paragraph group; falls back to standard-library module docstrings when a
  distribution strips pydoc_data. Real English technical prose with code, so the symbol and
  mean-word-length filters have something to drop.
- `demo-en` / `demo-zh`: generated English and Chinese text about training systems, with planted exact
  duplicates, near duplicates (one sentence changed), low-quality documents (too short, repeated lines,
  symbol soup, no stop words) and sensitive values (emails, phones, IPs, resident IDs, card numbers,
  SSNs, keys), so dedup, the filters and redaction all fire.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from leantrain.data.shards import atomic_write_bytes

EN_SUBJECTS = ["The cluster", "Each node", "The scheduler", "A training job", "The data loader", "The optimizer",
               "The checkpoint writer", "Every rank", "The network fabric", "The storage system", "The planner",
               "The tokenizer", "The monitoring agent", "A pipeline stage", "The router"]
EN_VERBS = ["reads", "writes", "balances", "measures", "restarts", "shards", "compresses", "verifies",
            "schedules", "streams", "caches", "replays", "reduces", "gathers", "prefetches"]
EN_OBJECTS = ["the token shards from local disk", "all of the gradients across ranks", "the learning rate schedule",
              "the checkpoints to the object store", "the activations for the backward pass", "the loss of each step",
              "the expert weights over the mesh", "the manifest of every shard", "the metrics for the dashboard",
              "the pipeline micro-batches", "the optimizer states", "the validation split"]
EN_TAILS = ["so that no GPU waits", "before the next step begins", "while training continues",
            "to keep utilisation high", "when a node fails", "with a hash for every file", "in a fixed order",
            "and records the time it took", "under a strict memory budget", "as the plan predicted",
            "and then reports the result to the operator", "with the help of the launcher"]
ZH_SUBJECTS = ["集群", "每个节点", "调度器", "训练任务", "数据加载器", "优化器", "检查点程序", "每张卡",
               "网络", "存储系统", "规划器", "分词器", "监控程序", "流水线的每一级", "路由器"]
ZH_VERBS = ["读取", "写入", "均衡", "测量", "重启", "切分", "压缩", "校验", "调度", "传输", "缓存", "汇总"]
ZH_OBJECTS = ["本地磁盘上的分片", "数据并行的梯度", "学习率的调度", "对象存储中的检查点", "反向传播的激活值",
              "每一步的损失", "专家的权重", "分片的清单", "监控的指标", "流水线的微批次", "优化器的状态", "验证集"]
ZH_TAILS = ["，这样算力就不会空转", "，然后才进入下一步", "，而训练不会中断", "，以保持较高的利用率",
            "，在节点故障时也能恢复", "，并且记录了每个文件的哈希", "，顺序是固定的", "，同时记录耗时",
            "，显存的占用是可控的", "，和规划的结果一致"]
PII_EN = ["Contact the operator at ops.team@example.com for access.",
          "Call the on-call engineer at +1 415 555 0134 if the job stalls.",
          "The node 10.24.3.17 was drained after repeated failures.",
          "The test card 4111 1111 1111 1111 must never reach the logs.",
          "Her SSN 219-09-9999 was pasted into the ticket by mistake.",
          "The leaked key AKIAIOSFODNN7EXAMPLE was rotated at once.",
          "The config still had password=Tr0ub4dor-and-3 in it."]
PII_ZH = ["如有问题请拨打 13812345678 联系值班人员。", "负责人邮箱：zhang.wei@example.cn。",
          "登记的身份证号 11010519491231002X 应当被遮盖。", "银行卡 6222 0212 3456 7890 128 已经作废。",
          "服务器 192.168.31.7 的密码 token=9f8e7d6c5b4a 已经更换。"]
LOW_QUALITY_EN = ["Click here.", "Buy now! Buy now! Buy now!\nBuy now! Buy now! Buy now!\nBuy now! Buy now! Buy now!",
                  "### $$$ ### $$$ ### @@@ ### $$$ ### $$$ ### @@@ ### $$$ ### $$$ ### @@@ ### $$$ ### $$$ ### @@@ "
                  "### $$$ ### $$$ ### @@@ ### $$$ ### $$$ ### @@@ ###",
                  " ".join(["$$$ best ★★★ price ©©© deal ### today ™™™"] * 7),
                  "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore "
                  "magna aliqua enim minim veniam quis nostrud exercitation ullamco laboris nisi aliquip commodo"]
LOW_QUALITY_ZH = ["点击这里。", "好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好好"]


def _sentence(rng: random.Random, *, zh: bool, parts: tuple[str, str, str, str] | None = None) -> str:
    """One sentence; the numbers make word 5-grams rarely repeat, as in real prose."""
    if zh:
        subject, verb, obj, tail = parts or (rng.choice(ZH_SUBJECTS), rng.choice(ZH_VERBS), rng.choice(ZH_OBJECTS),
                                             rng.choice(ZH_TAILS))
        detail = rng.choice([f"在第{rng.randint(2, 9999)}步", f"用了{rng.randint(2, 90)}秒",
                             f"在{rng.randint(2, 64)}个节点上", f"每{rng.randint(2, 500)}步一次",
                             f"共{rng.randint(2, 900)}个文件"])
        return subject + detail + verb + obj + tail + "。"
    subject, verb, obj, tail = parts or (rng.choice(EN_SUBJECTS), rng.choice(EN_VERBS), rng.choice(EN_OBJECTS),
                                         rng.choice(EN_TAILS))
    detail = rng.choice([f"after {rng.randint(2, 9999)} steps", f"in {rng.randint(2, 90)} seconds",
                         f"on {rng.randint(2, 64)} nodes", f"every {rng.randint(2, 500)} steps",
                         f"for {rng.randint(2, 900)} files"])
    return " ".join([subject, verb, obj, detail, tail]) + "."


def _document(rng: random.Random, *, zh: bool) -> str:
    """Sentences whose subject, object and tail phrases do not repeat within the document."""
    pools = (ZH_SUBJECTS, ZH_VERBS, ZH_OBJECTS, ZH_TAILS) if zh else (EN_SUBJECTS, EN_VERBS, EN_OBJECTS, EN_TAILS)
    num = rng.randint(6, 10)
    picks = [rng.sample(pool, num) if len(pool) >= num else [rng.choice(pool) for _ in range(num)] for pool in pools]
    parts = [_sentence(rng, zh=zh, parts=chosen) for chosen in zip(*picks, strict=True)]
    if rng.random() < 0.15:
        parts.insert(rng.randrange(len(parts)), rng.choice(PII_ZH if zh else PII_EN))
    return ("" if zh else " ").join(parts)


def _near_copy(rng: random.Random, text: str, *, zh: bool) -> str:
    """Replace one sentence of a long document: Jaccard of word 5-grams stays well above 0.85."""
    sep = "。" if zh else ". "
    parts = text.split(sep)
    parts[rng.randrange(len(parts))] = _sentence(rng, zh=zh).rstrip("。.")
    return sep.join(parts)


def generated_docs(*, zh: bool, num_docs: int, seed: int) -> Iterator[dict[str, str]]:
    rng = random.Random(seed)
    docs: list[str] = []
    for i in range(num_docs):
        roll = rng.random()
        if docs and roll < 0.05:
            text = rng.choice(docs)  # exact duplicate
        elif docs and roll < 0.12:
            text = _near_copy(rng, max(rng.sample(docs, min(3, len(docs))), key=len), zh=zh)
        elif roll < 0.16:
            text = rng.choice(LOW_QUALITY_ZH if zh else LOW_QUALITY_EN)
        else:
            text = _document(rng, zh=zh)
        docs.append(text)
        yield {"id": f"{'zh' if zh else 'en'}-{i:05d}", "text": text}


def pydoc_docs() -> Iterator[dict[str, str]]:
    """Python's bundled reference topics, or module docstrings when pydoc_data is not shipped."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        import importlib

        topics = {}
        for name in ("json", "csv", "argparse", "logging", "pathlib", "re", "collections", "itertools", "heapq",
                     "subprocess", "threading", "unittest", "statistics", "fractions", "decimal", "zipfile"):
            topics[name] = importlib.import_module(name).__doc__ or ""
    for key in sorted(topics):
        yield {"id": f"pydoc-{key}", "text": topics[key]}


def builtin_rows(name: str) -> Iterator[dict[str, str]]:
    if name == "pydoc":
        return pydoc_docs()
    if name == "demo-en":
        return generated_docs(zh=False, num_docs=700, seed=20261129)
    if name == "demo-zh":
        return generated_docs(zh=True, num_docs=500, seed=20261130)
    raise ValueError(f"unknown builtin corpus {name!r}")


def materialize(name: str, path: Path) -> Path:
    """Write builtin corpus `name` as jsonl at `path` (atomically) unless it is already there."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(row, ensure_ascii=False) for row in builtin_rows(name)]
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return path
