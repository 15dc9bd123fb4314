"""Paired per-question differences between two `engram eval fusion --json` runs on the same data.

    python3 paired.py A.json B.json [POLICY]

For each per-question measure: A's mean, B's mean, B - A with a bootstrap 95 % interval
(4,000 resamples, seed 1), and on how many questions B is below A.
"""
import json
import random
import sys

a = json.load(open(sys.argv[1]))["policies"]
b = json.load(open(sys.argv[2]))["policies"]
policy = sys.argv[3] if len(sys.argv) > 3 else "boundary:4"
for key in ["tf_kl", "first_token_agree", "answer_f1_vs_full", "gold_f1", "ttft_ms"]:
    x = [float(v) for v in a[policy]["per_question"][key]]
    y = [float(v) for v in b[policy]["per_question"][key]]
    d = [j - i for i, j in zip(x, y)]
    n = len(d)
    random.seed(1)
    means = sorted(sum(random.choice(d) for _ in range(n)) / n for _ in range(4000))
    print(
        f"{key:18s} A {sum(x) / n:.4f} B {sum(y) / n:.4f} B-A {sum(d) / n:+.4f} "
        f"[{means[100]:+.4f}, {means[3899]:+.4f}] B below A on {sum(v < 0 for v in d)}/{n}"
    )
same = sum(i == j for i, j in zip(a["full"]["per_question"]["answer"], b["full"]["per_question"]["answer"]))
print(f"full prefill's answer the same on {same}/{len(a['full']['per_question']['answer'])}")
