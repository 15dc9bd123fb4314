#!/usr/bin/env bash
# Builds Engram's signed offline apt repository: the given .debs plus every package a minimal
# Debian 12 needs to install and run them, laid out as Debian's own media are (/dists, /pool),
# with the public key beside them:
#
#   packaging/repo/build.sh --out DIR [--packages "p1 p2"] [--gpu-packages "p1 p2"] DEB...
#   packaging/repo/build.sh --resolve-only [--packages "p1 p2"] [--gpu-packages "p1 p2"] --depends "FIELD"
#
# DIR gets pool/main/<x>/<source>/*.deb, dists/bookworm/{Release,InRelease,Release.gpg},
# dists/bookworm/main/binary-amd64/Packages{,.gz} and engram-archive-keyring.gpg. The Debian
# packages come from the build machine's mirror (ENGRAM_DEBIAN_MIRROR, default
# http://deb.debian.org/debian) through mmdebstrap, which resolves the same closure the offline
# install will: minbase, the --packages list (default: what the appliance runs on) and each
# DEB's dependencies. --gpu-packages (packaging/gpu-packages: the NVIDIA driver and CUDA
# runtime) are downloaded with what they need beyond that system, not installed, from Debian's
# main, contrib, non-free and non-free-firmware components; each package goes into the
# repository's component of the same name (its Section says which), so a source line naming
# only main never sees the non-free ones. Downloads are cached in target/appliance/cache/debs. --resolve-only fills
# that cache and stops, for DEBs not built yet whose Depends field is given (CI downloads while
# it compiles).
#
# Signing: the archive key is a GnuPG home in ENGRAM_ARCHIVE_GNUPGHOME (kept out of git). Without
# one a throwaway key is made in target/appliance/throwaway-gnupg and the script says so: fine
# for CI, not for a release.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=
PACKAGES="systemd systemd-sysv dbus apt"
GPU_PACKAGES=
DEBS=()
DEPENDS=()
RESOLVE_ONLY=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        --packages) PACKAGES=$2; shift 2 ;;
        --gpu-packages) GPU_PACKAGES=$2; shift 2 ;;
        --depends) DEPENDS+=("$2"); shift 2 ;;
        --resolve-only) RESOLVE_ONLY=1; shift ;;
        -*) echo "repo: unknown argument $1" >&2; exit 2 ;;
        *) DEBS+=("$1"); shift ;;
    esac
