#!/usr/bin/env bash
# Checks the .deb that packaging/deb/build.sh makes: lintian finds no error or warning, the
# layout and maintainer scripts are there, the hardened unit keeps its exposure score, and the
# package's own files (binaries, models, configuration) start a daemon that answers. Does not
# install it on this machine: tests/appliance/run.sh installs it into booted systems.
#
#   tests/appliance/deb.sh [--no-build]
#   tests/appliance/deb.sh --prepare        (installs lintian and stops)
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v lintian >/dev/null; then
    echo "deb: installing lintian" >&2
    SUDO=
    [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq lintian >/dev/null
fi
[[ ${1:-} == --prepare ]] && exit 0
DEB=$(packaging/deb/build.sh "$@")
echo "deb: built $DEB ($(du -h "$DEB" | cut -f1))"
fail() { echo "deb: FAILED: $*" >&2; exit 1; }

# lintian: errors and warnings fail (info-level tags are listed in tests/appliance/README.md).
out=$(lintian --fail-on error,warning "$DEB" 2>&1 | grep -v 'running with root privileges' || true)
[[ -z $out ]] || fail "lintian: $out"
echo "deb: lintian clean"

contents=$(dpkg-deb -c "$DEB")
for f in ./usr/bin/engramd ./usr/bin/engram ./lib/systemd/system/engramd.service \
    ./usr/lib/sysusers.d/engram.conf ./usr/lib/tmpfiles.d/engram.conf ./etc/engram/engramd.toml \
    ./usr/share/engram/models/SHA256SUMS ./usr/share/engram/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    ./usr/share/engram/models/all-MiniLM-L6-v2/model.safetensors ./usr/share/man/man8/engramd.8.gz; do
    grep -q " $f\$" <<<"$contents" || fail "$f is not in the package"
done
[[ $(dpkg-deb -f "$DEB" Package) == engram ]] || fail "package name"
WORK=$(mktemp -d)
PID=
cleanup() {
    [[ -n $PID ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
dpkg-deb -e "$DEB" "$WORK/DEBIAN"
grep -qx /etc/engram/engramd.toml "$WORK/DEBIAN/conffiles" || fail "engramd.toml is not a conffile"
grep -q 'rm -rf /var/lib/engram' "$WORK/DEBIAN/postrm" || fail "postrm does not purge the data"
awk '/"\$1" = "remove"/,/^fi/' "$WORK/DEBIAN/postrm" | grep -q 'rm -rf' \
    && fail "postrm deletes data on remove"
grep -q 'engramd .*backup --to' "$WORK/DEBIAN/preinst" || fail "preinst takes no pre-upgrade snapshot"
for s in preinst postinst prerm postrm; do
    sh -n "$WORK/DEBIAN/$s" || fail "$s does not parse"
done

# The unit as installed: its sandbox score.
dpkg-deb -x "$DEB" "$WORK/root"
if command -v systemd-analyze >/dev/null; then
    score=$(systemd-analyze security --offline=true "$WORK/root/lib/systemd/system/engramd.service" 2>/dev/null \
        | sed -n 's/.*Overall exposure level for engramd.service: \([0-9.]*\).*/\1/p')
    [[ -n $score ]] || fail "systemd-analyze gave no score"
    awk -v s="$score" 'BEGIN { exit !(s <= 2.0) }' || fail "unit exposure $score > 2.0"
    echo "deb: unit exposure $score (<= 2.0)"
fi

# The package's own files run: models verified, the daemon on its configuration answers.
(cd "$WORK/root/usr/share/engram/models" && sha256sum --quiet -c SHA256SUMS) || fail "model checksums"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
R=$WORK/root
sed -e "s|/usr/share/engram/models|$R/usr/share/engram/models|" "$R/etc/engram/engramd.toml" >"$WORK/engramd.toml"
KEY=$("$R/usr/bin/engramd" --config "$WORK/engramd.toml" --data-dir "$WORK/data" keys create --scopes admin 2>/dev/null)
"$R/usr/bin/engramd" --config "$WORK/engramd.toml" --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" \
    >"$WORK/engramd.log" 2>&1 &
PID=$!
for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
    kill -0 "$PID" 2>/dev/null || { cat "$WORK/engramd.log" >&2; fail "engramd exited"; }
    sleep 0.2
done
curl -fs -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/readyz" >/dev/null \
    || { cat "$WORK/engramd.log" >&2; fail "/readyz"; }
"$R/usr/bin/engram" --version >/dev/null || fail "engram does not run"
# One binary for every box: GPU support compiled in, and said so with what it found (here no
# driver: the reason).
gpu=$("$R/usr/bin/engramd" --version | sed -n 2p)
[[ $gpu == "GPU support: compiled in (CUDA, loaded at run time); "* ]] || fail "engramd --version: $gpu"
echo "deb: $gpu"
echo "deb: the packaged engramd answers /readyz; ok"
