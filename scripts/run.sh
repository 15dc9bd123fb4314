#!/usr/bin/env bash
# The main job, on a fresh machine: fetches the default models, builds Engram in release mode,
# indexes a small sample corpus (this repository's docs/) with each chunk's KV stored, answers a
# question from it with fused prefill, then starts a chat with the default LLM. Extra arguments
# go to `engram chat` (e.g. --system "..." --temperature 0.7). /reset clears, /exit quits.
# Data lives in $ENGRAM_DATA_DIR (default ./data); re-running skips what is already indexed.
set -euo pipefail
cd "$(dirname "$0")/.."

models="$(scripts/fetch-models.sh)"
export ENGRAM_MODELS_DIR="$models"
cargo build --release --locked -p engram-cli
engram=target/release/engram
"$engram" ingest docs --collection engram-docs --kv
"$engram" ask "How does Engram check a stored KV blob before using it?" --collection engram-docs
exec "$engram" chat --model "$models/SmolLM2-135M-Instruct.Q4_1.gguf" "$@"
