#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/bench/2026-11-26-gpu.md, as run on the GPU machine:
# random-weight models made there by `engram gen-model` (the machine has no network and only
# small files reach it), the GPU path checked against the CPU path on the quantised and on
# f32-dequantised weights, then prefill and decode speed with per-kind profiles, and fused
# prefill from host-memory chunk KV against full prefill.
#
#   bench/gpu.sh ENGRAM_BINARY [OUT_DIR] [SMOLLM2_GGUF GOLDEN_JSON]
#
# ENGRAM_BINARY: `cargo build --release --features cuda -p engram-cli`, stripped. With the real
# SmolLM2 and ../shared/golden/smollm2-135m-q4_1.llamacpp.json, also its golden check.
# Needs libcuda and CUDA 13's libnvrtc and libcublas (found under /usr/local/cuda or /opt); of
# the NVRTCs found engram takes the newest not newer than the driver (ENGRAM_NVRTC names one).
set -u
B="${1:?engram binary}"
OUT_DIR="${2:-.}"
SMOL="${3:-}"
GOLDEN="${4:-}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu.log") 2>&1
for lib in libcublas.so.13 libnvrtc.so.13; do
    p=$(find /usr/local/cuda/ /usr/local/cuda/lib64/ /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
    [ -n "$p" ] && export LD_LIBRARY_PATH=$(dirname "$p"):${LD_LIBRARY_PATH:-}
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$B" gpu info
G=$(mktemp -d)
trap 'rm -rf "$G"' EXIT
quiet() { grep -v "^ "; }   # drop backtrace lines of a failed check, keep its JSON

# Correctness: every weight type on the tiny shape, whole and split; 1B Q4_0 and Q4_K.
for t in q4_0 q4_1 q8_0 q4_k q6_k f16; do
    "$B" gen-model --shape tiny --type $t --out "$G/tiny-$t.gguf" >/dev/null
    timeout 60 "$B" gpu check --model "$G/tiny-$t.gguf" --layers all,half --prompt 40 --decode 8 --f32-reference 2>&1 | quiet
done
for t in q4_0 q4_k; do
    "$B" gen-model --shape 1b --type $t --out "$G/1b-$t.gguf" >/dev/null
    timeout 120 "$B" gpu check --model "$G/1b-$t.gguf" --layers all,8 --prompt 64 --decode 8 --f32-reference 2>&1 | quiet
done
if [[ -n "$SMOL" && -n "$GOLDEN" ]]; then
    timeout 200 "$B" gpu check --model "$SMOL" --golden "$GOLDEN" --layers all,15 --f32-reference 2>&1 | quiet
    timeout 100 "$B" gpu bench --model "$SMOL" --prefill 512,2048 --decode 64 --batch 1,8 2>&1 | quiet
fi

# Speed: 1B and 7B, Q4_0 and Q4_K; 7B Q4_0 also at a 4,096-token context and half offloaded.
timeout 120 "$B" gpu bench --model "$G/1b-q4_0.gguf" --prefill 512 --decode 64 --batch 1,8 2>&1 | quiet
rm -f "$G"/1b-*
for t in q4_0 q4_k; do
    "$B" gen-model --shape 7b --type $t --out "$G/7b-$t.gguf" >/dev/null
    prof=""
    [ $t = q4_0 ] && prof=--profile
    timeout 150 "$B" gpu bench --model "$G/7b-$t.gguf" --prefill 512,2048 --decode 64 --batch 1,2,4,8 --repetitions 2 $prof 2>&1 | quiet
    if [ $t = q4_0 ]; then
        timeout 100 "$B" gpu bench --model "$G/7b-$t.gguf" --prefill 4096 --decode 64 --batch 1 --decode-context 4096 --repetitions 1 2>&1 | quiet
        timeout 120 "$B" gpu bench --model "$G/7b-$t.gguf" --layers half --prefill 512 --decode 16 --batch 1 --repetitions 1 2>&1 | quiet
    fi
    rm -f "$G/7b-$t.gguf"
done

# Fused prefill from host-memory chunk KV against full prefill (10 passages of 600 tokens).
for shape in 1b 7b; do
    "$B" gen-model --shape $shape --type q4_0 --out "$G/$shape.gguf" >/dev/null
    timeout 200 "$B" gpu fusion --model "$G/$shape.gguf" --recompute 0,4,16,600 2>&1 | quiet
    rm -f "$G/$shape.gguf"
done
