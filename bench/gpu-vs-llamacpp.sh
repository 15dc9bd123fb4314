#!/usr/bin/env bash
# Engram's GPU path against llama.cpp built with CUDA, on the same GPU in one run (issue 18's
# speed bars); the decode GEMV's block shapes and the fused element-wise kernels against the
# defaults; fused prefill with the stored chunk KV copied layer by layer beside the recompute.
# Random-weight models are made on the GPU machine by `engram gen-model` (it has no network and
# only small files reach it); llama.cpp loads the same files.
#
#   bench/gpu-vs-llamacpp.sh ENGRAM_BINARY LLAMA_BIN_DIR [OUT_DIR]
#
# ENGRAM_BINARY: `cargo build --release --features cuda -p engram-cli`, stripped.
# LLAMA_BIN_DIR: llama-bench, llama-batched-bench and their libraries from a CUDA build of the
# llama.cpp that bench/llamacpp.sh pins (how it was built: docs/bench/2026-11-28-gpu.md).
# Needs libcuda and CUDA 13's libnvrtc, libcublas and libcudart (found under /usr/local/cuda,
# /opt or /usr/lib). Prints JSON lines as it goes (each tagged with its run) and a table of
# ratios at the end. SHAPES="tiny" tries the script out on a machine without a GPU.
#
# What is compared, per model (Llama shapes 7B and 1B, Q4_0 and Q4_K, every layer on the GPU):
#   prefill of 512 tokens     engram gpu bench pp512          llama-bench pp512
#   decode, one sequence      engram gpu bench tg64 x1        llama-bench tg64
#   decode, eight sequences   engram gpu bench tg64 x8        llama-batched-bench -npl 8
# (each sequence after a 512-token context), and on the 7B Q4_0 half the layers on the GPU and
# half on the CPU's cores (`--layers 16` against `-ngl 16`).
set -u
B="${1:?engram binary}"
L="${2:?llama.cpp bin directory}"
OUT_DIR="${3:-.}"
SHAPES="${SHAPES:-7b 1b}"
# Decode variants measured on the first model besides the default and the fused kernels with
# graph replay: the fused kernels alone, graphs alone, and the GEMV block shapes in VARIANTS (rows
# and warps per block, /pN a persistent grid of N blocks per multiprocessor; the run of
# 2026-11-28 measured "r1w4 r4w4 r2w8 r8w2 default/p8"). NCU=1 also profiles one layer's decode
# GEMVs, ours and llama.cpp's, with Nsight Compute (ncu-*.txt in OUT_DIR). SKIP_PARTIAL=1 leaves out
# the half-offloaded 7B; FUSION_SHAPES (default "7b 1b") names the models of the fused prefill.
VARIANTS="${VARIANTS:-}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu-vs-llamacpp.log"
exec > >(tee -a "$LOG") 2>&1
for lib in libcublas.so.13 libnvrtc.so.13 libcudart.so.13; do
    p=$(find /usr/local/cuda/ /usr/local/cuda/lib64/ /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
    [ -n "$p" ] && export LD_LIBRARY_PATH=$(dirname "$p"):${LD_LIBRARY_PATH:-}
done
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
echo "cores: $(nproc)"
"$B" gpu info
G=$(mktemp -d)
trap 'rm -rf "$G"' EXIT
quiet() { grep -v "^ "; }
tag() { sed -u "s|^{|{\"run\":\"$1\",|"; }
T0=$SECONDS
stamp() { echo "## $1 at $((SECONDS - T0)) s"; }

engram_bench() { # tag model args...
    local t=$1 m=$2
    shift 2
    timeout 150 "$B" gpu bench --model "$m" "$@" 2>&1 | quiet | tag "$t"
}
# llama.cpp's figures as JSON lines tagged with the model and layer count.
llama_bench() { # model ngl args...
    local m=$1 ngl=$2
    shift 2
    timeout 120 "$L/llama-bench" -m "$m" -ngl "$ngl" -fa 0 -o jsonl "$@" 2>/dev/null \
        | grep '^{' | tag "llama-bench $(basename "$m" .gguf) ngl=$ngl"
}
llama_batched() { # model
    timeout 120 "$L/llama-batched-bench" -m "$1" -ngl 99 -fa off -c 4800 -b 2048 -ub 512 \
        -npp 512 -ntg 64 -npl 8 --output-format jsonl 2>/dev/null \
        | grep '^{' | tag "llama-batched-bench $(basename "$1" .gguf)"
}

# The fused kernels, graph replay and batched decode agree with the CPU path (tiny models, whole
# and split) and batched decode with each sequence decoded alone; the GEMV shapes too.
stamp "checks"
for t in q4_0 q4_k q4_1 q8_0 q6_k f16; do
    "$B" gen-model --shape tiny --type $t --out "$G/tiny-$t.gguf" >/dev/null
    timeout 60 "$B" gpu check --model "$G/tiny-$t.gguf" --prompt 40 --decode 8 --fuse \
        --batch 4 2>&1 | quiet | tag "check tiny-$t fused graphs"
done
for t in q4_0 q4_k; do
    timeout 60 "$B" gpu check --model "$G/tiny-$t.gguf" --prompt 40 --decode 8 --batch 4 \
        --no-graphs 2>&1 | quiet | tag "check tiny-$t batch"
    for v in $VARIANTS; do
        timeout 60 "$B" gpu check --model "$G/tiny-$t.gguf" --prompt 40 --decode 8 --gemv "$v" \
            2>&1 | quiet | tag "check tiny-$t $v"
    done
done

first=1
for shape in $SHAPES; do
    for t in q4_0 q4_k; do
        m="$G/$shape-$t.gguf"
        name="$shape-$t"
        stamp "$name"
        "$B" gen-model --shape "$shape" --type $t --out "$m" >/dev/null || continue
        if [ "$shape" = 1b ] && [ $t = q4_0 ]; then
            # Against the exact computation, whole and split, one sequence and eight.
            timeout 150 "$B" gpu check --model "$m" --layers all,8 --prompt 64 --decode 8 \
                --f32-reference --fuse --batch 8 2>&1 | quiet | tag "check $name fused graphs"
        fi
        args=(--layers all --prefill 512 --decode 64 --batch 1,8 --repetitions 3)
        engram_bench "engram $name" "$m" "${args[@]}" --no-graphs
        engram_bench "engram $name fused" "$m" "${args[@]}" --fuse
        llama_bench "$m" 99 -p 512 -n 64 -r 3
        llama_batched "$m"
        if [ $first = 1 ]; then
            engram_bench "engram $name fuse-only" "$m" "${args[@]}" --fuse --no-graphs
            engram_bench "engram $name graphs-only" "$m" "${args[@]}"
            for v in $VARIANTS; do
                engram_bench "engram $name $v" "$m" --layers all --prefill 512 --decode 64 \
                    --batch 1,8 --repetitions 1 --gemv "$v" --no-graphs
            done
            if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
                # One layer's decode GEMVs, ours and llama.cpp's, through the profiler.
                sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis
                    --section Occupancy --section LaunchStats --section WarpStateStats)
                timeout 150 ncu --clock-control none --kernel-name regex:gemv_q8_ \
                    --launch-skip 300 --launch-count 4 "${sections[@]}" "$B" gpu bench \
                    --model "$m" --layers all --prefill 16 --decode 16 --batch 1 \
                    --repetitions 1 --no-graphs > "$OUT_DIR/ncu-engram.txt" 2>&1
                timeout 150 ncu --clock-control none --kernel-name regex:mul_mat_vec \
                    --launch-skip 300 --launch-count 4 "${sections[@]}" "$L/llama-bench" \
                    -m "$m" -ngl 99 -fa 0 -p 0 -n 32 -r 1 > "$OUT_DIR/ncu-llamacpp.txt" 2>&1
                grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Block Size|Grid Size" \
                    "$OUT_DIR"/ncu-*.txt | head -120
            fi
        fi
        if [ "$shape" = 7b ] && [ $t = q4_0 ] && [ -z "${SKIP_PARTIAL:-}" ]; then
            stamp "$name half on the CPU"
            engram_bench "engram $name ngl=16" "$m" --layers 16 --prefill 512 --decode 16 \
                --batch 1 --repetitions 1 --no-graphs
            llama_bench "$m" 16 -p 512 -n 16 -r 1 -t "$(nproc)"
        fi
        if [ $t = q4_0 ] && [[ " ${FUSION_SHAPES:-7b 1b} " == *" $shape "* ]]; then
            stamp "$shape fused prefill"
            timeout 200 "$B" gpu fusion --model "$m" --recompute 4,0,16 --timeline 2>&1 \
                | quiet | tag "fusion $shape"
        fi
        first=0
        rm -f "$m"
    done
