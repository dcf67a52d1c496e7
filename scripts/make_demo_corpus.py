"""Regenerate the bundled demo corpus (deterministic): English and Chinese documents about computing,
with planted exact duplicates, near duplicates and personal data so every `prepare` step has work.

Run: python scripts/make_demo_corpus.py  (writes examples/corpus/)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "examples/corpus"

EN_SUBJECTS = ["The cluster", "Each node", "The scheduler", "A training job", "The data loader", "The optimizer",
               "The checkpoint writer", "Every rank", "The network fabric", "The storage system"]
EN_VERBS = ["reads", "writes", "balances", "measures", "restarts", "shards", "compresses", "verifies",
            "schedules", "streams"]
EN_OBJECTS = ["token shards from local disk", "gradients across data-parallel ranks", "the learning rate schedule",
              "checkpoints to the object store", "activations for the backward pass", "the loss every step",
              "expert weights over the mesh", "the manifest of every shard", "metrics for the dashboard",
              "the pipeline micro-batches"]
EN_TAILS = ["so that no GPU waits.", "before the next step begins.", "while training continues.",
            "to keep utilisation high.", "when a node fails.", "with a hash for every file.",
            "in a fixed order.", "and records the time it took.", "under a strict memory budget.",
            "as the plan predicted."]
ZH_SUBJECTS = ["集群", "每个节点", "调度器", "训练任务", "数据加载器", "优化器", "检查点", "每张卡", "网络", "存储系统"]
ZH_VERBS = ["读取", "写入", "均衡", "测量", "重启", "切分", "压缩", "校验", "调度", "传输"]
ZH_OBJECTS = ["本地磁盘上的分片", "数据并行的梯度", "学习率调度", "对象存储中的检查点", "反向传播的激活值",
              "每一步的损失", "专家权重", "分片清单", "监控指标", "流水线微批次"]
ZH_TAILS = ["，避免算力空转。", "，然后进入下一步。", "，训练不中断。", "，保持较高的利用率。", "，节点故障时自动恢复。",
            "，并记录每个文件的哈希。", "，顺序固定。", "，并记录耗时。", "，显存占用可控。", "，与规划一致。"]
PII_EN = ["Contact the operator at ops.team@example.com for access.",
          "Call the on-call engineer at +1 415 555 0134 if the job stalls.",
          "The node 10.24.3.17 was drained after repeated failures."]
PII_ZH = ["如有问题请拨打 13812345678 联系值班人员。", "负责人邮箱：zhang.wei@example.cn。"]


def sentence(rng: random.Random, zh: bool) -> str:
    if zh:
        return rng.choice(ZH_SUBJECTS) + rng.choice(ZH_VERBS) + rng.choice(ZH_OBJECTS) + rng.choice(ZH_TAILS)
    return " ".join([rng.choice(EN_SUBJECTS), rng.choice(EN_VERBS), rng.choice(EN_OBJECTS), rng.choice(EN_TAILS)])


def document(rng: random.Random, zh: bool) -> str:
    parts = [sentence(rng, zh) for _ in range(rng.randint(6, 18))]
    if rng.random() < 0.08:
        parts.insert(rng.randrange(len(parts)), rng.choice(PII_ZH if zh else PII_EN))
    return ("" if zh else " ").join(parts)


def make(rng: random.Random, *, zh: bool, num_docs: int) -> list[dict[str, str]]:
    docs: list[str] = []
    for i in range(num_docs):
        roll = rng.random()
        if docs and roll < 0.05:
            docs.append(rng.choice(docs))  # exact duplicate
        elif docs and roll < 0.10:
            base = rng.choice(docs)  # near duplicate: one sentence appended
            docs.append(base + ("" if zh else " ") + sentence(rng, zh))
        else:
            docs.append(document(rng, zh))
    return [{"id": f"{'zh' if zh else 'en'}-{i:05d}", "text": t} for i, t in enumerate(docs)]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261129)
    for name, zh, num_docs in (("en.jsonl", False, 600), ("zh.jsonl", True, 400)):
        with open(OUT / name, "w", encoding="utf-8") as f:
            for row in make(rng, zh=zh, num_docs=num_docs):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
