#!/usr/bin/env bash
# End-to-end QA of Engram against llama.cpp on the same GGUF, in one run: `engram eval qa` on
# each set answers as engramd does and also sends the same retrieved passages to llama.cpp's
# llama-server in LangChain's default RAG prompt, greedy, scored the same way (SQuAD F1/EM, by
# character for Chinese). Not part of CI. See bench/README.md.
#
#   bench/qa-vs-llamacpp.sh [--sets xquad-en,xquad-zh,cmrc2018] [--limit N] [--policy P]
#                           [--model PATH] [--threads N] [--out FILE.jsonl]
#
# Prints one table per set, then one line per set:
#   QA[set] engram_f1=X peer_f1=Y gap=X-Y gap_ci95=[lo,hi] ... recall@5=R
# (gap_ci95: the paired bootstrap 95 % interval of Engram's F1 minus the peer's)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { echo "qa-vs-llamacpp: $*" >&2; }
die() { echo "qa-vs-llamacpp: error: $*" >&2; exit 1; }
# shellcheck source=bench/llamacpp.sh
source "$repo_root/bench/llamacpp.sh"

sets="xquad-en,xquad-zh,cmrc2018"
limit=150
policy=""
model="$repo_root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
threads=2
out=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --sets) sets="$2"; shift 2 ;;
        --limit) limit="$2"; shift 2 ;;
        --policy) policy="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        -h|--help) sed -n 2,12p "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[[ "$limit" =~ ^[1-9][0-9]*$ ]] || die "--limit must be a positive integer"
shared="${ENGRAM_SHARED_DIR:-$repo_root/../shared}"
[[ -d "$shared/data/qa-eval" ]] || die "no QA sets in $shared/data/qa-eval"
if [[ ! -f "$model" ]]; then
    [[ "$model" == "$repo_root/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]] || die "no model at $model"
    log "fetching the default models"
    "$repo_root/scripts/fetch-models.sh" >/dev/null
fi
export ENGRAM_MODELS_DIR="${ENGRAM_MODELS_DIR:-$repo_root/models}"

build_llamacpp llama-server
log "building engram (release)"
(cd "$repo_root" && cargo build --release --locked -q -p engram-cli)

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$llamacpp_bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" -t "$threads" -c 8192 \
    --no-webui >"${TMPDIR:-/tmp}/qa-vs-llamacpp-server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || die "llama-server exited; see ${TMPDIR:-/tmp}/qa-vs-llamacpp-server.log"
    sleep 0.5
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || die "llama-server did not come up"

summary=()
IFS=',' read -r -a set_list <<<"$sets"
for set in "${set_list[@]}"; do
    log "$set: $limit questions"
    args=(eval qa --set "$set" --root "$shared/data/qa-eval" --limit "$limit" --threads "$threads"
          --model "$model" --peer "http://127.0.0.1:$port" --json)
    [[ -n "$policy" ]] && args+=(--policy "$policy")
    json="$("$repo_root/target/release/engram" "${args[@]}")"
    [[ -n "$out" ]] && echo "$json" >>"$out"
    summary+=("$(python3 - "$json" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
eng = next(v for k, v in r["systems"].items() if k.startswith("engram:"))
peer = r["systems"]["peer"]
k = r["k"]
lo, hi = (-x for x in reversed(peer["f1_delta_ci95"]))
print(f'QA[{r["set"]}] engram_f1={eng["f1"]:.3f} peer_f1={peer["f1"]:.3f} '
      f'gap={eng["f1"] - peer["f1"]:+.3f} gap_ci95=[{lo:+.3f},{hi:+.3f}] '
      f'engram_em={eng["em"]:.3f} peer_em={peer["em"]:.3f} '
      f'recall@{k}={r[f"recall@{k}"]:.3f} questions={r["questions"]} policy={r["policy"]}')
PY
)")
    echo "${summary[-1]}"
done
printf '%s\n' "${summary[@]}"
