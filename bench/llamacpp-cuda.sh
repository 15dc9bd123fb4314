#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-batched-bench with CUDA, on a machine without a GPU
# or a CUDA toolkit, for bench/gpu-vs-llamacpp.sh to run on the GPU machine (which has no Rust
# and no network): the llama.cpp that bench/llamacpp.sh pins, compiled by CUDA 13's nvcc from
# NVIDIA's pip wheels (nvcc, NVVM, runtime, CCCL, CRT, cuBLAS) for one architecture, and packed
# with a stripped Engram binary into one archive small enough to send.
#
#   bench/llamacpp-cuda.sh [ARCH] [BUNDLE]       # ARCH 90 (H100/H200); BUNDLE
#                                                # .gpu-carry/bundle.tar.xz
#
# The bundle unpacks to engram and llama/ (the tools, their libraries, CPU variants for x86-64,
# AVX2, AVX-512 Zen 4 and Sapphire Rapids, and libgomp). To fit 2 cores and no libcuda stub:
# flash attention compiled out (-DGGML_CUDA_FA=OFF; run llama-bench with -fa 0) and the CUDA
# virtual-memory pool off (-DGGML_CUDA_NO_VMM=ON); CUDA graphs stay on. About 16 minutes on the
# 2-core development machine; the engram binary comes from
# `cargo build --release --features cuda -p engram-cli` (built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "llamacpp-cuda: $*" >&2; }
die() {
    log "$*"
    exit 1
}
# shellcheck source=bench/llamacpp.sh
source bench/llamacpp.sh

ARCH="${1:-90}"
BUNDLE="${2:-.gpu-carry/bundle.tar.xz}"
CUDA_VERSION="13.0.*"
toolkit="$llamacpp_cache/cuda-13-wheels"
cuda="$toolkit/nvidia/cu13"
build="$llamacpp_root/build-cuda-sm$ARCH"

# CUDA 13's compiler and the headers and libraries llama.cpp links, from NVIDIA's wheels.
if [[ ! -x "$cuda/bin/nvcc" || ! -f "$cuda/lib/libcublas.so.13" ]]; then
    log "downloading CUDA $CUDA_VERSION wheels"
    mkdir -p "$toolkit/wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
        -d "$toolkit/wheels" "nvidia-cuda-nvcc==$CUDA_VERSION" "nvidia-nvvm==$CUDA_VERSION" \
        "nvidia-cuda-runtime==$CUDA_VERSION" "nvidia-cuda-cccl==$CUDA_VERSION" \
        "nvidia-cuda-crt==$CUDA_VERSION" "nvidia-cublas==$CUDA_VERSION" \
        || die "pip download of the CUDA wheels failed"
    for w in "$toolkit"/wheels/*.whl; do
        python3 -m zipfile -e "$w" "$toolkit"
    done
    chmod +x "$cuda"/bin/* "$cuda"/nvvm/bin/*
    # The layout nvcc.profile and CMake's FindCUDAToolkit expect.
    ln -sfn lib "$cuda/lib64"
    for l in libcudart libcublas libcublasLt; do
        ln -sf "$l.so.13" "$cuda/lib/$l.so"
    done
fi
export PATH="$cuda/bin:$PATH"

fetch_llamacpp_source
if [[ ! -f "$build/CMakeCache.txt" ]]; then
    log "configuring llama.cpp with CUDA for sm_$ARCH in $build"
    cmake -S "$llamacpp_src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" \
        -DCUDAToolkit_ROOT="$cuda" -DGGML_CUDA_FA=OFF -DGGML_CUDA_NO_VMM=ON \
        -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
fi
start=$SECONDS
jobs="${LLAMACPP_JOBS:-2}"
# With GGML_BACKEND_DL the ggml target depends on every CPU variant: build the ones shipped,
# then the rest without their dependency checks (make's `/fast` targets).
make -C "$build" -j "$jobs" ggml-cuda ggml-cpu-x64 ggml-cpu-haswell ggml-cpu-zen4 \
    ggml-cpu-sapphirerapids >&2
for t in ggml-base ggml llama llama-common-base llama-common llama-bench-impl \
    llama-batched-bench-impl llama-bench llama-batched-bench; do
    make -C "$build" -j "$jobs" "$t/fast" >&2
done
log "built in $((SECONDS - start)) s"

[[ -x target/release/engram ]] || cargo build --release --features cuda -p engram-cli >&2
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/llama" "$(dirname "$BUNDLE")"
strip -o "$stage/engram" target/release/engram
for f in llama-bench llama-batched-bench libllama-bench-impl.so libllama-batched-bench-impl.so \
    libggml-base.so.0 libggml.so.0 libllama.so.0 libllama-common.so.0 libggml-cuda.so \
    libggml-cpu-x64.so libggml-cpu-haswell.so libggml-cpu-zen4.so libggml-cpu-sapphirerapids.so; do
    cp -L "$build/bin/$f" "$stage/llama/"
done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$stage/llama/"
strip "$stage"/llama/*
tar -cJf "$BUNDLE" -C "$stage" .
log "wrote $BUNDLE ($(du -h "$BUNDLE" | cut -f1)); on the GPU machine:"
log "  tar -xJf $BUNDLE -C /tmp/e && bench/gpu-vs-llamacpp.sh /tmp/e/engram /tmp/e/llama \$OUT"
