#!/usr/bin/env bash
# The admin console end to end in a real browser: Debian's headless Chromium driven by
# playwright-core (tests/e2e/console.test.mjs). Starts a throwaway engramd (temporary data
# directory, a free port, the first admin created with `engramd users create`), runs the
# test, stops the daemon. Screenshots of every page land in target/ui-screenshots/.
#
# Installs what is missing: chromium and a CJK font (apt, as root), the pinned playwright-core
# (npm ci in tests/e2e); `--prepare` installs them and stops. ENGRAM_MODELS_DIR defaults to
# ./models (scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -x /usr/bin/chromium ]] || ! fc-list 2>/dev/null | grep -qi 'Noto Sans CJK'; then
    echo "test-ui: installing chromium and fonts-noto-cjk"
    SUDO=
    [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-noto-cjk >/dev/null
fi
if [[ ! -d tests/e2e/node_modules/playwright-core ]]; then
    (cd tests/e2e && npm ci --no-audit --no-fund --loglevel=error)
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

# Short generations keep the chat step to a few seconds.
cat >"$WORK/engramd.toml" <<'TOML'
[models]
threads = 2
[kv]
dram_mib = 64
nvme_gib = 1
[limits]
max_tokens = 32
max_upload_bytes = 1048576
[storage]
reserve_mib = 16
TOML
PASSWORD=$(head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
echo "$PASSWORD" | "$ENGRAMD" users create --data-dir "$WORK/data" --name admin --role admin \
    --password-stdin 2>/dev/null
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
"$ENGRAMD" --config "$WORK/engramd.toml" --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" \
    >"$WORK/engramd.log" 2>&1 &
PID=$!
for _ in $(seq 600); do
    if curl -fs "$URL/healthz" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$PID" 2>/dev/null; then
        cat "$WORK/engramd.log" >&2
        echo "test-ui: engramd exited while starting" >&2
        exit 1
    fi
    sleep 0.5
done
curl -fs "$URL/healthz" >/dev/null || { cat "$WORK/engramd.log" >&2; exit 1; }

SHOTS=target/ui-screenshots
rm -rf "$SHOTS"
echo "test-ui: console end to end in $(/usr/bin/chromium --version) against $URL"
status=0
ENGRAM_URL=$URL ENGRAM_USER=admin ENGRAM_PASSWORD=$PASSWORD SCREENSHOT_DIR=$SHOTS \
    node tests/e2e/console.test.mjs || status=$?
if [[ $status -ne 0 ]]; then
    echo "test-ui: failed; the daemon's log follows" >&2
    tail -n 50 "$WORK/engramd.log" >&2
    exit "$status"
fi
echo "test-ui: ok; screenshots in $SHOTS/"
