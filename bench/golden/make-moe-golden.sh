#!/usr/bin/env bash
# Regenerates tests/golden/moe-tiny.llamacpp.json, the mixture-of-experts golden file that
# tests/engine_golden_moe.rs holds the engine to. Needs the network only to build llama.cpp
# the first time (bench/llamacpp.sh, cached outside the repository); not part of CI.
#
#   bench/golden/make-moe-golden.sh
#
# 1. `engram gen-model` writes each tiny mixture-of-experts shape: tiny-qwen3moe (qwen3moe,
#    Q4_K experts with Q8_0 down projections) and tiny-mixtral (llama with experts, Q4_0);
# 2. kquant_golden.cpp (built against llama.cpp's static libraries, as make-kquant-golden.sh
#    does) runs each on the same token-id prompts, then again with flash attention on;
# 3. the golden file is written with each model's sha256 and the command that made it.
#
# Run it again whenever `engram gen-model` changes what it writes for these shapes: the test
# then fails on the sha256 and says so.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$repo_root/bench/golden"

log() { echo "make-moe-golden: $*" >&2; }
die() { echo "make-moe-golden: error: $*" >&2; exit 1; }

[[ $# -eq 0 ]] || { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# shellcheck source=bench/llamacpp.sh
source "$repo_root/bench/llamacpp.sh"

out="$repo_root/tests/golden/moe-tiny.llamacpp.json"
work="${TMPDIR:-/tmp}/engram-moe-golden"
threads=2
command -v python3 >/dev/null || die "python3 is needed"
mkdir -p "$work" "$(dirname "$out")"

build_kquant_golden "$work/kquant_golden"

log "building engram (cargo build -p engram-cli)"
(cd "$repo_root" && cargo build -p engram-cli >&2)
engram="$repo_root/target/debug/engram"

(cd "$here" && python3 moe_golden.py prompts "$work/prompts.txt")
models="["
runs=()
for spec in tiny-qwen3moe:q4_k tiny-mixtral:q4_0; do
    shape="${spec%%:*}" type="${spec##*:}"
    file="engram-random-$shape-$type.gguf"
    command_line="engram gen-model --shape $shape --type $type --seed 1 --out $file"
    log "$command_line"
    "$engram" gen-model --shape "$shape" --type "$type" --seed 1 --out "$work/$file" >&2
    log "running llama.cpp on $file"
    "$work/kquant_golden" "$work/$file" "$work/prompts.txt" 32 "$threads" \
        >"$work/$shape.jsonl" 2>"$work/$shape.log" || die "kquant_golden failed: see $work/$shape.log"
    "$work/kquant_golden" "$work/$file" "$work/prompts.txt" 32 "$threads" 1 \
        >"$work/$shape-fa.jsonl" 2>"$work/$shape-fa.log" || die "kquant_golden failed: see $work/$shape-fa.log"
    sha=$(sha256sum "$work/$file" | cut -d' ' -f1)
    size=$(stat -c %s "$work/$file")
    [[ "$models" == "[" ]] || models+=", "
    models+=$(printf '{"file": "%s", "shape": "%s", "type": "%s", "sha256": "%s", "size_bytes": %s, "command": "%s"}' \
        "$file" "$shape" "$type" "$sha" "$size" "$command_line")
    runs+=("$work/$shape.jsonl" "$work/$shape-fa.jsonl")
done
models+="]"
(cd "$here" && python3 moe_golden.py assemble "$out" "$work/prompts.txt" "$models" "${runs[@]}")
log "wrote $out"
