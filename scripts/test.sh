#!/usr/bin/env bash
# Runs everything CI runs, on a fresh machine too: fetches the default models (checked by
# sha256), then format check, clippy with warnings as errors (also of the `cuda` feature's GPU
# code), the CUDA kernels compiled by NVRTC (fetched from its wheel; no GPU needed), the whole
# test suite (in release) against the real models and ../shared/golden, the API and console
# end-to-end checks, a bounded run of the fault-injection suite (tests/faults), the .deb's checks
# (tests/appliance/deb.sh) and the appliance's lifecycle on installed systems
# (tests/appliance/run.sh: root, 8 to 19 minutes on this project's 2-core machines, about half
# of it building the media; the installer ISO and the installed disk's boots run under QEMU's
# software emulation).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage prints the seconds since the start, so a CI log shows where the time goes (the CI
# limit is 90 minutes).
T0=$(date +%s)
stage() { echo "test: [$(($(date +%s) - T0)) s] $*"; }

echo "test: $(df -h --output=avail . | tail -1 | tr -d ' ') free on $(df --output=target . | tail -1)"
scripts/fetch-models.sh >/dev/null
[[ -d "${ENGRAM_SHARED_DIR:-../shared}/golden" ]] || {
    echo "test: ../shared/golden not found (set ENGRAM_SHARED_DIR)" >&2
    exit 1
}

stage "format check"
cargo fmt --all --check
stage "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The GPU code builds and lints without CUDA (loaded at run time); its kernels' CUDA source is
# compiled by NVRTC, which needs no GPU.
stage "clippy of the cuda feature"
cargo clippy -p engram-cli -p engram-server --features engram-cli/cuda,engram-server/cuda --all-targets --locked -- -D warnings
# The workspace's tests include engram-kernels-cuda's, whose CUDA source NVRTC compiles for every
# supported architecture: with NVRTC on the library path and required, in the same build (a
# separate `cargo test -p engram-kernels-cuda` compiled its dependencies again, with other
# features: about 150 s).
# The tests run in release: the one build then also gives the release engramd and engram the
# end-to-end checks, the fault injection, the .deb and the media use (after it, `cargo build
# --release -p engram-server -p engram-cli` compiles nothing), where a debug test build came on
# top of that release build (docs/bench/2026-12-02-ci-time.md). So the tests run what ships,
# without debug builds' overflow checks and debug_assert!.
stage "cargo test --release (the CUDA kernels through NVRTC among them)"
nvrtc_lib="$(scripts/fetch-nvrtc.sh)"
ENGRAM_REQUIRE_NVRTC=1 LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --workspace --locked --release
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
