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
export ENGRAM_MODELS_DIR="${ENGRAM_MODELS_DIR:-$PWD/models}"
WORK=$(mktemp -d)
PID=
cleanup() {
    if [[ -n $PID ]] && kill -0 "$PID" 2>/dev/null; then kill -TERM "$PID"; wait "$PID" || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
KEY=$(target/release/engramd keys create --data-dir "$WORK/data" --scopes admin 2>/dev/null)
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
target/release/engramd --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" >"$WORK/engramd.log" 2>&1 &
PID=$!
until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1; do
    kill -0 "$PID" 2>/dev/null || { cat "$WORK/engramd.log" >&2; exit 1; }
    sleep 0.5
done
echo "engramd $(target/release/engramd --version) on $(nproc) cores ($(git rev-parse --short HEAD))"
target/release/examples/conversation --url "http://127.0.0.1:$PORT" --key "$KEY" "$@"
