#!/usr/bin/env bash
# Side-by-side benchmark of Engram against llama.cpp's llama-bench on the same GGUF and thread
# count, in one run (STYLE.md section 7). Not part of CI. See bench/README.md.
#
#   bench/vs-llamacpp.sh [--model PATH] [--threads N] [--reps N] [--quick] [--build-only]
#   bench/vs-llamacpp.sh --types q4_1,q4_k_m,q5_k_m,q8_0 [--threads N] [--reps N] [--quick]
#   bench/vs-llamacpp.sh --batched [--model PATH] [--threads N] [--reps N]
#
# --types: the same figures for each weight type, on variants of the model that llama.cpp's
# llama-quantize --allow-requantize makes from it (cached beside the llama.cpp build; speed is
# what they measure, not quality); one RATIO[type] and BANDWIDTH[type] line each.
#
# The last lines of output are machine-readable (with --types, one pair per type):
#   BANDWIDTH read_gbs=R decode_gbs=D decode_fraction=F llamacpp_fraction=L
#   RATIO prefill512=X prefill2048=Y decode512=Z rss=W
# (BANDWIDTH: the memory read bandwidth `engram bench --read-bandwidth` measures on the same
# threads before every decode repetition, and each side's decode as bytes read per token, from
# Model::decode_bytes, times tokens per second.)
#   BATCHED engram_b8/b1=X llamacpp_b8/b1=Y engram/llamacpp_b8=Z      (with --batched)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { echo "vs-llamacpp: $*" >&2; }
die() { echo "vs-llamacpp: error: $*" >&2; exit 1; }

# shellcheck source=bench/llamacpp.sh
source "$repo_root/bench/llamacpp.sh"
llama_bench="$llamacpp_bin/llama-bench"
llama_batched="$llamacpp_bin/llama-batched-bench"
build_llama_bench() { build_llamacpp llama-bench llama-batched-bench; }

# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
model="$repo_root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
threads=2
reps=5
quick=0
build_only=0
batched=0
reps_set=0
types=""

usage() { sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) model="${2:?--model needs a path}"; shift 2 ;;
        --threads) threads="${2:?--threads needs a number}"; shift 2 ;;
        --reps) reps="${2:?--reps needs a number}"; reps_set=1; shift 2 ;;
        --quick) quick=1; shift ;;
        --build-only) build_only=1; shift ;;
        --batched) batched=1; shift ;;
        --types) types="${2:?--types needs a list such as q4_1,q4_k_m,q5_k_m,q8_0}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

if [[ $build_only -eq 1 ]]; then
    build_llama_bench
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# Preflight
# ---------------------------------------------------------------------------------------------
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer"
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || die "--reps must be a positive integer"
if [[ $quick -eq 1 ]]; then
    figures=(load prefill512 prefill2048 decode512)
    [[ $reps_set -eq 1 ]] || reps=3
else
    figures=(load prefill128 prefill512 prefill2048 prefill4096 decode512)
fi
decode_tokens=128
decode_context=512

