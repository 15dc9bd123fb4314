#!/bin/sh
# Installs the GPU stack an Engram medium carries (its gpu-packages: Debian 12's NVIDIA driver
# and the CUDA runtime libraries engramd opens) where the machine has an NVIDIA GPU, from the
# medium alone:
#
#   gpu-stack.sh MEDIUM [ROOT]
#
# MEDIUM is the medium's folder (its repository), ROOT the system to install into (default /;
# the installer passes its target, which must see MEDIUM at the same path). ENGRAM_GPU_STACK
# decides: auto (the default: when lspci shows an NVIDIA display or 3D controller), yes, no.
# On a host whose NVIDIA driver did not come from Debian's packages (NVIDIA's .run installer or
# CUDA repository), the driver is left alone and only the CUDA runtime libraries are added.
# Says what it did on one line per step; exits non-zero only when an install it chose failed.
set -eu

MEDIUM=$1
ROOT=${2:-/}
say() { echo "engram gpu: $*"; }
in_root() { if [ "$ROOT" = / ]; then "$@"; else chroot "$ROOT" "$@"; fi; }

# NVIDIA's PCI vendor id is 10de; display controllers are class 0300 (VGA) and 0302 (3D: the
# data-centre GPUs).
nvidia_devices() {
    if command -v lspci >/dev/null 2>&1; then
        { lspci -mm -nn -d 10de::0300; lspci -mm -nn -d 10de::0302; } 2>/dev/null | sed 's/"//g'
    else
        for d in /sys/bus/pci/devices/*; do
            [ "$(cat "$d/vendor" 2>/dev/null)" = 0x10de ] || continue
            case $(cat "$d/class" 2>/dev/null) in 0x0300* | 0x0302*) echo "${d##*/} (NVIDIA, sysfs)" ;; esac
        done
    fi
}

choice=${ENGRAM_GPU_STACK:-auto}
case $choice in
    no)
        say "ENGRAM_GPU_STACK=no: the GPU stack is not installed"
        exit 0
        ;;
    yes) say "ENGRAM_GPU_STACK=yes: installing the GPU stack" ;;
    auto)
        devices=$(nvidia_devices)
        if [ -z "$devices" ]; then
            say "no NVIDIA GPU on the PCI bus: the GPU stack is not installed; engramd serves from the CPU"
            exit 0
        fi
        say "NVIDIA GPU on the PCI bus:"
        echo "$devices" | sed 's/^/engram gpu:   /'
        ;;
    *)
        say "ENGRAM_GPU_STACK must be auto, yes or no, not $choice"
        exit 2
        ;;
esac

[ -s "$MEDIUM/gpu-packages" ] || { say "this medium carries no GPU stack ($MEDIUM/gpu-packages)"; exit 1; }
packages=$(cat "$MEDIUM/gpu-packages")
# A driver from elsewhere (libcuda present, Debian's libcuda1 not installed) stays: two
# drivers on one system break both. The runtime libraries go in beside it.
if in_root sh -c 'ldconfig -p | grep -q "libcuda\.so\.1 "' \
    && ! in_root dpkg-query -W -f '${Status}' libcuda1 2>/dev/null | grep -q 'ok installed'; then
    say "an NVIDIA driver not from Debian's packages is installed: it is kept; adding only the CUDA runtime libraries"
    packages=$(echo "$packages" | tr ' ' '\n' | grep -E '^(libnvrtc|libcublas)' | xargs)
fi

list=$(in_root mktemp)
lists=$(in_root mktemp -d)
echo "deb [signed-by=/usr/share/keyrings/engram-archive-keyring.gpg] file:$MEDIUM bookworm main contrib non-free non-free-firmware" \
    >"$ROOT/$list"
APT="-o Dir::Etc::SourceList=$list -o Dir::Etc::SourceParts=- -o Dir::State::Lists=$lists -o Acquire::Languages=none"
cleanup() { rm -rf "$ROOT/$list" "$ROOT/$lists"; }
trap cleanup EXIT
# shellcheck disable=SC2086
in_root apt-get $APT update -qq
say "installing $packages (the kernel module is built by DKMS for the installed kernel: a few minutes)"
# shellcheck disable=SC2086
if ! in_root env DEBIAN_FRONTEND=noninteractive apt-get $APT install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confold $packages; then
    say "FAILED to install the GPU stack: engramd will serve from the CPU (see the apt output above)"
    exit 1
fi
for k in "$ROOT"/lib/modules/*; do
    if [ -n "$(find "$k/updates" -name 'nvidia*.ko*' 2>/dev/null | head -1)" ]; then
        say "NVIDIA kernel module built for ${k##*/}"
    fi
done
say "installed: $(in_root dpkg-query -W -f '${Package} ${Version}\n' $packages 2>/dev/null | paste -sd, - | sed 's/,/, /g')"
if [ "$ROOT" = / ]; then
    say "reboot to load the NVIDIA driver (it replaces nouveau, which it blacklists); engramd uses the GPU from its next start"
fi
