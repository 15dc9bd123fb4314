# Shared by the benchmarks that compare against llama.cpp (sourced, not run): builds llama.cpp's
# tools once from the copy vendored in the llama-cpp-python sdist, cached outside the repository
# and reused when present. The caller defines log and die.
#
#   build_llamacpp llama-bench llama-batched-bench     # the targets needed; their paths are
#   "$llamacpp_bin/llama-bench"                         # under $llamacpp_bin

LLAMACPP_PY_VERSION="0.3.36"
LLAMACPP_SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
llamacpp_cache="${XDG_CACHE_HOME:-$HOME/.cache}/engram"
llamacpp_root="${LLAMACPP_BUILD_DIR:-$llamacpp_cache/llama.cpp-$LLAMACPP_PY_VERSION}"
llamacpp_bin="$llamacpp_root/build/bin"

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

# Downloads and checks the llama-cpp-python sdist once and unpacks it; sets llamacpp_src (its
# vendor/llama.cpp holds llama.cpp's source).
fetch_llamacpp_source() {
    command -v python3 >/dev/null || die "python3 with pip is needed to download llama-cpp-python"
    local sdist_dir="$llamacpp_root/sdist" src="$llamacpp_root/src"
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
    llamacpp_src="$src"
}

# Without AMX: some virtual machines (this project's Firecracker VMs on Sapphire Rapids) list
# amx_tile in /proc/cpuinfo but fault on its instructions, and llama-server then dies of SIGILL
# in its AMX matmul at the first prompt. Engram does not use AMX either. A build made before
# these flags is rebuilt.
LLAMACPP_CPU_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

build_llamacpp() {
    local missing=() t
    if ! grep -qs -- "$LLAMACPP_CPU_FLAGS" "$llamacpp_root/build/CMakeCache.txt"; then
        rm -rf "$llamacpp_root/build"
    fi
    for t in "$@"; do
        [[ -x "$llamacpp_bin/$t" ]] || missing+=("$t")
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "reusing llama.cpp's $* in $llamacpp_bin"
        return 0
    fi
    command -v cmake >/dev/null || apt_install cmake cmake
    fetch_llamacpp_source
    local src="$llamacpp_src"

    # CPU only, static (so the binaries do not depend on the build tree's .so files), tuned for
    # this machine like Engram's release build. This llama.cpp has no LLAMA_CURL any more (it is
    # deprecated and ignored); downloads go through LLAMA_OPENSSL, which no benchmark uses.
    local start=$SECONDS
    log "configuring llama.cpp (CPU only) in $llamacpp_root/build"
    cmake -S "$src/vendor/llama.cpp" -B "$llamacpp_root/build" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$LLAMACPP_CPU_FLAGS" -DCMAKE_CXX_FLAGS="$LLAMACPP_CPU_FLAGS" \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
        -DGGML_CCACHE=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF >&2
    log "building ${missing[*]} (-j${LLAMACPP_JOBS:-2}); this takes a while on few cores"
    cmake --build "$llamacpp_root/build" --config Release --target "${missing[@]}" \
        -j "${LLAMACPP_JOBS:-2}" >&2
    for t in "${missing[@]}"; do
        [[ -x "$llamacpp_bin/$t" ]] || die "build finished but llama.cpp's $t is missing"
    done
    log "built llama.cpp's ${missing[*]} in $((SECONDS - start)) s"
}

# Builds bench/golden/kquant_golden.cpp, the golden files' reference tool, at $1 against the
# static libraries llama-bench's build leaves (building it first when missing).
build_kquant_golden() {
    local out="$1" tool
    tool="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/golden/kquant_golden.cpp"
    build_llamacpp llama-bench
    local src="$llamacpp_root/src/vendor/llama.cpp" build="$llamacpp_root/build" l
    local libs=("$build/src/libllama.a" "$build/ggml/src/libggml.a" "$build/ggml/src/libggml-cpu.a"
                "$build/ggml/src/libggml-base.a")
    for l in "${libs[@]}"; do
        [[ -f "$l" ]] || die "$l is missing: delete $build and run this again"
    done
    log "building kquant_golden against $build"
    "${CXX:-c++}" -O2 -std=c++17 "$tool" -I"$src/include" -I"$src/ggml/include" \
        "${libs[@]}" -fopenmp -lpthread -ldl -o "$out"
}
