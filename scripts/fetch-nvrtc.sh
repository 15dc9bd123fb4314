#!/usr/bin/env bash
# Fetches two NVRTC libraries (the CUDA C compiler, no GPU needed), checked by sha256, so the
# tests compile Engram's CUDA kernels with each NVRTC it may run with, on machines without CUDA:
# NVIDIA's newest, from its PyPI wheel (libnvrtc.so.13), and the CUDA 11.8 one the offline media
# carry for Debian 12's driver 535, from Debian's non-free packages libnvrtc11.2 and
# libnvrtc-builtins11.8 (libnvrtc.so.11.2; packaging/README.md says why that one).
# Prints the folder holding both, for LD_LIBRARY_PATH.
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
DEBIAN=${ENGRAM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_VERSION="11.8.89~11.8.0-5~deb12u1"
DEBS=(
    "pool/non-free/n/nvidia-cuda-toolkit/libnvrtc11.2_${DEBIAN_VERSION}_amd64.deb 051b70a3d8737eae470b4158e234cf112c803f631b2c77ae60a24a1146309c22"
    "pool/non-free/n/nvidia-cuda-toolkit/libnvrtc-builtins11.8_${DEBIAN_VERSION}_amd64.deb e446e112c304b86a35925bea6a3991a866a29736fac261adb218ec29efb49bb8"
)
STAMP=$(printf '%s\n' "$WHEEL_SHA" "${DEBS[@]}" | sha256sum | cut -d' ' -f1)

die() { echo "fetch-nvrtc: error: $*" >&2; exit 1; }
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

lib="$dir/lib"
if [[ -f "$lib/libnvrtc.so.13" && -f "$lib/libnvrtc.so.11.2" && -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$STAMP" ]]; then
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
for entry in "${DEBS[@]}"; do
    read -r path sha <<<"$entry"
    deb="$dir/.debs/${path##*/}"
    mkdir -p "$dir/.debs"
    if [[ ! -f "$deb" || "$(sha_of "$deb")" != "$sha" ]]; then
        echo "fetch-nvrtc: downloading ${path##*/} from $DEBIAN" >&2
        curl -fsSL --retry 3 -o "$deb.part" "$DEBIAN/$path" ||
            { rm -rf "$tmp"; die "could not download $DEBIAN/$path (offline? copy it into $dir/.debs)"; }
        mv "$deb.part" "$deb"
    fi
    got="$(sha_of "$deb")"
    [[ "$got" == "$sha" ]] || { rm -f "$deb" "$tmp"; die "${deb##*/} has sha256 $got, expected $sha"; }
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" --wildcards --strip-components=4 './usr/lib/x86_64-linux-gnu/*'
done
[[ -f "$tmp/libnvrtc.so.11.2" ]] || { rm -rf "$tmp"; die "libnvrtc.so.11.2 not in Debian's libnvrtc11.2"; }
rm -rf "$lib"
mv "$tmp" "$lib"
rm -f "$dir/.wheel-sha256"
echo "$STAMP" > "$dir/.stamp"
echo "$lib"
