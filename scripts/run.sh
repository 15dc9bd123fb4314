#!/usr/bin/env bash
# The main job, on a fresh machine: fetches the default models, builds Engram in release mode and
# starts a chat with the default LLM (SmolLM2-135M-Instruct). Extra arguments go to `engram chat`
# (e.g. --system "..." --temperature 0.7). Type messages; /reset clears, /exit quits.
set -euo pipefail
cd "$(dirname "$0")/.."

models="$(scripts/fetch-models.sh)"
cargo build --release --locked -p engram-cli
exec target/release/engram chat --model "$models/SmolLM2-135M-Instruct.Q4_1.gguf" "$@"
