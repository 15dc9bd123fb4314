#!/usr/bin/env bash
# Regenerates tests/golden/smollm2-135m-kmix.llamacpp.json, the K-quant golden file that
# tests/engine_golden_kquant.rs holds the engine to. Needs the network only to build llama.cpp
# the first time (bench/llamacpp.sh, cached outside the repository); not part of CI.
#
#   bench/golden/make-kquant-golden.sh [--skip-check]
#
# 1. `engram requantize --mix kmix` makes the K-quant model from the default Q4_1 one;
# 2. kquant_golden.cpp is built against llama.cpp's static libraries;
# 3. it is run on the Q4_1 model and must reproduce ../shared/golden's Q4_1 file (tokens, top-5
#    ids, logits to 1e-4), which shows its settings are that file's (--skip-check skips this,
#    about a minute on 2 cores);
# 4. it is run on the K-quant model, and again with flash attention on (how far llama.cpp's own
#    other path moves the outputs: the file's flash_attn_spread), and the golden file is written
#    with the model's sha256 and the command that made it.
#
# Run it again whenever `engram requantize` changes its output: the test then fails on the
# sha256 and says so.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$repo_root/bench/golden"

log() { echo "make-kquant-golden: $*" >&2; }
die() { echo "make-kquant-golden: error: $*" >&2; exit 1; }

check=1
case "${1:-}" in
    --skip-check) check=0 ;;
    "") ;;
    *) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; die "unknown argument: $1" ;;
esac

# shellcheck source=bench/llamacpp.sh
source "$repo_root/bench/llamacpp.sh"

models="${ENGRAM_MODELS_DIR:-$repo_root/models}"
source_model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
q4_1_golden="${ENGRAM_SHARED_DIR:-$repo_root/../shared}/golden/smollm2-135m-q4_1.llamacpp.json"
out="$repo_root/tests/golden/smollm2-135m-kmix.llamacpp.json"
work="${TMPDIR:-/tmp}/engram-kquant-golden"
model_name="SmolLM2-135M-Instruct.kmix.gguf"
threads=2

[[ -f "$source_model" ]] || die "$source_model is missing: run scripts/fetch-models.sh"
[[ -f "$q4_1_golden" ]] || die "$q4_1_golden is missing (set ENGRAM_SHARED_DIR)"
command -v python3 >/dev/null || die "python3 is needed"
mkdir -p "$work" "$(dirname "$out")"

build_kquant_golden "$work/kquant_golden"

# The same debug binary the integration tests run; any build writes the same bytes.
log "building engram (cargo build -p engram-cli)"
(cd "$repo_root" && cargo build -p engram-cli >&2)
engram="$repo_root/target/debug/engram"
command_line="engram requantize --from models/SmolLM2-135M-Instruct.Q4_1.gguf --mix kmix --out $model_name"
log "$command_line"
"$engram" requantize --from "$source_model" --mix kmix --out "$work/$model_name" >&2

python3 "$here/kquant_golden.py" prompts "$q4_1_golden" "$work/prompts.txt"
if [[ $check -eq 1 ]]; then
    log "checking the tool against the Q4_1 golden file"
    "$work/kquant_golden" "$source_model" "$work/prompts.txt" 32 "$threads" \
        >"$work/q4_1.jsonl" 2>"$work/q4_1.log" || die "kquant_golden failed: see $work/q4_1.log"
    python3 "$here/kquant_golden.py" check "$q4_1_golden" "$work/q4_1.jsonl" >&2
fi

log "running llama.cpp on $model_name"
"$work/kquant_golden" "$work/$model_name" "$work/prompts.txt" 32 "$threads" \
    >"$work/kmix.jsonl" 2>"$work/kmix.log" || die "kquant_golden failed: see $work/kmix.log"
log "again with flash attention on"
"$work/kquant_golden" "$work/$model_name" "$work/prompts.txt" 32 "$threads" 1 \
    >"$work/kmix-fa.jsonl" 2>"$work/kmix-fa.log" || die "kquant_golden failed: see $work/kmix-fa.log"

sha=$(sha256sum "$work/$model_name" | cut -d' ' -f1)
source_sha=$(sha256sum "$source_model" | cut -d' ' -f1)
size=$(stat -c %s "$work/$model_name")
model_json=$(printf '{"file": "%s", "sha256": "%s", "size_bytes": %s, "command": "%s", "source": {"file": "SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": "%s"}}' \
    "$model_name" "$sha" "$size" "$command_line" "$source_sha")
python3 "$here/kquant_golden.py" assemble "$q4_1_golden" "$work/kmix.jsonl" "$work/kmix-fa.jsonl" \
    "$model_json" "$out"
log "wrote $out (model sha256 $sha)"
