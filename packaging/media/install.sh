#!/bin/sh
# Installs or upgrades Engram on a Debian 12 host from this medium, with no network:
#
#   mount engram-VERSION-bundle.iso /mnt && sh /mnt/install.sh [VERSION]
#
# Checks the medium against its signed SHA256SUMS, installs its key as
# /usr/share/keyrings/engram-archive-keyring.gpg, and installs the newest engram on the medium,
# or VERSION (a rollback: an upgrade bundle carries the previous version too), with apt reading
# only this medium. An upgrade or rollback snapshots the data first
# (/usr/share/doc/engram/upgrade.md.gz). Where lspci shows an NVIDIA GPU, gpu-stack.sh then adds
# the NVIDIA driver and CUDA runtime the medium carries (ENGRAM_GPU_STACK=no: not).
set -eu

MEDIUM=$(cd "$(dirname "$0")" && pwd)
die() { echo "engram install: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run it as root"
grep -q '^VERSION_ID="12"' /etc/os-release 2>/dev/null || die "this medium is for Debian 12 (bookworm)"

echo "engram install: checking $MEDIUM"
gpgv --keyring "$MEDIUM/engram-archive-keyring.gpg" "$MEDIUM/SHA256SUMS.gpg" "$MEDIUM/SHA256SUMS" 2>/dev/null \
    || die "SHA256SUMS is not signed by the key on this medium"
(cd "$MEDIUM" && sha256sum --quiet --strict -c SHA256SUMS) || die "the medium is damaged: a file does not match SHA256SUMS"

install -m 0644 "$MEDIUM/engram-archive-keyring.gpg" /usr/share/keyrings/engram-archive-keyring.gpg
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "deb [signed-by=/usr/share/keyrings/engram-archive-keyring.gpg] file:$MEDIUM bookworm main" >"$TMP/engram.list"
# Only this medium: no network is needed or tried.
APT="-o Dir::Etc::SourceList=$TMP/engram.list -o Dir::Etc::SourceParts=- -o Acquire::Languages=none -o APT::Get::List-Cleanup=false"
PKG=engram
[ $# -gt 0 ] && PKG="engram=$1 --allow-downgrades"
# shellcheck disable=SC2086
apt-get $APT update -qq
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive apt-get $APT install -y -o Dpkg::Options::=--force-confold $PKG
# The GPU stack (NVIDIA driver, CUDA runtime) where lspci shows an NVIDIA GPU; ENGRAM_GPU_STACK
# =no leaves it out. engramd serves from the CPU until it is in and the driver loaded.
sh "$MEDIUM/gpu-stack.sh" "$MEDIUM" || echo "engram install: the GPU stack was not installed: engramd serves from the CPU"
echo "engram install: $(engramd -V) installed; console: http://127.0.0.1:8080/console/ (first admin password: /var/lib/engram/initial-admin-password)"