done
die() { echo "repo: $*" >&2; exit 1; }
[[ $RESOLVE_ONLY == 1 || -n $OUT ]] || die "--out DIR is required"
[[ $RESOLVE_ONLY == 1 || ${#DEBS[@]} -gt 0 ]] || die "give at least one .deb"
MIRROR=${ENGRAM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm

# The closure: what minbase plus the packages and the debs' dependencies pull in.
for d in "${DEBS[@]}"; do
    [[ -f $d ]] || die "$d is missing"
    DEPENDS+=("$(dpkg-deb -f "$d" Depends)")
done
deps=()
for field in "${DEPENDS[@]}"; do
    # Depends: "a (>= 1), b | c" -> a, b (the first alternative, as apt would pick).
    while IFS= read -r dep; do
        [[ -n $dep ]] && deps+=("$dep")
    done < <(tr ',' '\n' <<<"$field" | sed 's/|.*//; s/(.*)//; s/[[:space:]]//g')
done
include=$(printf '%s\n' $PACKAGES "${deps[@]}" | sort -u | paste -sd, -)
CACHE=target/appliance/cache/debs
mkdir -p "$CACHE"
CACHE=$(realpath "$CACHE")
# The resolution is kept for the day (same packages, mirror and date: same closure).
LIST=$CACHE/closure-$(printf '%s\n' "$include" "$GPU_PACKAGES" "$MIRROR" "$(date -u +%F)" | sha256sum | cut -c1-16).list
resolved=0
if [[ -s $LIST ]]; then
    resolved=1
    while read -r f; do [[ -f $CACHE/$f ]] || resolved=0; done <"$LIST"
fi
if [[ $resolved == 0 ]]; then
    echo "repo: resolving minbase + $include from $MIRROR" >&2
    # The install is thrown away (--format=null): INITRD=No spares it the kernel's initramfs
    # (60 s down to 23 s), which has no say in what is downloaded.
    # The GPU stack is only downloaded (apt-get --download-only runs no maintainer script, so
    # no DKMS build here): what it needs beyond the installed system, as the installer's apt
    # will ask for it.
    gpu=()
    if [[ -n $GPU_PACKAGES ]]; then
        gpu=(--components=main,contrib,non-free,non-free-firmware
            --customize-hook='chroot "$1" apt-get install --download-only --yes --quiet --no-install-recommends '"$GPU_PACKAGES")
    fi
    INITRD=No mmdebstrap --quiet --variant=minbase --include="$include" --format=null \
        --skip=download/empty,essential/unlink \
        --setup-hook='mkdir -p "$1/var/cache/apt/archives"; cp '"$CACHE"'/*.deb "$1/var/cache/apt/archives/" 2>/dev/null || true' \
        "${gpu[@]}" \
        --customize-hook='sync-out /var/cache/apt/archives '"$CACHE" \
        --customize-hook='cd "$1/var/cache/apt/archives" && ls *.deb >'"$LIST.tmp" \
        "$SUITE" /dev/null "$MIRROR" >&2 || die "mmdebstrap could not resolve the closure"
    mv "$LIST.tmp" "$LIST"
fi
if [[ $RESOLVE_ONLY == 1 ]]; then
    echo "repo: $(wc -l <"$LIST") packages in $CACHE" >&2
    exit 0
fi

rm -rf "$OUT"
mkdir -p "$OUT"
# Only the versions this resolution chose (the cache may hold others).
declare -A newest=()
while read -r name; do
    f=$CACHE/$name
    p=$(dpkg-deb -f "$f" Package)
    if [[ -z ${newest[$p]:-} ]] || dpkg --compare-versions "$(dpkg-deb -f "$f" Version)" gt \
        "$(dpkg-deb -f "${newest[$p]}" Version)"; then
        newest[$p]=$f
    fi
done <"$LIST"
# Debian's components, each a folder of the pool and a Packages index: a package's Section
# ("non-free/libs") names its component; main has none in the name.
COMPONENTS=(main contrib non-free non-free-firmware)
pool_add() {
    local f=$1 src component
    src=$(dpkg-deb -f "$f" Source | cut -d' ' -f1)
    [[ -n $src ]] || src=$(dpkg-deb -f "$f" Package)
    component=$(dpkg-deb -f "$f" Section)
    case $component in contrib/* | non-free/* | non-free-firmware/*) component=${component%%/*} ;; *) component=main ;; esac
    local dir=$OUT/pool/$component/${src:0:1}/$src
    [[ $src == lib?* ]] && dir=$OUT/pool/$component/${src:0:4}/$src
    mkdir -p "$dir"
    cp "$f" "$dir/"
}
for p in "${!newest[@]}"; do
    pool_add "${newest[$p]}"
done
for d in "${DEBS[@]}"; do
    pool_add "$d"
done

# Priorities and sections from the packages' own control fields, so that minbase selects
# what it would from Debian's archive (without them apt-ftparchive leaves Priority out, and
# a minbase install from this repository would leave out apt).
override=$(mktemp)
trap 'rm -f "$override"' EXIT
find "$OUT/pool" -name '*.deb' | while read -r f; do
    dpkg-deb -f "$f" Package Priority Section | paste -sd' ' | sed 's/^Package: //; s/ Priority: / /; s/ Section: / /'
done | awk 'NF == 3' | sort -u >"$override"

# Every component has an index, empty where no package is in it, so one source line naming all
# four works on every medium.
for component in "${COMPONENTS[@]}"; do
    B=$OUT/dists/$SUITE/$component/binary-amd64
    mkdir -p "$B" "$OUT/pool/$component"
    (cd "$OUT" && apt-ftparchive packages "pool/$component" "$override" 2>/dev/null) >"$B/Packages"
    gzip -9nk "$B/Packages"
    cat >"$B/Release" <<REL
Archive: $SUITE
Component: $component
Origin: Engram
Label: Engram appliance
Architecture: amd64
REL
done
(cd "$OUT/dists/$SUITE" && apt-ftparchive \
    -o APT::FTPArchive::Release::Origin=Engram \
    -o "APT::FTPArchive::Release::Label=Engram appliance" \
    -o APT::FTPArchive::Release::Suite=$SUITE \
    -o APT::FTPArchive::Release::Codename=$SUITE \
    -o APT::FTPArchive::Release::Architectures=amd64 \
    -o "APT::FTPArchive::Release::Components=${COMPONENTS[*]}" \
    -o "APT::FTPArchive::Release::Description=Engram appliance and the Debian 12 packages it needs" \
    release .) >"$OUT/dists/$SUITE/Release.tmp"
mv "$OUT/dists/$SUITE/Release.tmp" "$OUT/dists/$SUITE/Release"

# Signing.
if [[ -n ${ENGRAM_ARCHIVE_GNUPGHOME:-} ]]; then
    export GNUPGHOME=$ENGRAM_ARCHIVE_GNUPGHOME
else
    export GNUPGHOME=$PWD/target/appliance/throwaway-gnupg
    if [[ ! -d $GNUPGHOME ]]; then
        mkdir -p -m 0700 "$GNUPGHOME"
        gpg --batch --quiet --passphrase '' --quick-gen-key \
            'Engram archive (throwaway, not for release) <archive@engram.invalid>' rsa3072 sign never 2>/dev/null
    fi
    echo "repo: signed with a throwaway key ($GNUPGHOME): set ENGRAM_ARCHIVE_GNUPGHOME for a release" >&2
fi
gpg --batch --quiet --yes --export >"$OUT/engram-archive-keyring.gpg"
[[ -s $OUT/engram-archive-keyring.gpg ]] || die "no archive key in $GNUPGHOME"
gpg --batch --quiet --yes --clearsign -o "$OUT/dists/$SUITE/InRelease" "$OUT/dists/$SUITE/Release"
gpg --batch --quiet --yes --detach-sign --armor -o "$OUT/dists/$SUITE/Release.gpg" "$OUT/dists/$SUITE/Release"
gpgv --keyring "$OUT/engram-archive-keyring.gpg" "$OUT/dists/$SUITE/InRelease" 2>/dev/null \
    || die "the signature does not verify"
for component in "${COMPONENTS[@]}"; do
    n=$(find "$OUT/pool/$component" -name '*.deb' | wc -l)
    [[ $n == 0 ]] || echo "repo: $component: $n packages, $(du -sh "$OUT/pool/$component" | cut -f1)" >&2
done
echo "repo: $OUT: $(find "$OUT/pool" -name '*.deb' | wc -l) packages, $(du -sh "$OUT" | cut -f1)" >&2
