#!/usr/bin/env bash
# Fetches NVIDIA's NVRTC (the CUDA C compiler library, no GPU needed) from its PyPI wheel,
# checked by sha256, so the tests can compile Engram's CUDA kernels on machines without CUDA.
# Prints the folder holding libnvrtc.so.13, for LD_LIBRARY_PATH.
#
#   scripts/fetch-nvrtc.sh [DIR]      (default: $HOME/.cache/engram/nvrtc)
#
# Idempotent and offline once fetched. The appliance itself uses the NVRTC of the CUDA
# installation on the GPU server (the driver's and toolkit's libraries); this copy is for tests.
set -euo pipefail

dir="${1:-$HOME/.cache/engram/nvrtc}"
REQ="nvidia-cuda-nvrtc==13.5.37"
WHEEL="nvidia_cuda_nvrtc-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
WHEEL_SHA="86b4d68058807988b7d9af5b44917a0601e9c337f35ccd657bfb3c759ff8d8bc"

die() { echo "fetch-nvrtc: error: $*" >&2; exit 1; }
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

lib="$dir/lib"
if [[ -f "$lib/libnvrtc.so.13" && -f "$dir/.wheel-sha256" && "$(cat "$dir/.wheel-sha256")" == "$WHEEL_SHA" ]]; then
    echo "$lib"
    exit 0
fi
mkdir -p "$dir/.wheels"
if [[ ! -f "$dir/.wheels/$WHEEL" || "$(sha_of "$dir/.wheels/$WHEEL")" != "$WHEEL_SHA" ]]; then
    echo "fetch-nvrtc: downloading $REQ from PyPI" >&2
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        --only-binary=:all: --platform manylinux_2_12_x86_64 --dest "$dir/.wheels" "$REQ" >&2 ||
        die "could not download $REQ (offline? copy $WHEEL into $dir/.wheels and re-run)"
    got="$(sha_of "$dir/.wheels/$WHEEL")"
    [[ "$got" == "$WHEEL_SHA" ]] || { rm -f "$dir/.wheels/$WHEEL"; die "$WHEEL has sha256 $got, expected $WHEEL_SHA"; }
fi
tmp="$(mktemp -d "$dir/.extract.XXXXXX")"
python3 - "$dir/.wheels/$WHEEL" "$tmp" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for n in z.namelist():
        if "/lib/libnvrtc" in n:
            with z.open(n) as src, open(os.path.join(out, os.path.basename(n)), "wb") as dst:
                dst.write(src.read())
PY
[[ -f "$tmp/libnvrtc.so.13" ]] || { rm -rf "$tmp"; die "libnvrtc.so.13 not in $WHEEL"; }
rm -rf "$lib"
mv "$tmp" "$lib"
echo "$WHEEL_SHA" > "$dir/.wheel-sha256"
echo "$lib"
