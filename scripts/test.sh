#!/usr/bin/env bash
# Runs everything CI runs, on a fresh machine too: fetches the default models (checked by
# sha256), then format check, clippy with warnings as errors (also of the `cuda` feature's GPU
# code), the CUDA kernels compiled by NVRTC (fetched from its wheel; no GPU needed), the whole
# test suite against the real models and ../shared/golden, the API and console end-to-end
# checks, a bounded run of the fault-injection suite (tests/faults), the .deb's checks
# (tests/appliance/deb.sh) and the appliance's lifecycle on installed systems
# (tests/appliance/run.sh: root, 7 to 19 minutes on this project's 2-core machines; the
# installer ISO and the installed disk's boots run under QEMU's software emulation).
#
# Everything is built once, in the cargo profile `ci` (Cargo.toml: the release build, with the
# kernels' raw-pointer guards kept in by ENGRAM_CHECKED): clippy, the tests, the end-to-end
# checks, the fault injection, the .deb and the media all use that one build (ENGRAM_PROFILE).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage prints the seconds since the start, so a CI log shows where the time goes (the CI
# limit is 90 minutes; docs/bench/2026-12-07-ci-time.md).
T0=$(date +%s)
stage() { echo "test: [$(($(date +%s) - T0)) s] $*"; }
export ENGRAM_PROFILE=ci ENGRAM_CHECKED=1

echo "test: $(df -h --output=avail . | tail -1 | tr -d ' ') free on $(df --output=target . | tail -1)"
[[ -d "${ENGRAM_SHARED_DIR:-../shared}/golden" ]] || {
    echo "test: ../shared/golden not found (set ENGRAM_SHARED_DIR)" >&2
    exit 1
}

# What the later stages download and install (the models, NVRTC, the Python and npm packages,
# Chromium, lintian, QEMU and the media tools, the media's Debian packages and the installer's
# live system) waits on the network and the disk more than on the CPU: it runs in the
# background, at a lower priority, while the workspace compiles, and every stage after the
# build waits for it.
mkdir -p target
PREPARE_LOG=target/test-prepare.log
(
    scripts/fetch-models.sh >/dev/null
    scripts/fetch-nvrtc.sh >/dev/null
    # OCR's tools, which the tests run for real (ENGRAM_REQUIRE_OCR below).
    if ! command -v tesseract >/dev/null || ! command -v pdftoppm >/dev/null \
        || ! tesseract --list-langs 2>/dev/null | grep -qx chi_sim; then
        SUDO=$([[ $(id -u) == 0 ]] || echo sudo)
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq tesseract-ocr \
            tesseract-ocr-eng tesseract-ocr-chi-sim poppler-utils >/dev/null
    fi
    scripts/test-api.sh --prepare
    scripts/test-ui.sh --prepare
    tests/appliance/deb.sh --prepare
    tests/appliance/run.sh --prepare
) >"$PREPARE_LOG" 2>&1 &
PREPARE=$!
renice -n 10 -p "$PREPARE" >/dev/null
prepared() {
    local t=$(($(date +%s) - T0))
    wait "$PREPARE" || {
        tail -n 30 "$PREPARE_LOG" >&2
        echo "test: fetching and installing what the tests need failed (log: $PREPARE_LOG)" >&2
        exit 1
    }
    echo "test: [$t s] downloads and installs done (log: $PREPARE_LOG; waited $(($(date +%s) - T0 - t)) s)"
}

stage "format check"
cargo fmt --all --check
stage "clippy"
cargo clippy --profile ci --workspace --all-targets --locked -- -D warnings
# engramd and engram have GPU support by default (the `cuda` feature: CUDA loaded at run time,
# its kernels' source compiled by NVRTC, none of it needing a GPU to build or lint): the CPU-only
# build they make with --no-default-features is linted too.
stage "clippy of the CPU-only build"
cargo clippy --profile ci -p engram-cli -p engram-server --no-default-features --all-targets \
    --locked -- -D warnings
# The workspace's tests include engram-kernels-cuda's, whose CUDA source NVRTC compiles for every
# supported architecture: with NVRTC on the library path and required, in the same build (a
# separate `cargo test -p engram-kernels-cuda` compiled its dependencies again, with other
# features: about 150 s). The one build also gives the engramd and engram that the end-to-end
# checks, the fault injection, the .deb and the media use (after it, `cargo build --profile ci
# -p engram-server -p engram-cli` compiles nothing).
stage "build of the tests (profile ci)"
cargo test --workspace --locked --profile ci --no-run
prepared
stage "cargo test (the CUDA kernels through NVRTC among them)"
# Both NVRTCs the appliance may run with: NVIDIA's newest and the media's CUDA 11.8.
nvrtc_lib="$(scripts/fetch-nvrtc.sh)"
ENGRAM_REQUIRE_OCR=1 ENGRAM_REQUIRE_NVRTC=1 ENGRAM_NVRTC_LIBS="$nvrtc_lib/libnvrtc.so.13:$nvrtc_lib/libnvrtc.so.11.2" \
    LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --workspace --locked --profile ci
stage "API end to end"
scripts/test-api.sh
stage "console end to end"
scripts/test-ui.sh
stage "fault injection"
tests/faults/run.sh --ci
stage ".deb checks"
tests/appliance/deb.sh --no-build
stage "appliance lifecycle"
tests/appliance/run.sh
stage "done"