if [[ ! -f "$model" ]]; then
    [[ "$model" == "$repo_root/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]] || die "no model at $model"
    log "fetching the default model"
    "$repo_root/scripts/fetch-models.sh" "$repo_root/models" >&2
fi
model="$(cd "$(dirname "$model")" && pwd)/$(basename "$model")"
[[ -x /usr/bin/time ]] || apt_install time /usr/bin/time
command -v python3 >/dev/null || die "python3 is needed for bench/summarize.py"

build_llama_bench

# ---------------------------------------------------------------------------------------------
# --batched: decode throughput of 8 sequences at once against one, both sides (continuous
# batching's benefit), alternating Engram's batch_decode example and llama-batched-bench.
# ---------------------------------------------------------------------------------------------
if [[ $batched -eq 1 ]]; then
    [[ $reps_set -eq 1 ]] || reps=3
    log "building Engram's batch_decode example"
    (cd "$repo_root" && cargo build --release -p engram-model --example batch_decode >&2)
    work="${BENCH_WORK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/engram-batched.XXXXXX")}"
    mkdir -p "$work"
    cp "$repo_root/target/release/examples/batch_decode" "$work/batch_decode"
    ctx=512 steps=32
    echo "== Engram vs llama.cpp, batched decode ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo "command     bench/vs-llamacpp.sh --batched --model $model --threads $threads --reps $reps"
    echo "cpu         $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'); nproc $(nproc); threads $threads"
    echo "engram      $(cd "$repo_root" && git rev-parse --short HEAD) batch_decode --batches 1,8 --context $ctx --steps $steps --reps 1"
    echo "llama.cpp   llama-batched-bench -npp $ctx -ntg $steps -npl 1,8 -fa 0|1 (each sequence its own $ctx-token prompt)"
    echo "raw output  $work"
    echo "load start  $(uptime)"
    for ((rep = 1; rep <= reps; rep++)); do
        log "batched: repetition $rep/$reps"
        "$work/batch_decode" "$model" --threads "$threads" --batches 1,8 --context $ctx \
            --steps $steps --reps 1 > "$work/engram__$rep.txt" 2> "$work/engram__$rep.err" \
            || { tail -n 20 "$work/engram__$rep.err" >&2; die "batch_decode failed"; }
        for fa in 0 1; do
            "$llama_batched" -m "$model" -t "$threads" -c $((8 * (ctx + steps) + 256)) -b 512 -ub 512 \
                -npp $ctx -ntg $steps -npl 1,8 -fa "$([[ $fa -eq 1 ]] && echo on || echo off)" \
                > "$work/llama_fa${fa}__$rep.txt" 2> "$work/llama_fa${fa}__$rep.err" \
                || { tail -n 20 "$work/llama_fa${fa}__$rep.err" >&2; die "llama-batched-bench failed"; }
        done
    done
    echo "load end    $(uptime)"
    echo
    python3 - "$work" "$reps" <<'PY'
import re, statistics, sys
work, reps = sys.argv[1], int(sys.argv[2])
def engram(rep):
    # "    8     23.4   342.3   2.08x": batch, step ms, tok/s.
    rows = {}
    for line in open(f"{work}/engram__{rep}.txt"):
        m = re.match(r"\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s", line)
        if m:
            rows[int(m[1])] = float(m[3])
    return rows
def llama(fa, rep):
    # "|   512 |     32 |    8 |   4352 | T_PP | S_PP | T_TG | S_TG | T | S |": B -> S_TG.
    rows = {}
    for line in open(f"{work}/llama_fa{fa}__{rep}.txt"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[2].isdigit():
            rows[int(cells[2])] = float(cells[7])
    return rows
sides = {"engram": [engram(r) for r in range(1, reps + 1)]}
for fa in (0, 1):
    sides[f"llama.cpp fa{fa}"] = [llama(fa, r) for r in range(1, reps + 1)]
med = {k: {b: statistics.median(r[b] for r in v) for b in (1, 8)} for k, v in sides.items()}
print("decode tok/s after a 512-token context (medians of %d)" % reps)
print("| side | 1 sequence | 8 sequences | 8 / 1 |")
print("|---|---|---|---|")
for k, m in med.items():
    print(f"| {k} | {m[1]:.1f} | {m[8]:.1f} | {m[8] / m[1]:.2f} |")
best = max((k for k in med if k.startswith("llama")), key=lambda k: med[k][8])
e, l = med["engram"], med[best]
print()
print(f"BATCHED engram_b8/b1={e[8] / e[1]:.2f} llamacpp_b8/b1={l[8] / l[1]:.2f} "
      f"engram/llamacpp_b8={e[8] / l[8]:.2f}")
PY
    exit 0
fi

llama_help="$("$llama_bench" --help 2>&1 || true)"
if [[ "$llama_help" == *--n-depth* ]]; then
    have_depth=1
else
    have_depth=0
    log "warning: this llama-bench has no -d/--n-depth; decode512 falls back to -pg (see README)"
fi

log "building Engram (cargo build --release -p engram-cli)"
(cd "$repo_root" && cargo build --release -p engram-cli >&2)

work="${BENCH_WORK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/engram-vs-llamacpp.XXXXXX")}"
mkdir -p "$work"
# Others may rebuild target/release while this runs: benchmark a private copy.
engram="$work/engram"
cp "$repo_root/target/release/engram" "$engram"

