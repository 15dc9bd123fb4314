#!/usr/bin/env bash
# Conversation benchmark (not part of CI): starts a throwaway engramd (release build, temporary
# data directory, fresh admin key, free port) and runs appliance/server/examples/conversation.rs:
# the time to first token of each turn of a five-turn chat with the history's KV reused from
# the prefix cache, against the same prompt prefilled in full, in the same run. Last line:
#   RATIO turn5_ttft_full_over_reused=X cached_fraction=Y
#
#   bench/conversation.sh [conversation.rs flags, e.g. --reps 5 --turns 5 --max-tokens 64]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p engram-server --bin engramd --example conversation
source bench/engramd.sh
start_engramd
echo "engramd $(target/release/engramd --version) on $(nproc) cores ($(git rev-parse --short HEAD))"
target/release/examples/conversation --url "$URL" --key "$KEY" "$@"
