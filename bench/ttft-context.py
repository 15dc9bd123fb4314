#!/usr/bin/env python3
"""Table and plot of bench/ttft-context.sh's runs: TTFT against prompt length for full prefill,
fused prefill from DRAM and from NVMe, and a prefix-cache hit; tf KL and the noise floor.

    bench/ttft-context.py OUT_DIR LENGTH...   # writes OUT_DIR/summary.md and ttft-context.svg
"""
import json
import math
import statistics
import sys
from pathlib import Path


def main():
    out = Path(sys.argv[1])
    lengths = sys.argv[2:]
    rows = []
    for n in lengths:
        dram = json.loads((out / f"dram-{n}.json").read_text())
        nvme = json.loads((out / f"nvme-{n}.json").read_text())
        pd, pn = dram["policies"], nvme["policies"]
        policy = next(p for p in pd if p not in ("full", "full~", "prefix-hit"))
        cfg = dram["config"]
        rows.append(
            {
                "passage_tokens": int(n),
                "prompt_tokens": cfg.get("prompt_tokens_median"),
                "questions": cfg["questions"],
                "passages": cfg["passages_per_question_mean"],
                "policy": policy,
                "full_ms": pd["full"]["ttft_ms_median"],
                "full_nvme_run_ms": pn["full"]["ttft_ms_median"],
                "dram_ms": pd[policy]["ttft_ms_median"],
                "nvme_ms": pn[policy]["ttft_ms_median"],
                "prefix_ms": pd["prefix-hit"]["ttft_ms_median"],
                "dram_x": pd[policy]["ttft_speedup_vs_full"],
                "nvme_x": pn[policy]["ttft_speedup_vs_full"],
                "prefix_x": pd["prefix-hit"]["ttft_speedup_vs_full"],
                "tf_kl": pd[policy]["tf_kl_mean"],
                "tf_kl_nvme": pn[policy]["tf_kl_mean"],
                "floor_tf_kl": pd["full~"]["tf_kl_mean"],
                "prefix_tf_kl": pd["prefix-hit"]["tf_kl_mean"],
                "kv_ms": pd[policy]["kv_load_ms_median"],
                "kv_ms_nvme": pn[policy]["kv_load_ms_median"],
            }
        )
    lines = [
        "| prompt tokens (median) | passages | full ms | fused DRAM ms (x) | fused NVMe ms (x) "
        "| prefix hit ms (x) | KV load DRAM / NVMe ms | tf KL fused (DRAM / NVMe) | tf KL prefix hit "
        "| tf KL full~ |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {int(r['prompt_tokens'] or r['passage_tokens']):,} | {r['passages']:.1f} "
            f"| {r['full_ms']:,.0f} | {r['dram_ms']:,.0f} ({r['dram_x']:.1f}x) "
            f"| {r['nvme_ms']:,.0f} ({r['nvme_x']:.1f}x) | {r['prefix_ms']:,.0f} ({r['prefix_x']:.1f}x) "
            f"| {r['kv_ms']:.1f} / {r['kv_ms_nvme']:.1f} | {r['tf_kl']:.4f} / {r['tf_kl_nvme']:.4f} "
            f"| {r['prefix_tf_kl']:.4f} | {r['floor_tf_kl']:.4f} |"
        )
    policy = rows[0]["policy"] if rows else "?"
    text = (
        f"TTFT medians over {rows[0]['questions'] if rows else 0} questions per length; fused = "
        f"`{policy}`; (x) = full's TTFT in the same run over this one.\n\n" + "\n".join(lines) + "\n"
    )
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    (out / "ttft-context.svg").write_text(svg(rows, policy))


def svg(rows, policy):
    """A log-scale line plot of TTFT against prompt length, one line per path."""
    w, h, left, right, top, bottom = 640, 400, 70, 170, 30, 50
    xs = [r["prompt_tokens"] or r["passage_tokens"] for r in rows]
    series = [
        ("full prefill", "full_ms", "#d62728"),
        (f"fused {policy}, DRAM", "dram_ms", "#1f77b4"),
        (f"fused {policy}, NVMe", "nvme_ms", "#2ca02c"),
        ("prefix-cache hit", "prefix_ms", "#7f7f7f"),
    ]
    values = [r[k] for r in rows for _, k, _ in series if r[k] > 0]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    x0, x1 = 0, max(xs) * 1.05

    def px(x):
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def py(y):
        return top + (math.log10(hi) - math.log10(y)) / (math.log10(hi) - math.log10(lo)) * (
            h - top - bottom
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="14">Time to first token against prompt length '
        f"(SmolLM2-135M, CPU)</text>",
    ]
    decade = lo
    while decade <= hi:
        y = py(decade)
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        label = f"{decade / 1000:g} s" if decade >= 1000 else f"{decade:g} ms"
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        decade *= 10
    # Round ticks (the measured lengths sit too close together to label each).
    step = 1000 if x1 <= 6000 else 2000
    for x in range(0, int(x1) + 1, step):
        parts.append(
            f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{h - bottom}" y2="{h - bottom + 4}" '
            f'stroke="#999"/>'
        )
        parts.append(
            f'<text x="{px(x):.1f}" y="{h - bottom + 18}" text-anchor="middle">{x:,}</text>'
        )
    parts.append(
        f'<text x="{(left + w - right) / 2:.1f}" y="{h - 12}" text-anchor="middle">'
        f"prompt tokens</text>"
    )
    for i, (name, key, colour) in enumerate(series):
        pts = " ".join(f"{px(x):.1f},{py(r[key]):.1f}" for x, r in zip(xs, rows))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, r in zip(xs, rows):
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(r[key]):.1f}" r="3" fill="{colour}"/>')
        ly = top + 20 + i * 20
        parts.append(
            f'<line x1="{w - right + 10}" x2="{w - right + 30}" y1="{ly}" y2="{ly}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{w - right + 35}" y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
