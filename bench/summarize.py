#!/usr/bin/env python3
"""Summarises a bench/vs-llamacpp.sh run: a table of medians and two machine-readable lines

    BANDWIDTH read_gbs=R decode_gbs=D decode_fraction=F llamacpp_fraction=L
    RATIO prefill512=X prefill2048=Y decode512=Z rss=W

Reads the raw files the script leaves in its work folder, FIGURE__SIDE__REP.{json,time}, where
SIDE is engram, llama_fa0 or llama_fa1, and read__REP.bandwidth (`engram bench
--read-bandwidth --json`). Standard library only.
"""

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SIDES = ("engram", "llama_fa0", "llama_fa1")
ORDER = ("prefill128", "prefill512", "prefill2048", "prefill4096", "decode512")


def parse_time(path):
    """Peak RSS (MiB) and wall seconds from a `/usr/bin/time -v` report."""
    text = path.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", text)
    secs = None
    if wall:
        h, m, s = wall.groups()
        secs = int(h or 0) * 3600 + int(m) * 60 + float(s)
    return (int(rss.group(1)) / 1024 if rss else None), secs


def engram_figure(fig, report):
    """tok/s for FIG from one `engram bench --json` report, and its self-reported figures."""
    if fig.startswith("decode"):
        tps = report["decode"]["tokens_per_second"]
    else:
        tps = report["prefill"][0]["tokens_per_second"]
    return tps, report.get("model_load_ms"), report.get("peak_rss_mib")


