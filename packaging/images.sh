#!/usr/bin/env bash
# Builds Engram's offline media from this checkout (root: mmdebstrap, xorriso):
#
#   packaging/images.sh [--version V] [--previous DEB] [--installer] [--no-build] [--out DIR]
#   packaging/images.sh --prefetch
#
# into DIR (target/appliance):
#   engram_V_amd64.deb        the package (packaging/deb/build.sh)
#   repo-V/                   the signed offline apt repository (packaging/repo/build.sh):
#                             /dists, /pool, /engram-archive-keyring.gpg, plus install.sh,
#                             README.txt and SHA256SUMS with its signature SHA256SUMS.gpg
#   engram-V-bundle.iso       that tree as an ISO 9660 image, for an existing Debian 12 host:
#                             mount it and run install.sh (also the upgrade bundle: with
#                             --previous, the older .deb is on it too, for a rollback)
#   engram-V-installer.iso    with --installer: the bootable installer (hybrid BIOS + UEFI,
#                             GRUB): a Debian live system (packaging/installer/) whose
#                             engram-install partitions a disk and copies onto it the system
#                             image install/system.squashfs (Debian and Engram, installed here
#                             from the same repository, which the ISO also carries), then
#                             configures it for the server, unattended with an answer file
#                             (packaging/installer/answers.example.conf)
#
# --prefetch only downloads, ahead of the build: the Debian packages of the repository and of
# the installer's live system, into target/appliance/cache/debs (CI runs it while it compiles).
#
# Signing: ENGRAM_ARCHIVE_GNUPGHOME (see packaging/repo/build.sh); without it a throwaway key.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
OUT=target/appliance
PREVIOUS=
INSTALLER=0
PREFETCH=0
DEB_ARGS=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --prefetch) PREFETCH=1; shift ;;
        --version) VERSION=$2; shift 2 ;;
        --previous) PREVIOUS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --installer) INSTALLER=1; shift ;;
        --no-build) DEB_ARGS+=(--no-build); shift ;;
        *) echo "images: unknown argument $1" >&2; exit 2 ;;
    esac
done
die() { echo "images: $*" >&2; exit 1; }
command -v mmdebstrap >/dev/null && command -v xorriso >/dev/null && command -v apt-ftparchive >/dev/null \
    || die "needs mmdebstrap, xorriso and apt-utils (apt-get install mmdebstrap xorriso apt-utils)"
mkdir -p "$OUT"

I=$PWD/packaging/installer
# What the repository carries beside the packages' own dependencies: what the installer puts on
# a disk.
REPO_PACKAGES="systemd systemd-sysv dbus apt udev kmod e2fsprogs dosfstools linux-image-amd64 initramfs-tools grub-pc grub-efi-amd64-bin"
# The GPU stack (the NVIDIA driver and CUDA runtime, non-free), which the installer adds where
# lspci shows an NVIDIA device: packaging/gpu-packages, one per line.
GPU_PACKAGES=$(sed 's/#.*//' packaging/gpu-packages | xargs)
# The installer's live system (pciutils: lspci finds the GPUs).
LIVE_PACKAGES="linux-image-amd64 live-boot systemd-sysv udev kmod squashfs-tools gpgv grub-pc-bin grub-efi-amd64-bin grub2-common e2fsprogs dosfstools fdisk util-linux pciutils"
if [[ $PREFETCH == 1 ]]; then
    packaging/repo/build.sh --resolve-only --packages "$REPO_PACKAGES" --gpu-packages "$GPU_PACKAGES" \
        --depends "$(packaging/deb/build.sh --print-depends)"
    packaging/repo/build.sh --resolve-only --packages "$LIVE_PACKAGES"
    exit 0
fi

# The installer's live system, into $LIVE: built once per package list and installer files
# (cached), from the Debian packages the repository script downloaded where it has them.
key=$( (echo "$LIVE_PACKAGES"; cat "$I/engram-install" "$I/engram-installer.service") | sha256sum | cut -c1-16)
LIVE=$(realpath -m "$OUT/cache/live-$key")
DEBS_CACHE=$(realpath -m "$OUT/cache/debs")
build_live() {
    [[ -s $LIVE/filesystem.squashfs ]] && return 0
    echo "images: building the installer's live system" >&2
    rm -rf "$OUT"/cache/live-*
    mkdir -p "$LIVE"
    mmdebstrap --quiet --variant=minbase --include="${LIVE_PACKAGES// /,}" \
        --setup-hook='mkdir -p "$1/var/cache/apt/archives"; cp '"$DEBS_CACHE"'/*.deb "$1/var/cache/apt/archives/" 2>/dev/null || true' \
        --customize-hook='install -m 0755 '"$I"'/engram-install "$1/usr/sbin/engram-install"' \
        --customize-hook='install -m 0644 '"$I"'/engram-installer.service "$1/lib/systemd/system/"' \
        --customize-hook='ln -s /lib/systemd/system/engram-installer.service "$1/etc/systemd/system/multi-user.target.wants/"' \
        --customize-hook='echo engram-installer >"$1/etc/hostname"' \
        --customize-hook='cp "$1"/boot/vmlinuz-* '"$LIVE"'/vmlinuz; cp "$1"/boot/initrd.img-* '"$LIVE"'/initrd.img' \
        --customize-hook='rm -rf "$1"/boot/* "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
        bookworm "$LIVE/root" "${ENGRAM_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2 \
        || die "mmdebstrap could not build the live system"
    # zstd level 6, as the system image's (CI builds it every run).
    mksquashfs "$LIVE/root" "$LIVE/filesystem.squashfs" -comp zstd -Xcompression-level 6 \
        -quiet -no-progress -noappend >&2 || die "mksquashfs"
    rm -rf "$LIVE/root"
}
# It needs nothing of this build: it runs beside the package and the system image (each mostly
# one dpkg at a time).
LIVE_PID=
if [[ $INSTALLER == 1 ]]; then
    build_live &
    LIVE_PID=$!
