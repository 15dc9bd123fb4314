#!/usr/bin/env bash
# Side-by-side benchmark of Engram against llama.cpp's llama-bench on the same GGUF and thread
# count, in one run (STYLE.md section 7). Not part of CI. See bench/README.md.
#
#   bench/vs-llamacpp.sh [--model PATH] [--threads N] [--reps N] [--quick] [--build-only]
#
# The last line of output is machine-readable:
#   RATIO prefill512=X prefill2048=Y decode512=Z rss=W
set -euo pipefail

LLAMACPP_PY_VERSION="0.3.36"
LLAMACPP_SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/engram"
build_root="${LLAMACPP_BUILD_DIR:-$cache_root/llama.cpp-$LLAMACPP_PY_VERSION}"
llama_bench="$build_root/build/bin/llama-bench"

log() { echo "vs-llamacpp: $*" >&2; }
die() { echo "vs-llamacpp: error: $*" >&2; exit 1; }

# Installs Debian packages when running as root; otherwise fails with what to install.
apt_install() {
    local pkg="$1" why="$2"
    if ! command -v apt-get >/dev/null || [[ $(id -u) -ne 0 ]]; then
        die "$why is missing; install the '$pkg' package"
    fi
    log "installing $pkg"
    apt-get install -y -q "$pkg" >&2 || { apt-get update -q >&2 && apt-get install -y -q "$pkg" >&2; } \
        || die "could not install $pkg"
}

# ---------------------------------------------------------------------------------------------
# llama.cpp: llama-bench from the vendored copy in the llama-cpp-python sdist, cached outside
# the repository and reused when present.
# ---------------------------------------------------------------------------------------------
build_llama_bench() {
    if [[ -x "$llama_bench" ]]; then
        log "reusing $llama_bench"
        return 0
    fi
    command -v cmake >/dev/null || apt_install cmake cmake
    command -v python3 >/dev/null || die "python3 with pip is needed to download llama-cpp-python"

    local sdist_dir="$build_root/sdist" src="$build_root/src"
    local sdist="$sdist_dir/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz"
    mkdir -p "$sdist_dir"
    if [[ ! -f "$sdist" ]]; then
        log "downloading llama-cpp-python==$LLAMACPP_PY_VERSION sdist from PyPI"
        # `--no-binary llama-cpp-python` (not :all:) gets the sdist without also compiling its
        # build requirements (ninja, scikit-build-core) from source for the metadata step.
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            --disable-pip-version-check \
            "llama-cpp-python==$LLAMACPP_PY_VERSION" -d "$sdist_dir" >&2 \
            || die "pip download of llama-cpp-python==$LLAMACPP_PY_VERSION failed"
    fi
    [[ "$(sha256sum "$sdist" | cut -d' ' -f1)" == "$LLAMACPP_SDIST_SHA256" ]] \
        || die "$sdist does not have the expected sha256 $LLAMACPP_SDIST_SHA256; delete it to retry"
    if [[ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]]; then
        rm -rf "$src" && mkdir -p "$src"
        tar -xzf "$sdist" -C "$src" --strip-components=1
    fi
    [[ -f "$src/vendor/llama.cpp/CMakeLists.txt" ]] || die "no vendor/llama.cpp in the sdist"

    # CPU only, static (so the binary does not depend on the build tree's .so files), tuned for
    # this machine like Engram's release build. This llama.cpp has no LLAMA_CURL any more (it is
    # deprecated and ignored); downloads go through LLAMA_OPENSSL, which llama-bench never uses.
    local start=$SECONDS
    log "configuring llama.cpp (CPU only) in $build_root/build"
    cmake -S "$src/vendor/llama.cpp" -B "$build_root/build" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
        -DGGML_CCACHE=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >&2
    log "building llama-bench (-j${LLAMACPP_JOBS:-2}); this takes a while on few cores"
    cmake --build "$build_root/build" --config Release --target llama-bench -j "${LLAMACPP_JOBS:-2}" >&2
    [[ -x "$llama_bench" ]] || die "build finished but $llama_bench is missing"
    log "built llama-bench in $((SECONDS - start)) s"
}

# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
model="$repo_root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
threads=2
reps=5
quick=0
build_only=0
reps_set=0

usage() { sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) model="${2:?--model needs a path}"; shift 2 ;;
        --threads) threads="${2:?--threads needs a number}"; shift 2 ;;
        --reps) reps="${2:?--reps needs a number}"; reps_set=1; shift 2 ;;
        --quick) quick=1; shift ;;
        --build-only) build_only=1; shift ;;
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
    figures=(load prefill512 decode512)
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
    local args=(-m "$model" -t "$threads" -r 1 -fa "$fa" -o json)
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

echo "== Engram vs llama.cpp ($(date -u '+%Y-%m-%d %H:%M UTC'))"
echo "command     bench/vs-llamacpp.sh --model $model --threads $threads --reps $reps$([[ $quick -eq 1 ]] && echo ' --quick')"
echo "model       $model"
echo "cpu         $cpu_model; nproc $(nproc); threads $threads"
echo "engram      $engram_rev (release build, copied to $engram)"
echo "llama.cpp   llama-cpp-python $LLAMACPP_PY_VERSION vendor/llama.cpp: $llama_version"
echo "priority    ${nice_cmd[*]:-plain (nice -n -5 not permitted)}"
echo "raw output  $work"
echo "load start  $(uptime)"

for fig in "${figures[@]}"; do
    mapfile -t e_args < <(engram_args "$fig")
    for ((rep = 1; rep <= reps; rep++)); do
        log "$fig: repetition $rep/$reps"
        run_one "$fig" engram "$rep" "$engram" "${e_args[@]}"
        for fa in 0 1; do
            # Flash attention does not change load time: one llama.cpp load run suffices.
            [[ "$fig" == load && $fa -eq 1 ]] && continue
            mapfile -t l_args < <(llama_args "$fig" "$fa")
            run_one "$fig" "llama_fa$fa" "$rep" "$llama_bench" "${l_args[@]}"
        done
    done
done

echo "load end    $(uptime)"
echo
python3 "$repo_root/bench/summarize.py" "$work" --have-depth "$have_depth"