done
stamp "done"

python3 - "$LOG" $SHAPES <<'EOF'
import json, sys
rows = []
for line in open(sys.argv[1]):
    if line.startswith('{"run"'):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
def find(run, **kv):
    for r in rows:
        if r["run"] == run and all(r.get(k) == v for k, v in kv.items()):
            return r
    return None
print("checks failed:", [r["run"] for r in rows if r["run"].startswith("check")
                         and ((r.get("vs_cpu") or {}).get("argmax_agreement", 1) < 0.5
                              or r.get("pass") is False)])
print("graph errors:", sorted({r["graph_error"] for r in rows if r.get("graph_error")}))
print("engram: launch by launch (--no-graphs); fused: fused kernels and graphs (--fuse); "
      "graphs-only is the default; ratio: engram / llama.cpp")
print(f"{'model':10} {'figure':10} {'engram':>9} {'fused':>9} {'llama.cpp':>10} {'ratio':>6} {'fused':>6}")
for shape in sys.argv[2:]:
    for t in ("q4_0", "q4_k"):
        name = f"{shape}-{t}"
        peer = {
            "pp512": find(f"llama-bench {name} ngl=99", n_prompt=512, n_gen=0),
            "tg64 x1": find(f"llama-bench {name} ngl=99", n_prompt=0, n_gen=64),
            "tg64 x8": find(f"llama-batched-bench {name}"),
        }
        for fig, p in peer.items():
            o = find(f"engram {name}", test=fig)
            f = find(f"engram {name} fused", test=fig)
            pv = p and (p.get("avg_ts") or p.get("speed_tg"))
            ov = o and o["tokens_per_s"]
            fv = f and f["tokens_per_s"]
            cell = lambda v: f"{v:9.1f}" if v else f"{'-':>9}"
            ratio = lambda v: f"{v / pv:6.2f}" if v and pv else f"{'-':>6}"
            print(f"{name:10} {fig:10} {cell(ov)} {cell(fv)} {cell(pv):>10} {ratio(ov)} {ratio(fv)}")
        for r in rows:
            if r["run"].startswith(f"engram {name} ") and "tokens_per_s" in r and r["test"].startswith("tg"):
                if r["run"].endswith(" fused") or "ngl" in r["run"]:
                    continue
                print(f"{'':10} {r['test']:10} {r['tokens_per_s']:9.1f}  {r['run'].split()[-1]}"
                      f"  {r.get('decode_fraction_of_copy', 0):.2f} of copy")
ours = [find("engram 7b-q4_0 ngl=16", test=t) for t in ("pp512", "tg16 x1")]
peer = [find("llama-bench 7b-q4_0 ngl=16", n_prompt=512, n_gen=0),
        find("llama-bench 7b-q4_0 ngl=16", n_prompt=0, n_gen=16)]
for fig, o, p in zip(("pp512/16", "tg16/16"), ours, peer):
    if o and p:
        print(f"{'7b-q4_0':10} {fig:10} {o['tokens_per_s']:9.1f} {'':9} {p['avg_ts']:10.1f} {o['tokens_per_s'] / p['avg_ts']:6.2f}")
for r in rows:
    if r["run"].startswith("fusion") and "policy" in r and "layer" not in r:
        print(r["run"], r["policy"], "ttft_ms", round(r["ttft_ms"], 1),
              "overlapped", round(r.get("overlapped_ttft_ms", 0), 1),
              "x", round(r.get("speedup_vs_full", 0), 1), round(r.get("overlapped_speedup_vs_full", 0), 1),
              "diff", r.get("overlapped_vs_serial_max_abs"))
EOF