fi

# The non-free packages on the medium and the licence each one's copyright file names: what an
# operator accepts by installing the GPU stack.
licence_lines() {
    local f name licence
    find "$1/pool/non-free" "$1/pool/non-free-firmware" "$1/pool/contrib" -name '*.deb' 2>/dev/null | sort \
        | while read -r f; do
            name=$(dpkg-deb -f "$f" Package)
            licence=$(dpkg-deb --fsys-tarfile "$f" \
                | tar -xO --wildcards "./usr/share/doc/$name/copyright" 2>/dev/null \
                | sed -n 's/^License: *//p' | sort -u | paste -sd, - | sed 's/,/, /g')
            printf '  %-36s %s: %s\n' "$name $(dpkg-deb -f "$f" Version)" \
                "$(dpkg-deb -f "$f" Section | cut -d/ -f1)" "${licence:-see its copyright file}"
        done
}
DEB=$(packaging/deb/build.sh --version "$VERSION" --out "$OUT" "${DEB_ARGS[@]}")
debs=("$DEB")
[[ -n $PREVIOUS ]] && debs+=("$PREVIOUS")
REPO=$OUT/repo-$VERSION
packaging/repo/build.sh --out "$REPO" --packages "$REPO_PACKAGES" --gpu-packages "$GPU_PACKAGES" "${debs[@]}"

install -m 0755 packaging/media/install.sh packaging/media/gpu-stack.sh "$REPO/"
echo "$GPU_PACKAGES" >"$REPO/gpu-packages"
cat >"$REPO/README.txt" <<README
Engram $VERSION: offline installation medium for Debian 12 (bookworm), amd64.

  mount -o ro engram-$VERSION-bundle.iso /mnt && sh /mnt/install.sh

installs (or upgrades to) Engram $VERSION from this medium alone; an upgrade snapshots the
data first. Roll back with: sh /mnt/install.sh OLD-VERSION (a version this medium holds).
Check the medium by hand with:
  gpgv --keyring ./engram-archive-keyring.gpg SHA256SUMS.gpg SHA256SUMS && sha256sum -c SHA256SUMS
Packages on it: $(find "$REPO/pool" -name 'engram_*.deb' -printf '%f ' )

