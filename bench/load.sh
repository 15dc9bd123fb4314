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
source bench/engramd.sh
start_engramd
echo "engramd $(target/release/engramd --version) on $(nproc) cores, pid $PID"
QA=()
if [[ -z ${LOAD_CHAT:-} ]]; then
    api() { curl -fsS -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' "$@"; }
    api -X POST "$URL/api/v1/collections" -d '{"name": "bench"}' >/dev/null
    python3 -c 'import json, sys; print(json.dumps({"name": "architecture.md", "text": open(sys.argv[1]).read()}))' \
        docs/architecture.md | api -X POST "$URL/api/v1/collections/bench/documents/text" -d @- >/dev/null
    # Indexed, then the engine stores each chunk's KV while idle: wait for both.
    until api "$URL/api/v1/collections/bench/documents" | grep -q '"stage":"done"'; do sleep 1; done
    until api "$URL/metrics" | grep -q '^engram_ingest_pending{queue="chunk_kv"} 0'; do sleep 1; done
    QA=(--collection bench)
fi
target/release/examples/load --url "$URL" --key "$KEY" --pid "$PID" "${QA[@]}" "$@"
