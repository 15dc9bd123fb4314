#!/usr/bin/env bash
# Load benchmark (not part of CI): starts a throwaway engramd (release build, temporary data
# directory, fresh admin key, free port), indexes docs/architecture.md into a collection
# `bench` (its chunk KV stored), then runs appliance/server/examples/load.rs: aggregate decode
# tokens/s for 1 and 8 concurrent QA streams (chat completions with retrieval over `bench`,
# so fused prefill), then 64 clients for a bounded time (2xx / 429 / errors and the daemon's
# peak RSS). LOAD_CHAT=1 leaves retrieval out (plain chat).
#
#   bench/load.sh [load.rs flags, e.g. --max-tokens 32 --streams 1,8,1,8 --seconds 20]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p engram-server --bin engramd --example load
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
echo "engramd $(target/release/engramd --version) on $(nproc) cores, pid $PID"
QA=()
if [[ -z ${LOAD_CHAT:-} ]]; then
    api() { curl -fsS -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' "$@"; }
    api -X POST "http://127.0.0.1:$PORT/api/v1/collections" -d '{"name": "bench"}' >/dev/null
    python3 -c 'import json, sys; print(json.dumps({"name": "architecture.md", "text": open(sys.argv[1]).read()}))' \
        docs/architecture.md | api -X POST "http://127.0.0.1:$PORT/api/v1/collections/bench/documents/text" -d @- >/dev/null
    # Indexed, then the engine stores each chunk's KV while idle: wait for both.
    until api "http://127.0.0.1:$PORT/api/v1/collections/bench/documents" | grep -q '"stage":"done"'; do sleep 1; done
    until api "http://127.0.0.1:$PORT/metrics" | grep -q '^engram_ingest_pending{queue="chunk_kv"} 0'; do sleep 1; done
    QA=(--collection bench)
fi
target/release/examples/load --url "http://127.0.0.1:$PORT" --key "$KEY" --pid "$PID" "${QA[@]}" "$@"