GPU servers: where lspci shows an NVIDIA device, install.sh (and the installer ISO) also
install the GPU stack this medium carries (gpu-packages, by gpu-stack.sh): Debian 12's NVIDIA
driver $(dpkg-deb -f "$(find "$REPO/pool" -name 'nvidia-kernel-dkms_*.deb' | head -1)" Version), its kernel module built by DKMS for the installed kernel, and
the CUDA 11.8 runtime libraries engramd opens (NVRTC, cuBLAS). ENGRAM_GPU_STACK=no leaves it
out, =yes installs it without a device (installer: engram.gpu=no|yes on the kernel command line).
Secure Boot: the DKMS module is not signed by a key the firmware trusts; turn Secure Boot off
or enrol a machine owner key (Debian's dkms signs with /var/lib/dkms/mok.key).

Licences (each package's own terms are in /usr/share/doc/PACKAGE/copyright once installed):
  main: free software under the Debian Free Software Guidelines; Engram itself is
  $(sed -n 's/^license = "\(.*\)"/\1/p' Cargo.toml | head -1).
  The others, by package (component: the licences its copyright file names):
$(licence_lines "$REPO")
README
# The whole medium's checksums, signed with the archive key (the repository script's GnuPG home).
export GNUPGHOME=${ENGRAM_ARCHIVE_GNUPGHOME:-$PWD/target/appliance/throwaway-gnupg}
sign_medium() {
    (cd "$1" && find . -type f ! -name SHA256SUMS ! -name SHA256SUMS.gpg | sed 's|^\./||' | sort \
        | xargs sha256sum >SHA256SUMS)
    gpg --batch --quiet --yes --detach-sign -o "$1/SHA256SUMS.gpg" "$1/SHA256SUMS"
}
sign_medium "$REPO"

ISO=$OUT/engram-$VERSION-bundle.iso
label=ENGRAM_$(tr -c 'A-Za-z0-9\n' _ <<<"$VERSION" | head -c 24)
xorriso -as mkisofs -quiet -r -J -joliet-long -V "$label" -o "$ISO" "$REPO" 2>/dev/null \
    || die "xorriso could not write $ISO"
echo "images: $ISO ($(du -h "$ISO" | cut -f1))" >&2
echo "$ISO"
[[ $INSTALLER == 1 ]] || exit 0

# The installed system, as one image. It is installed here, from this medium's repository alone,
# as `engram-install` once installed it on the server: under the installer's emulated or small
# CPU that install was nine tenths of the installer's time (one dpkg after another, the
# initramfs, 580 s of 640 s under QEMU), here it is native. What differs between servers (the
# disk's UUIDs, hostname, network, listen address, boot loaders, the first admin, the machine
# id) is set by `engram-install`, so the image holds nothing of one server.
SYSTEM_PACKAGES="systemd,systemd-sysv,dbus,apt,udev,kmod,e2fsprogs,dosfstools,linux-image-amd64,initramfs-tools,grub-pc,grub-efi-amd64-bin,engram"
SYSTEM=$(realpath -m "$OUT/system-$VERSION")
rm -rf "$SYSTEM" "$SYSTEM.squashfs"
REPO_ABS=$(realpath "$REPO")
echo "images: installing the system image from $REPO" >&2
unshare --net mmdebstrap --quiet --variant=minbase --include="$SYSTEM_PACKAGES" \
    --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount \
    --keyring="$REPO_ABS/engram-archive-keyring.gpg" \
    --aptopt='Acquire::Languages "none"' \
    --dpkgopt=force-unsafe-io \
    --customize-hook='rm -f "$1/etc/dpkg/dpkg.cfg.d/99mmdebstrap"' \
    --customize-hook='install -m 0644 '"$REPO_ABS"'/engram-archive-keyring.gpg "$1/usr/share/keyrings/"' \
    --customize-hook='echo "# Engram installs from its media: mount one and run its install.sh" >"$1/etc/apt/sources.list"' \
    --customize-hook='install -m 0755 '"$I"'/engram-console-issue "$1/usr/sbin/engram-console-issue"' \
    --customize-hook='install -m 0644 '"$I"'/engram-console-issue.service "$1/lib/systemd/system/"' \
    --customize-hook='ln -sf /lib/systemd/system/engram-console-issue.service "$1/etc/systemd/system/multi-user.target.wants/"' \
    --customize-hook='rm -f "$1/var/lib/dbus/machine-id" "$1/var/lib/systemd/random-seed"' \
    bookworm "$SYSTEM" "deb [signed-by=$REPO_ABS/engram-archive-keyring.gpg] file://$REPO_ABS bookworm main" >&2 \
    || die "mmdebstrap could not install the system image from $REPO"
[[ -x $SYSTEM/usr/bin/engramd ]] && compgen -G "$SYSTEM/boot/vmlinuz-*" >/dev/null \
    && compgen -G "$SYSTEM/boot/initrd.img-*" >/dev/null || die "the system image lacks engramd, the kernel or its initramfs"
# zstd level 6: level 15 (mksquashfs's default) took several times as long for a few per cent.
mksquashfs "$SYSTEM" "$SYSTEM.squashfs" -comp zstd -Xcompression-level 6 -quiet -no-progress -noappend >&2 \
    || die "mksquashfs (system image)"
rm -rf "$SYSTEM"

wait "$LIVE_PID" || die "the installer's live system was not built"

STAGE=$OUT/installer-$VERSION
rm -rf "$STAGE"
cp -al "$REPO" "$STAGE"
rm -f "$STAGE/SHA256SUMS" "$STAGE/SHA256SUMS.gpg"
mkdir -p "$STAGE/live" "$STAGE/boot/grub" "$STAGE/install"
cp "$LIVE/vmlinuz" "$LIVE/initrd.img" "$LIVE/filesystem.squashfs" "$STAGE/live/"
mv "$SYSTEM.squashfs" "$STAGE/install/system.squashfs"
install -m 0644 "$I/grub.cfg" "$STAGE/boot/grub/grub.cfg"
install -m 0644 "$I/answers.example.conf" "$STAGE/install/answers.conf"
sign_medium "$STAGE"
INSTALLER_ISO=$OUT/engram-$VERSION-installer.iso
grub-mkrescue -o "$INSTALLER_ISO" "$STAGE" -- -volid "$label" >/dev/null 2>&1 \
    || die "grub-mkrescue could not write $INSTALLER_ISO (grub-pc-bin, grub-efi-amd64-bin, mtools)"
rm -rf "$STAGE"
echo "images: $INSTALLER_ISO ($(du -h "$INSTALLER_ISO" | cut -f1))" >&2
echo "$INSTALLER_ISO"