# A slightly raised priority where permitted (root), plain otherwise.
nice_cmd=()
if [[ "$(nice -n -5 nice 2>/dev/null)" -lt "$(nice)" ]]; then
    nice_cmd=(nice -n -5)
fi

# ---------------------------------------------------------------------------------------------
# One benchmarked process: stdout to $work/FIG__SIDE__REP.json, `time -v` to .time, stderr to .err
# ---------------------------------------------------------------------------------------------
run_one() {
    local fig="$1" side="$2" rep="$3"
    shift 3
    local base="$work/${fig}__${side}__${rep}"
    printf '%s\n' "$*" > "$base.cmd"
    if ! "${nice_cmd[@]}" /usr/bin/time -v -o "$base.time" "$@" > "$base.json" 2> "$base.err"; then
        tail -n 20 "$base.err" >&2
        die "$side run failed for $fig (command in $base.cmd)"
    fi
}

engram_args() {
    local fig="$1"
    local args=(bench --model "$model" --threads "$threads" --repetitions 1 --json)
    case "$fig" in
        # Load, the fixed 16-token warm-up prefill, then a 1-token prefill.
        load) args+=(--prefill 1 --decode 0) ;;
        prefill*) args+=(--prefill "${fig#prefill}" --decode 0) ;;
        # --prefill needs a value: a 1-token prefill is negligible next to the decode.
        decode512) args+=(--prefill 1 --decode "$decode_tokens" --decode-context "$decode_context") ;;
    esac
    printf '%s\n' "${args[@]}"
}

llama_args() {
    local fig="$1" fa="$2"
    local args=(-m "$model" -t "$threads" -r 1 -fa "$fa" -o json "${llama_extra[@]}")
    case "$fig" in
        # Same work as Engram's load run: load, then 16 prompt tokens (Engram's fixed warm-up).
        load) args+=(-p 16 -n 0 --no-warmup) ;;
        prefill*) args+=(-p "${fig#prefill}" -n 0) ;;
        decode512)
            if [[ $have_depth -eq 1 ]]; then
                args+=(-p 0 -n "$decode_tokens" -d "$decode_context")
            else
                args+=(-p 0 -n 0 -pg "$decode_context,$decode_tokens")
            fi ;;
    esac
    printf '%s\n' "${args[@]}"
}

# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------
cpu_model="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
llama_version="$("$llama_bench" --version 2>&1 | grep -m1 -i 'version' || true)"
engram_rev="$(cd "$repo_root" && git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(cd "$repo_root" && git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    engram_rev+="-dirty"
fi

