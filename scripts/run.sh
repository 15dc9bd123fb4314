#!/usr/bin/env bash
# The main job, on a fresh machine: fetches the default models, builds Engram in release mode,
# indexes a small sample corpus (an invented employee handbook in English and Chinese, and three of
# this repository's docs) with each chunk's KV stored, creates an
# admin API key on the first run, prints the URL, the key and a first request, then runs the
# daemon `engramd` in the foreground (Ctrl-C stops it gracefully).
# Data lives in $ENGRAM_DATA_DIR (default ./data); re-running skips what is already indexed and
# reuses the key. The address is $ENGRAM_LISTEN (default 127.0.0.1:8080).
set -euo pipefail
cd "$(dirname "$0")/.."

models="$(scripts/fetch-models.sh)"
export ENGRAM_MODELS_DIR="$models"
data="${ENGRAM_DATA_DIR:-$(pwd)/data}"
listen="${ENGRAM_LISTEN:-127.0.0.1:8080}"
cargo build --release --locked -p engram-cli -p engram-server
target/release/engram ingest docs/samples/handbook --collection handbook --kv --data-dir "$data"
target/release/engram ingest docs/architecture.md docs/engramd.md docs/formats --collection engram-docs --kv --data-dir "$data"

key_file="$data/run-admin.key"
if [[ ! -s "$key_file" ]]; then
    (umask 077 && target/release/engramd keys create --data-dir "$data" --scopes admin >"$key_file")
fi
key="$(cat "$key_file")"
cat <<INFO

engramd on http://$listen   (admin key, also in $key_file)
  $key
Try:
  curl -s http://$listen/api/v1/qa -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \\
    -d '{"question": "How many days of paid leave do employees get?", "collections": ["handbook"], "max_tokens": 48}'

INFO
exec target/release/engramd --data-dir "$data" --listen "$listen"
