#!/usr/bin/env bash
# Queries while one large upload ingests: starts a release engramd on a throwaway data
# directory, indexes a few small documents, uploads one large text file (30 MB by default), and
# for --seconds searches the small collection every 200 ms while the large one is parsed,
# chunked and embedded, then deletes it and times how long the embedder takes to stop. Prints
# the figures and one last line:
#
#   INGEST upload_ack_s=A search_p50_ms=B search_p99_ms=C search_max_ms=D chunked_mb_per_s=E
#          embedded_chunks_per_s=F delete_stop_s=G
#
#   bench/ingest-latency.sh [--mb 30] [--seconds 120] [--threads 2] [--file PATH]
#
# --file uploads that file (a Markdown manual, a PDF...) instead of the generated text.
set -euo pipefail
cd "$(dirname "$0")/.."

MB=30
SECONDS_RUN=120
THREADS=2
FILE=
while [[ $# -gt 0 ]]; do
    case $1 in
        --mb) MB=$2; shift 2 ;;
        --seconds) SECONDS_RUN=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --file) FILE=$(realpath "$2"); shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

scripts/fetch-models.sh >/dev/null
cargo build --quiet --locked --release -p engram-server
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
cat >"$WORK/engramd.toml" <<TOML
[models]
threads = $THREADS
[kv]
dram_mib = 64
nvme_gib = 1
[limits]
max_upload_bytes = 67108864
[storage]
reserve_mib = 64
TOML
KEY=$(target/release/engramd keys create --data-dir "$WORK/data" --scopes admin 2>/dev/null)
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
target/release/engramd --config "$WORK/engramd.toml" --data-dir "$WORK/data" \
    --listen "127.0.0.1:$PORT" >"$WORK/engramd.log" 2>&1 &
PID=$!
for _ in $(seq 600); do
    curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
    sleep 0.2
done

python3 - "$PORT" "$KEY" "$MB" "$SECONDS_RUN" "$WORK" "$FILE" <<'PY'
import json, os, random, statistics, sys, time, urllib.request, uuid

port, key, mb, seconds, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
file = sys.argv[6]
base = f"http://127.0.0.1:{port}"

def call(method, path, body=None, ctype="application/json", timeout=600):
    data = None
    headers = {"Authorization": f"Bearer {key}"}
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = ctype
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return json.loads(raw) if raw[:1] == b"{" else raw.decode()

def metric(name):
    for line in call("GET", "/metrics").splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0

words = ("pump valve reservoir gauge turbine pipe meter sensor alarm shift log chlorine filter "
         "basin canal pressure flow district inspection engineer report maintenance").split()
rng = random.Random(1)
call("POST", "/api/v1/collections", {"name": "small"})
call("POST", "/api/v1/collections", {"name": "large"})
for i in range(8):
    text = " ".join(rng.choice(words) for _ in range(200)) + f" marker{i}."
    call("POST", "/api/v1/collections/small/documents/text", {"name": f"s{i}.txt", "text": text})
time.sleep(5)
paras = []
size = 0
while not file and size < mb * 1_000_000:
    p = " ".join(rng.choice(words) for _ in range(rng.randint(40, 120))).capitalize() + "."
    paras.append(p)
    size += len(p) + 2
big = "\n\n".join(paras).encode()
fname = "big.txt"
if file:
    big, fname = open(file, "rb").read(), os.path.basename(file)
boundary = uuid.uuid4().hex
body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{fname}\"\r\n\r\n".encode()
        + big + f"\r\n--{boundary}--\r\n".encode())
t0 = time.perf_counter()
r = call("POST", "/api/v1/collections/large/documents", body,
         ctype=f"multipart/form-data; boundary={boundary}")
ack = time.perf_counter() - t0
doc = r["documents"][0]["id"]
print(f"{len(big) / 1e6:.1f} MB uploaded, acknowledged in {ack:.2f} s (document {doc})")

lat = []
samples = []
start = time.perf_counter()
while time.perf_counter() - start < seconds:
    q = f"marker{rng.randrange(8)} pump pressure"
    t = time.perf_counter()
    hits = call("POST", "/api/v1/search", {"query": q, "collections": ["small"], "top_k": 3})["hits"]
    lat.append((time.perf_counter() - t) * 1e3)
    assert hits, "a search over the small collection found nothing"
    d = call("GET", f"/api/v1/collections/large/documents/{doc}")
    samples.append((time.perf_counter() - start, d["stage"], d.get("progress") or {}))
    time.sleep(0.2)
lat.sort()
p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]
print(f"{len(lat)} searches while it ingested: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max {lat[-1]:.1f} ms")
for t, stage, prog in samples[:: max(1, len(samples) // 12)]:
    print(f"  {t:6.1f} s  {stage:10s} {json.dumps(prog)}")
# Chunking speed: from the first sample that shows chunking progress to the first with all of it.
chunk_t = [t for t, s, pr in samples if pr.get("text_bytes") and pr.get("text_bytes_chunked") == pr.get("text_bytes")]
first = [t for t, s, pr in samples if pr.get("text_bytes")]
text_bytes = next((pr["text_bytes"] for _, _, pr in samples if pr.get("text_bytes")), 0)
chunked_mbs = text_bytes / 1e6 / max(chunk_t[0] - first[0], 0.2) if chunk_t and first else float("nan")
emb = [(t, pr.get("chunks_embedded", 0)) for t, s, pr in samples if pr.get("chunks_embedded")]
emb_rate = (emb[-1][1] - emb[0][1]) / (emb[-1][0] - emb[0][0]) if len(emb) > 1 and emb[-1][0] > emb[0][0] else float("nan")

e0 = metric('engram_ingest_chunks_total{stage="embedded"}')
t = time.perf_counter()
call("DELETE", f"/api/v1/collections/large/documents/{doc}")
delete_ms = (time.perf_counter() - t) * 1e3
last, stopped = e0, None
while time.perf_counter() - t < 30:
    time.sleep(0.1)
    now = metric('engram_ingest_chunks_total{stage="embedded"}')
    if now != last:
        last = now
        stopped = None
    elif stopped is None:
        stopped = time.perf_counter() - t
    elif time.perf_counter() - t - stopped > 3:
        break
print(f"delete answered in {delete_ms:.0f} ms; the embedder stopped {stopped:.2f} s after it "
      f"({last - e0:.0f} chunks embedded meanwhile)")
print(f"INGEST upload_ack_s={ack:.2f} search_p50_ms={p(0.5):.1f} search_p99_ms={p(0.99):.1f} "
      f"search_max_ms={lat[-1]:.1f} chunked_mb_per_s={chunked_mbs:.2f} "
      f"embedded_chunks_per_s={emb_rate:.1f} delete_stop_s={stopped:.2f}")
PY