# The model of each type: the given one for its own type, llama-quantize's variants of it.
declare -A type_model=()
if [[ -n "$types" ]]; then
    build_llamacpp llama-quantize
    mkdir -p "$llamacpp_cache/models"
    base="$(basename "$model" .gguf)"
    for t in ${types//,/ }; do
        [[ "$t" =~ ^(q4_0|q4_1|q5_0|q5_1|q8_0|q4_k_s|q4_k_m|q5_k_s|q5_k_m|q6_k)$ ]] \
            || die "unknown type $t in --types"
        upper="${t^^}"
        if [[ "$base" == *".$upper" ]]; then
            type_model[$t]="$model"
            continue
        fi
        out="$llamacpp_cache/models/${base%.*}.$upper.gguf"
        if [[ ! -f "$out" ]]; then
            log "making $out with llama-quantize --allow-requantize"
            "$llamacpp_bin/llama-quantize" --allow-requantize "$model" "$out.part" "$upper" "$threads" \
                > "$out.log" 2>&1 || { tail -n 20 "$out.log" >&2; die "llama-quantize $upper failed"; }
            mv "$out.part" "$out"
        fi
        type_model[$t]="$out"
    done
fi

echo "== Engram vs llama.cpp ($(date -u '+%Y-%m-%d %H:%M UTC'))"
echo "command     bench/vs-llamacpp.sh --model $model --threads $threads --reps $reps$([[ $quick -eq 1 ]] && echo ' --quick')${types:+ --types $types}"
echo "model       $model"
echo "cpu         $cpu_model; nproc $(nproc); threads $threads"
echo "engram      $engram_rev (release build, copied to $engram)"
echo "llama.cpp   llama-cpp-python $LLAMACPP_PY_VERSION vendor/llama.cpp: $llama_version"
echo "priority    ${nice_cmd[*]:-plain (nice -n -5 not permitted)}"
echo "raw output  $work"
echo "load start  $(uptime)"

# llama.cpp's own settings for the model in $model: its defaults, unless a short run with them
# fails. llama.cpp 0.3.36 built natively on an AMX CPU (Sapphire Rapids) takes Q4_0, Q4_1, Q8_0
# and the K-quants through its AMX weight buffers, whose kernel dies with SIGILL on a worker
# thread that never loaded a tile configuration (seen 2026-11-26 on a Xeon with AMX); then
# llama.cpp runs with `--repack 0` (plain CPU weight buffers, its AVX-512 kernels), the fastest
# setting that works, and the output says so.
llama_extra=()
probe_llama() {
    llama_extra=()
    if ! "$llama_bench" -m "$model" -t "$threads" -p 64 -n 0 -r 1 -o json \
        > "$work/probe.json" 2> "$work/probe.err"; then
        [[ "$llama_help" == *--repack* ]] || { tail -n 20 "$work/probe.err" >&2; die "llama-bench failed on $model"; }
        llama_extra=(--repack 0)
        log "llama-bench failed with its default weight buffers on $model; using --repack 0"
        echo "llama.cpp note: $(basename "$model"): the default (repacked/AMX) weight buffers crash; llama.cpp runs with --repack 0"
        "$llama_bench" -m "$model" -t "$threads" -p 64 -n 0 -r 1 -o json "${llama_extra[@]}" \
            > "$work/probe.json" 2> "$work/probe.err" \
            || { tail -n 20 "$work/probe.err" >&2; die "llama-bench failed on $model with --repack 0 too"; }
    fi
}

# Every figure for the model in $model, its raw files in $work.
run_figures() {
    local fig rep fa
    probe_llama
    for fig in "${figures[@]}"; do
        mapfile -t e_args < <(engram_args "$fig")
        for ((rep = 1; rep <= reps; rep++)); do
            log "$fig: repetition $rep/$reps"
            if [[ "$fig" == decode512 ]]; then
                "$engram" bench --read-bandwidth --threads "$threads" --repetitions 3 --json \
                    > "$work/read__$rep.bandwidth" 2> "$work/read__$rep.err" \
                    || { tail -n 20 "$work/read__$rep.err" >&2; die "the read-bandwidth probe failed"; }
            fi
            run_one "$fig" engram "$rep" "$engram" "${e_args[@]}"
            for fa in 0 1; do
                # Flash attention does not change load time: one llama.cpp load run suffices.
                [[ "$fig" == load && $fa -eq 1 ]] && continue
                mapfile -t l_args < <(llama_args "$fig" "$fa")
                run_one "$fig" "llama_fa$fa" "$rep" "$llama_bench" "${l_args[@]}"
            done
        done
    done
}

if [[ -z "$types" ]]; then
    run_figures
    echo "load end    $(uptime)"
    echo
    python3 "$repo_root/bench/summarize.py" "$work" --have-depth "$have_depth"
    exit 0
fi
root_work="$work"
for t in ${types//,/ }; do
    model="${type_model[$t]}"
    work="$root_work/$t"
    mkdir -p "$work"
    log "== $t: $model"
    run_figures
done
echo "load end    $(uptime)"
for t in ${types//,/ }; do
    echo
    echo "== $t: ${type_model[$t]} ($(du -m "${type_model[$t]}" | cut -f1) MiB)"
    python3 "$repo_root/bench/summarize.py" "$root_work/$t" --have-depth "$have_depth" --label "$t" \
        | tee "$root_work/$t.summary"
done
echo
for t in ${types//,/ }; do
    grep -E '^(BANDWIDTH|RATIO)' "$root_work/$t.summary"
done
