#!/usr/bin/env python3
"""Summarises `engram eval fusion --json` runs: per policy the issue's figures, the median
stage times, and, given a second run of the same questions, the paired differences of tf KL
and gold F1 (bootstrap 95 %).

    summary.py RUN.json [BASE.json]
"""
import json
import random
import statistics
import sys


def ci95(xs, n=10_000, seed=7):
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n)]


def row(name, p):
    st = p.get("stage_ms_median", {})
    stages = ", ".join(f"{k} {v:.1f}" for k, v in sorted(st.items()) if v)
    print(
        f"{name:12} first token {p['first_token_agreement']:.3f} "
        f"(decisive {p['first_token_agreement_decisive']:.3f} of {p['decisive_questions']}), "
        f"answer F1 vs full {p['answer_f1_vs_full']:.3f}, EM {p['answer_em_vs_full']:.3f}, "
        f"tf KL {p['tf_kl_mean']:.4f} / {p['tf_kl_median']:.4f} / {p['tf_kl_p90']:.4f}, "
        f"gold F1 {p['gold_f1']:.3f} {[round(x, 3) for x in p['gold_f1_delta_ci95']]}, "
        f"recompute {p['recompute_fraction']:.3f}, TTFT {p['ttft_ms_median']:.0f} ms, "
        f"{p['ttft_speedup_vs_full']:.1f}x"
    )
    if stages:
        print(f"{'':12} stages (median ms): {stages}")


def per_question_speedup(run, policy):
    full = run["policies"]["full"]["per_question"]["ttft_ms"]
    mine = run["policies"][policy]["per_question"]["ttft_ms"]
    ratios = [f / m for f, m in zip(full, mine)]
    return statistics.median(ratios), statistics.fmean(full) / statistics.fmean(mine)


def main():
    run = json.load(open(sys.argv[1]))
    print(json.dumps(run["config"]))
    for name, p in run["policies"].items():
        row(name, p)
        if name != "full":
            med, of_means = per_question_speedup(run, name)
            print(f"{'':12} per-question speedup median {med:.1f}x, mean TTFT ratio {of_means:.1f}x")
    if len(sys.argv) > 2:
        base = json.load(open(sys.argv[2]))
        for name, p in run["policies"].items():
            if name == "full" or name not in base["policies"]:
                continue
            a = base["policies"][name]["per_question"]
            b = p["per_question"]
            n = min(len(a["question"]), len(b["question"]))
            assert a["question"][:n] == b["question"][:n], "not the same questions"
            a = {k: v[:n] for k, v in a.items()}
            b = {k: v[:n] for k, v in b.items()}
            print(f"{name:12} paired over the first {n} questions")
            for k in ["tf_kl", "gold_f1", "answer_f1_vs_full"]:
                d = [y - x for x, y in zip(a[k], b[k])]
                lo, hi = ci95(d)
                print(f"{name:12} {k} this - base {statistics.fmean(d):+.4f} [{lo:+.4f}, {hi:+.4f}]")
            same = sum(x == y for x, y in zip(a["answer"], b["answer"]))
            print(f"{name:12} same answer as base: {same} of {len(b['answer'])}")


if __name__ == "__main__":
    main()
