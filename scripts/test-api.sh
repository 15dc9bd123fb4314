#!/usr/bin/env bash
# The API checks CI runs against a real daemon: the official OpenAI Python client and
# LangChain's ChatOpenAI (tests/python/test_openai_client.py), then a bounded schemathesis pass over the served
# OpenAPI document (no 5xx, no response that breaks its schema). Starts a throwaway engramd
# (temporary data directory, a fresh admin key, a free port) and stops it at the end.
#
# Python packages live in target/py-venv (created once per pin set; pip needs PyPI the first
# time; `--prepare` creates it and stops). ENGRAM_MODELS_DIR defaults to ./models
# (scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

OPENAI_VERSION=3.63.0
LANGCHAIN_OPENAI_VERSION=1.8.1
SCHEMATHESIS_VERSION=4.32.5
VENV=target/py-venv
STAMP="$VENV/.pins-openai-$OPENAI_VERSION-langchain-openai-$LANGCHAIN_OPENAI_VERSION-schemathesis-$SCHEMATHESIS_VERSION"
if [[ ! -f $STAMP ]]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "openai==$OPENAI_VERSION" "langchain-openai==$LANGCHAIN_OPENAI_VERSION" \
        "schemathesis==$SCHEMATHESIS_VERSION"
    touch "$STAMP"
fi
[[ ${1:-} == --prepare ]] && exit 0

# The build scripts/test.sh's tests and the .deb use (profile ENGRAM_PROFILE, default release):
# after them it compiles nothing.
PROFILE=${ENGRAM_PROFILE:-release}
cargo build --quiet --locked --profile "$PROFILE" -p engram-server -p engram-cli
ENGRAMD=target/$PROFILE/engramd
export ENGRAM_MODELS_DIR="${ENGRAM_MODELS_DIR:-$PWD/models}"

WORK=$(mktemp -d)
PID=
cleanup() {
    if [[ -n $PID ]] && kill -0 "$PID" 2>/dev/null; then
        kill -TERM "$PID"
        wait "$PID" || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# Small limits keep generations (and the fuzzer's requests) short; 96 tokens fit the
# structured-output answers.
cat >"$WORK/engramd.toml" <<'TOML'
[models]
threads = 2
[kv]
dram_mib = 64
nvme_gib = 1
[limits]
max_tokens = 96
max_upload_bytes = 1048576
[auth]
failures_per_minute = 100000
[storage]
reserve_mib = 16
TOML
KEY=$("$ENGRAMD" keys create --data-dir "$WORK/data" --scopes admin 2>/dev/null)
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
"$ENGRAMD" --config "$WORK/engramd.toml" --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" \
    >"$WORK/engramd.log" 2>&1 &
PID=$!
for _ in $(seq 600); do
    if curl -fs "$URL/healthz" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$PID" 2>/dev/null; then
        cat "$WORK/engramd.log" >&2
        echo "test-api: engramd exited while starting" >&2
        exit 1
    fi
    sleep 0.5
done
curl -fs "$URL/healthz" >/dev/null || { cat "$WORK/engramd.log" >&2; exit 1; }

# tiktoken (OpenAIEmbeddings tokenizes with it) downloads cl100k_base at run time; it reads
# this cache first (named by the SHA-1 of the download URL, checked against its SHA-256).
export TIKTOKEN_CACHE_DIR="$WORK/tiktoken"
mkdir -p "$TIKTOKEN_CACHE_DIR"
cl100k_url=https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken
cp "$ENGRAM_MODELS_DIR/cl100k_base.tiktoken" \
    "$TIKTOKEN_CACHE_DIR/$(printf %s "$cl100k_url" | sha1sum | cut -d' ' -f1)"

echo "test-api: OpenAI Python client $OPENAI_VERSION, langchain-openai $LANGCHAIN_OPENAI_VERSION against $URL"
ENGRAM_URL=$URL ENGRAM_KEY=$KEY "$VENV/bin/python" tests/python/test_openai_client.py

echo "test-api: schemathesis $SCHEMATHESIS_VERSION against $URL/api/v1/openapi.json"
status=0
# From the throwaway directory: schemathesis leaves a .schemathesis/ cache where it runs.
SCHEMATHESIS="$PWD/$VENV/bin/schemathesis"
(cd "$WORK" && "$SCHEMATHESIS" run "$URL/api/v1/openapi.json" \
    --checks not_a_server_error,response_schema_conformance \
    --max-examples 5 --phases examples,coverage,fuzzing --workers 1 --seed 1 \
    --generation-database none --request-timeout 120 --no-color \
    --header "Authorization: Bearer $KEY") || status=$?
if [[ $status -ne 0 ]]; then
    echo "test-api: schemathesis failed; the daemon's log follows" >&2
    tail -n 50 "$WORK/engramd.log" >&2
    exit "$status"
fi
echo "test-api: ok"