def llama_figure(fig, tests):
    """tok/s for FIG from one `llama-bench -o json` array (one test per run)."""
    if not tests:
        raise ValueError("llama-bench printed no test")
    t = tests[-1]
    return t["avg_ts"], t


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--have-depth", type=int, default=1)
    ap.add_argument("--label", default="", help="weight type: RATIO[label] and BANDWIDTH[label]")
    args = ap.parse_args()

    tps = defaultdict(lambda: defaultdict(list))   # fig -> side -> [tok/s]
    rss = defaultdict(lambda: defaultdict(list))   # fig -> side -> [MiB, time -v]
    wall = defaultdict(list)                       # side -> [s] (load figure)
    engram_load_ms, engram_self_rss = [], defaultdict(list)
    llama_info = {}
    engram_kernels = set()                         # `kernels` of Engram's runs (ISA, +amx)
    decode_bytes = []                              # bytes one decode step reads (Engram's count)
    read_gbs = [json.loads(p.read_text())["read_gbs"] for p in sorted(args.work.glob("read__*.bandwidth"))]

    for path in sorted(args.work.glob("*__*__*.json")):
        fig, side, _rep = path.stem.split("__")
        data = json.loads(path.read_text())
        r, w = parse_time(path.with_suffix(".time"))
        rss[fig][side].append(r)
        if side == "engram":
            t, load_ms, self_rss = engram_figure(fig, data)
            if fig.startswith("decode") and data["decode"].get("bytes_per_token"):
                decode_bytes.append(data["decode"]["bytes_per_token"])
            engram_load_ms.append(load_ms)
            engram_self_rss[fig].append(self_rss)
            if data.get("kernels"):
                engram_kernels.add(data["kernels"])
        else:
            t, info = llama_figure(fig, data)
            llama_info = info
        if fig == "load":
            wall[side].append(w)
        else:
            tps[fig][side].append(t)

    figs = [f for f in ORDER if f in tps]
    if not figs:
        sys.exit("summarize: no results in %s" % args.work)
    reps = max(len(v) for f in figs for v in tps[f].values())

    if llama_info:
        print(f"llama-bench build {llama_info.get('build_commit')} ({llama_info.get('build_number')}), "
              f"backend {llama_info.get('backends')}, cpu_info {llama_info.get('cpu_info')!r}, "
              f"n_batch {llama_info.get('n_batch')}, n_ubatch {llama_info.get('n_ubatch')}")
    if engram_kernels:
        print(f"engram kernels {', '.join(sorted(engram_kernels))}")
    print(f"throughput, tokens/s, median of {reps} alternating runs per side "
          "(each run a fresh process, one repetition after warm-up)")
    head = f"{'figure':<13}{'engram':>10}{'llama fa0':>11}{'llama fa1':>11}{'llama best':>12}{'E/L best':>10}"
    print(head)
    print("-" * len(head))
    ratios = {}
    for f in figs:
        e = med(tps[f]["engram"])
        l0, l1 = med(tps[f]["llama_fa0"]), med(tps[f]["llama_fa1"])
        best = max((v for v in (l0, l1) if v is not None), default=None)
        ratios[f] = ratio(e, best)
        print(f"{f:<13}{fmt(e):>10}{fmt(l0):>11}{fmt(l1):>11}{fmt(best):>12}{fmt(ratios[f], 2):>10}")
    if not args.have_depth and "decode512" in figs:
        print("note: this llama-bench has no -d; its decode512 is -pg 512,128, i.e. (512+128) tokens "
              "over prefill+decode time, NOT comparable with Engram's decode-only figure")

    print()
    print("load and memory (medians)")
    e_wall, l_wall = med(wall["engram"]), med(wall["llama_fa0"])
    print(f"  startup wall, load + ~16-token prefill (time -v): engram {fmt(e_wall, 2)} s, "
          f"llama.cpp {fmt(l_wall, 2)} s, ratio {fmt(ratio(e_wall, l_wall), 2)}")
    print(f"  engram model_load_ms (self-reported, all runs): {fmt(med(engram_load_ms), 0)} ms "
          "(llama-bench does not report load time)")
    print(f"  peak RSS, MiB ('Maximum resident set size' from /usr/bin/time -v):")
    print(f"    {'figure':<13}{'engram':>9}{'(self)':>9}{'llama fa0':>11}{'llama fa1':>11}")
    e_all, l_all = [], []
    for f in ["load"] + figs:
        e, es = med(rss[f]["engram"]), med(engram_self_rss[f])
        l0, l1 = med(rss[f]["llama_fa0"]), med(rss[f]["llama_fa1"])
        e_all.append(e)
        l_all += [l0, l1]
        print(f"    {f:<13}{fmt(e):>9}{fmt(es):>9}{fmt(l0):>11}{fmt(l1):>11}")
    e_peak = max((v for v in e_all if v is not None), default=None)
    l_peak = max((v for v in l_all if v is not None), default=None)
    rss_ratio = ratio(e_peak, l_peak)
    print(f"  largest peak RSS: engram {fmt(e_peak)} MiB, llama.cpp {fmt(l_peak)} MiB, "
          f"ratio {fmt(rss_ratio, 2)}")

    def r(f):
        v = ratios.get(f)
        return "NA" if v is None else f"{v:.2f}"

    tag = f"[{args.label}]" if args.label else ""
    bandwidth = None
    if read_gbs and decode_bytes and "decode512" in tps:
        read, per_token = med(read_gbs), med(decode_bytes)
        e = med(tps["decode512"]["engram"])
        best = max((v for v in (med(tps["decode512"][s]) for s in ("llama_fa0", "llama_fa1"))
                    if v is not None), default=None)
        e_gbs = per_token * e / 1e9
        l_gbs = None if best is None else per_token * best / 1e9
        print()
        print(f"decode against the memory limit (read bandwidth: median of {len(read_gbs)} probes, "
              f"each the best of 3 passes over 1 GiB on {llama_info.get('n_threads', '?')} threads)")
        print(f"  memory read {read:.1f} GB/s; one decode step reads {per_token / 2**20:.1f} MiB "
              "(weights once, one embedding row, the KV of 576 tokens)")
        print(f"  engram {e_gbs:.1f} GB/s = {e_gbs / read:.2f} of it; llama.cpp "
              f"{fmt(l_gbs)} GB/s = {fmt(ratio(l_gbs, read), 2)}")
        bandwidth = (f"BANDWIDTH{tag} read_gbs={read:.1f} decode_gbs={e_gbs:.1f} "
                     f"decode_fraction={e_gbs / read:.2f} "
                     f"llamacpp_fraction={'NA' if l_gbs is None else f'{l_gbs / read:.2f}'}")

    print()
    if bandwidth:
        print(bandwidth)
    print(f"RATIO{tag} prefill512={r('prefill512')} prefill2048={r('prefill2048')} "
          f"decode512={r('decode512')} rss={'NA' if rss_ratio is None else f'{rss_ratio:.2f}'}")


if __name__ == "__main__":
    main()
