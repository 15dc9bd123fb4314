#!/usr/bin/env bash
# TTFT against context length, the figure a buyer compares: RAG prompts of about 1.6k, 2k, 4k and
# 8k tokens (held-out XQuAD-en questions, the gold paragraph among others until the passages
# reach the length), each answered by full prefill, by fused prefill with the chunk KV from the
# DRAM tier and from the NVMe tier (O_DIRECT), and by a prefix-cache hit (the same passages in
# the same order, asked about again), with tf KL and the noise floor (`full~`) at each length.
#
#   bench/ttft-context.sh [OUT_DIR]     # default docs/bench/ttft-context
#
# Environment: QUESTIONS per length (default 8), LENGTHS (passage tokens, default "300 700 2700
# 6400"; "1000 2700 6400" for the Chinese sets): the default layout's prompt opens with about 1,300 tokens of chat template, system
# prompt, instructions and neutral passages (the prefix cache serves them), so the prompts are
# about 1.6k, 2k, 4k and 8k tokens; the default model's context is 8,192), POLICY (default boundary:4, engramd's default), SET (xquad-en, or
# xquad-zh / cmrc2018 for Chinese), ENGRAM (the engram binary; default
# target/${ENGRAM_PROFILE:-release}/engram, built if missing), NVME_DIR (the NVMe tier's folder;
# default OUT_DIR/nvme, so on the disk OUT_DIR is on). Writes one `eval fusion --json` per
# length and tier, then `summary.md` and `ttft-context.svg` (bench/ttft-context.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/ttft-context}
QUESTIONS=${QUESTIONS:-8}
# A Chinese paragraph takes 2-3 of the default model's tokens a character: most of CMRC2018's
# are longer than 300 tokens, so the Chinese sets start at 1,000.
case ${SET:-xquad-en} in
xquad-en) LENGTHS=${LENGTHS:-"300 700 2700 6400"} ;;
*) LENGTHS=${LENGTHS:-"1000 2700 6400"} ;;
esac
POLICY=${POLICY:-boundary:4}
SET=${SET:-xquad-en}
PROFILE=${ENGRAM_PROFILE:-release}
ENGRAM=${ENGRAM:-target/$PROFILE/engram}
NVME_DIR=${NVME_DIR:-$OUT/nvme}

if [[ ! -x "$ENGRAM" ]]; then
    cargo build --profile "$PROFILE" -p engram-cli
fi
scripts/fetch-models.sh >/dev/null
mkdir -p "$OUT"
isa=$(grep -owE 'avx2|avx512f|avx512_vnni|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')
echo "ttft-context: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs ($isa); \
$SET, $QUESTIONS questions per length, policy $POLICY" | tee "$OUT/machine.txt"
for n in $LENGTHS; do
    max=$((n + n / 20))
    "$ENGRAM" eval fusion-set --set "$SET" --out "$OUT/set-$n.json" --questions "$QUESTIONS" \
        --tokens "$n" --max-tokens "$max"
    # DRAM: full, full~ (the noise floor), the policy, and the prefix-cache hit.
    "$ENGRAM" eval fusion --data "$OUT/set-$n.json" --policies "$POLICY" --tier dram \
        --prefix-hit --json >"$OUT/dram-$n.json"
    # NVMe: full again (always run, the reference) and the policy.
    rm -rf "$NVME_DIR"
    "$ENGRAM" eval fusion --data "$OUT/set-$n.json" --policies "$POLICY" --tier nvme \
        --nvme-dir "$NVME_DIR" --no-noise-floor --json >"$OUT/nvme-$n.json"
    rm -rf "$NVME_DIR"
done
python3 bench/ttft-context.py "$OUT" $LENGTHS
