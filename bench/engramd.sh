# Sourced by the benchmarks that drive a running daemon (load.sh, conversation.sh).
# start_engramd: starts target/release/engramd (build it first) on a temporary data directory
# with a fresh admin key and a free loopback port, waits until it answers, and sets WORK, KEY,
# PORT, URL and PID; at exit the daemon is stopped and the directory removed.
start_engramd() {
    export ENGRAM_MODELS_DIR="${ENGRAM_MODELS_DIR:-$PWD/models}"
    WORK=$(mktemp -d)
    PID=
    trap 'if [[ -n $PID ]] && kill -0 "$PID" 2>/dev/null; then kill -TERM "$PID"; wait "$PID" || true; fi; rm -rf "$WORK"' EXIT
    KEY=$(target/release/engramd keys create --data-dir "$WORK/data" --scopes admin 2>/dev/null)
    PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    URL="http://127.0.0.1:$PORT"
    target/release/engramd --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" >"$WORK/engramd.log" 2>&1 &
    PID=$!
    until curl -fs "$URL/healthz" >/dev/null 2>&1; do
        kill -0 "$PID" 2>/dev/null || { cat "$WORK/engramd.log" >&2; exit 1; }
        sleep 0.5
    done
}
