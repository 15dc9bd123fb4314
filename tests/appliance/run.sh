#!/usr/bin/env bash
# The appliance's lifecycle end to end, as root, with no network for the installed system:
#
#   tests/appliance/run.sh [--reuse-media]
#   tests/appliance/run.sh --prepare
#
# (--reuse-media: take the images, and the installed VM disk, a previous run left in
# target/appliance, to iterate on the later steps; CI always builds them. --prepare installs
# the tools and prefetches what the media need from the network, then stops: CI runs it while
# it compiles.)
#
# 1. Media: packaging/images.sh builds the .deb, the signed repository and the offline bundle
#    ISO of this version (V1), then of a second build whose version the test bumps (V2), whose
#    upgrade bundle also carries V1.
# 2. Install: the V1 bundle ISO's files (read with xorriso: this kernel has no iso9660) are the
#    only package source of an mmdebstrap minbase install inside `unshare --net`.
# 3. Boot: systemd-nspawn -b --private-network; engramd active under systemd, its sandbox on
#    (seccomp, no new privileges, `systemd-analyze security` <= 2.0), /healthz answers.
# 4. Data: an admin key, a collection, a document found by search.
# 5. Upgrade to V2 from its bundle (install.sh, as an admin would): a snapshot first, the
#    document still there, the history says upgrade. Roll back to V1: still there. Back up,
#    wipe /var/lib/engram, restore: still there.
# 6. The installer ISO in QEMU on a blank disk, answers on a second disk: INSTALL COMPLETE;
#    beside it (a second VM at the same time) a copy with a damaged system image, refused
#    before it touches its disk; the installed root booted with nspawn (engramd over TLS, the
#    tty's banner, sign-in).
# 7. The installed disk booted in QEMU under UEFI and under BIOS (two VMs at once) to engramd
#    started and the login prompt with its banner.
# Everything it makes stays in target/appliance/ (images, logs, the installed root).
set -euo pipefail
cd "$(dirname "$0")/../.."

REUSE=0
PREPARE=0
[[ ${1:-} == --reuse-media ]] && REUSE=1
[[ ${1:-} == --prepare ]] && PREPARE=1
if [[ $(id -u) -ne 0 ]]; then
    echo "appliance: mmdebstrap, nspawn and loop devices need root: running under sudo" >&2
    exec sudo --preserve-env=PATH,CARGO_HOME,RUSTUP_HOME,ENGRAM_PROFILE,ENGRAM_CHECKED "$0" "$@"
fi
T0=$(date +%s)
step() { echo "appliance: [$(($(date +%s) - T0)) s] $*"; }
fail() { echo "appliance: FAILED: $*" >&2; exit 1; }

need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v xorriso >/dev/null || need+=(xorriso)
command -v apt-ftparchive >/dev/null || need+=(apt-utils)
command -v gpg >/dev/null || need+=(gnupg)
command -v curl >/dev/null || need+=(curl)
command -v grub-mkrescue >/dev/null || need+=(grub-common)
[[ -d /usr/lib/grub/i386-pc ]] || need+=(grub-pc-bin)
[[ -d /usr/lib/grub/x86_64-efi ]] || need+=(grub-efi-amd64-bin)
[[ -f /usr/share/OVMF/OVMF_CODE_4M.fd ]] || need+=(ovmf)
command -v mcopy >/dev/null || need+=(mtools)
command -v mkfs.vfat >/dev/null || need+=(dosfstools)
command -v mksquashfs >/dev/null || need+=(squashfs-tools)
command -v sfdisk >/dev/null || need+=(fdisk)
if [[ ${#need[@]} -gt 0 ]]; then
    step "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! command -v qemu-system-x86_64 >/dev/null; then
    step "installing qemu-system-x86 (bookworm-backports: bookworm's conflicts with qemu-utils)"
    grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d \
        || echo "deb http://deb.debian.org/debian bookworm-backports main" >/etc/apt/sources.list.d/engram-backports.list
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports qemu-system-x86 >/dev/null
fi
if [[ $PREPARE == 1 ]]; then
    step "prefetching the media's Debian packages and the installer's live system"
    packaging/images.sh --prefetch
    exit 0
fi

OUT=target/appliance
mkdir -p "$OUT"
V1=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
V2=$V1+test.1
LOG=$PWD/$OUT/run.log
: >"$LOG"

if [[ $REUSE == 1 && -s $OUT/isos && -s $OUT/engram-$V2-bundle.iso ]]; then
    step "reusing the media in $OUT"
    ISO2=$OUT/engram-$V2-bundle.iso
else
    step "media for $V1 (the bundle and the installer ISO)"
    packaging/images.sh --version "$V1" --installer >"$OUT/isos" 2>>"$LOG" || { tail -20 "$LOG"; fail "images $V1"; }
    step "media for $V2 (a rebuild with the version bumped)"
    ISO2=$(packaging/images.sh --version "$V2" --previous "$OUT/engram_${V1}_amd64.deb" 2>>"$LOG") \
        || { tail -20 "$LOG"; fail "images $V2"; }
fi
ISO1=$(sed -n 1p "$OUT/isos")
INSTALLER=$(sed -n 2p "$OUT/isos")
[[ -s $ISO1 && -s $INSTALLER ]] || fail "images $V1: $(cat "$OUT/isos")"
for iso in "$ISO1" "$ISO2" "$INSTALLER"; do
    echo "appliance: $iso $(du -h "$iso" | cut -f1)"
done

# The media as a host sees them once mounted.
M=$OUT/media
rm -rf "$M"
mkdir -p "$M/v1" "$M/v2"
xorriso -osirrox on -indev "$ISO1" -extract / "$M/v1" 2>>"$LOG" >/dev/null
xorriso -osirrox on -indev "$ISO2" -extract / "$M/v2" 2>>"$LOG" >/dev/null
(cd "$M/v1" && gpgv --keyring ./engram-archive-keyring.gpg SHA256SUMS.gpg SHA256SUMS 2>>"$LOG" \
    && sha256sum --quiet -c SHA256SUMS) || fail "the V1 medium does not verify"
# The GPU stack on the medium: the driver and CUDA runtime in the non-free components' indexes
# (main's lists none of them), with the licences in its README.
index() { zcat "$M/v1/dists/bookworm/$1/binary-amd64/Packages.gz" | sed -n 's/^Package: //p'; }
[[ -s $M/v1/gpu-packages && -x $M/v1/gpu-stack.sh ]] || fail "the medium has no gpu-packages or gpu-stack.sh"
nonfree=$(index contrib; index non-free; index non-free-firmware)
for p in $(cat "$M/v1/gpu-packages") libcublaslt11 nvidia-kernel-support; do
    if [[ $p == linux-headers-amd64 ]]; then
        index main | grep -qx "$p" || fail "the medium's main component lacks $p"
    else
        grep -qx "$p" <<<"$nonfree" || fail "the medium's non-free components lack $p"
        ! index main | grep -qx "$p" || fail "$p is in the medium's main component"
    fi
done
grep -q '^  nvidia-kernel-dkms 535\.[0-9.]*-[0-9]* *non-free: ' "$M/v1/README.txt" \
    || fail "the medium's README lists no licence for nvidia-kernel-dkms: $(grep -A30 '^Licences' "$M/v1/README.txt")"
step "the medium carries the GPU stack: $(wc -l <<<"$nonfree") packages in contrib, non-free and non-free-firmware, $(du -shc "$M/v1/pool/"{contrib,non-free,non-free-firmware} | tail -1 | cut -f1)"

step "offline install of $V1 from its medium (unshare --net)"
ROOT=$OUT/root
rm -rf "$ROOT"
MEDIUM=$(realpath "$M/v1")
unshare --net mmdebstrap --quiet --variant=minbase --include=systemd,systemd-sysv,dbus,apt,engram \
    --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount \
    --keyring="$MEDIUM/engram-archive-keyring.gpg" \
    --customize-hook='echo engram-test >"$1/etc/hostname"' \
    --customize-hook='install -m 0644 '"$MEDIUM"'/engram-archive-keyring.gpg "$1/usr/share/keyrings/"' \
    --customize-hook='echo "deb [signed-by=/usr/share/keyrings/engram-archive-keyring.gpg] file:/media/engram bookworm main" >"$1/etc/apt/sources.list"' \
    bookworm "$ROOT" "deb [signed-by=$MEDIUM/engram-archive-keyring.gpg] file://$MEDIUM bookworm main" \
    >>"$LOG" 2>&1 || { tail -20 "$LOG"; fail "the offline install"; }
[[ -x $ROOT/usr/bin/engramd ]] || fail "engramd is not installed"
[[ -x $ROOT/usr/bin/apt-get ]] || fail "apt is not installed"
[[ -L $ROOT/etc/systemd/system/multi-user.target.wants/engramd.service ]] || fail "engramd.service is not enabled"

NSPAWN_PID=
LEADER=
cleanup() {
    if [[ -n $LEADER ]] && kill -0 "$LEADER" 2>/dev/null; then
        nsenter -t "$LEADER" -a systemctl poweroff >/dev/null 2>&1 || true
        for _ in $(seq 60); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.5; done
    fi
    [[ -n $NSPAWN_PID ]] && kill "$NSPAWN_PID" 2>/dev/null || true
}
trap cleanup EXIT
# The booted container's console.
CONSOLE=$OUT/console.log
# The container's init: the child of systemd-nspawn that is PID 1 in its own PID namespace.
# nspawn first forks an outer child that sets up the namespaces and exits at once; taking the
# first child it has (as this once did) sometimes catches that one, and every nsenter into it
# then fails. Its console is $CONSOLE.
find_leader() {
    local p ns
    LEADER=
    for _ in $(seq 150); do
        for p in $(pgrep -P "$NSPAWN_PID" || true); do
            ns=$(sed -n 's/^NSpid:[[:space:]]*//p' "/proc/$p/status" 2>/dev/null || true)
            [[ $ns =~ [[:space:]]1$ ]] && { LEADER=$p; return 0; }
        done
        kill -0 "$NSPAWN_PID" 2>/dev/null || break
        sleep 0.2
    done
    tail -20 "$CONSOLE" >&2 || true
    fail "the container did not start (see $CONSOLE)"
}
boot() {
    systemd-nspawn -q -D "$ROOT" -b --register=no --keep-unit --private-network \
        --machine=engram-test --bind-ro="$(realpath "$M/v1")":/media/engram \
        --bind-ro="$(realpath "$M/v2")":/media/engram-upgrade >"$CONSOLE" 2>&1 </dev/null &
    NSPAWN_PID=$!
    find_leader
}
in_ct() { nsenter -t "$LEADER" -a "$@"; }
# The daemon's address inside the container, and what curl needs to trust it (set for the
# installed VM, whose engramd listens beyond loopback and so speaks TLS).
BASE=http://127.0.0.1:8080
CURL_TLS=()
http() { nsenter -t "$LEADER" -n curl -sS "${CURL_TLS[@]}" "$@"; }
wait_active() {
    local state=
    for _ in $(seq 600); do
        state=$(in_ct systemctl is-active engramd.service 2>/dev/null || true)
        [[ $state == active ]] && http -f -o /dev/null $BASE/healthz 2>/dev/null && return 0
        [[ $state == failed ]] && break
        sleep 0.5
    done
    in_ct journalctl -u engramd.service --no-pager 2>/dev/null | tail -20 >&2 || true
    kill -0 "$LEADER" 2>/dev/null || echo "appliance: the container's init ($LEADER) is gone" >&2
    tail -20 "$CONSOLE" >&2 || true
    fail "engramd is not active (${state:-no answer from systemctl})"
}
version_is() {
    local v
    v=$(in_ct /usr/bin/engramd -V | cut -d' ' -f2)
    [[ $v == "$1" ]] || fail "engramd is $v, not $1"
}

step "boot with systemd-nspawn (private network)"
boot
wait_active
version_is "$V1"
step "engramd $V1 active under systemd; /healthz answers"

# The unit's hardening, as applied to the running process.
MAIN=$(in_ct systemctl show -P MainPID engramd.service)
status=$(in_ct cat "/proc/$MAIN/status")
grep -q '^NoNewPrivs:[[:space:]]*1' <<<"$status" || fail "engramd runs without NoNewPrivs"
grep -q '^Seccomp:[[:space:]]*2' <<<"$status" || fail "engramd runs without its seccomp filter"
grep -q '^CapEff:[[:space:]]*0000000000000000' <<<"$status" || fail "engramd has capabilities"
[[ $(in_ct stat -c %U "/proc/$MAIN") == engram ]] || fail "engramd does not run as engram"
score=$(in_ct systemd-analyze security engramd.service 2>/dev/null \
    | sed -n 's/.*Overall exposure level for engramd.service: \([0-9.]*\).*/\1/p')
[[ -n $score ]] || fail "systemd-analyze security gave no score"
awk -v s="$score" 'BEGIN { exit !(s <= 2.0) }' || fail "unit exposure $score > 2.0"
step "sandbox on: seccomp, NoNewPrivs, no capabilities, user engram; exposure $score"

# Data through the API.
KEY=$(in_ct runuser -u engram -- /usr/bin/engramd --config /etc/engram/engramd.toml keys create --scopes admin 2>/dev/null)
[[ -n $KEY ]] || fail "no key"
AUTH=(-H "Authorization: Bearer $KEY")

# One binary for every box: the installed engramd has GPU support compiled in and, under the
# hardened unit on this machine without a GPU, serves from the CPU and says why.
gpu=$(in_ct /usr/bin/engramd --version | sed -n 2p)
[[ $gpu == "GPU support: compiled in (CUDA, loaded at run time); no GPU usable: "* ]] \
    || fail "engramd --version: $gpu"
ready=$(http -f "${AUTH[@]}" $BASE/readyz) || fail "/readyz"
python3 -c '
import json, sys
g = json.load(sys.stdin)["gpu"]
assert g["cuda_compiled"] is True and g["serving"] == "cpu", g
assert g["reason"], g
' <<<"$ready" || fail "/readyz gpu: $ready"
step "GPU support compiled in; serving from the CPU: $(python3 -c 'import json,sys; print(json.load(sys.stdin)["gpu"]["reason"])' <<<"$ready")"
# The medium's GPU step on this machine without an NVIDIA GPU installs nothing and says so; the
# stack it would install resolves from the medium alone (apt's simulation: every dependency is
# on it), as on a GPU server.
said=$(in_ct sh /media/engram/gpu-stack.sh /media/engram) || fail "gpu-stack.sh: $said"
[[ $said == *"no NVIDIA GPU on the PCI bus: the GPU stack is not installed"* ]] || fail "gpu-stack.sh: $said"
in_ct sh -c 'l=$(mktemp -d); mkdir $l/lists; echo "deb [signed-by=/usr/share/keyrings/engram-archive-keyring.gpg] file:/media/engram bookworm main contrib non-free non-free-firmware" >$l/sources.list
    A="-o Dir::Etc::SourceList=$l/sources.list -o Dir::Etc::SourceParts=- -o Dir::State::Lists=$l/lists -o Acquire::Languages=none"
    apt-get $A update -qq && apt-get $A install -s --no-install-recommends $(cat /media/engram/gpu-packages)' \
    >"$OUT/gpu-simulate.log" 2>&1 || { tail -20 "$OUT/gpu-simulate.log"; fail "the GPU stack does not install from the medium alone"; }
step "no NVIDIA GPU here: gpu-stack.sh left it out; its $(grep -c '^Inst ' "$OUT/gpu-simulate.log") packages install from the medium alone (apt-get -s)"

http -f "${AUTH[@]}" -H 'Content-Type: application/json' -d '{"name":"handbook"}' \
    $BASE/api/v1/collections >/dev/null || fail "creating a collection"
DOC=$(http -f "${AUTH[@]}" -H 'Content-Type: application/json' \
    -d '{"name":"lighthouse.md","text":"The Skerryvore lighthouse keeper logs the lamp oil every evening at dusk. Relief boats arrive every fortnight from Hynish."}' \
    $BASE/api/v1/collections/handbook/documents/text) || fail "uploading"
DOC_ID=$(python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["documents"][0]["id"])' <<<"$DOC")
present() {
    local body
    for _ in $(seq 240); do
        body=$(http "${AUTH[@]}" "$BASE/api/v1/collections/handbook/documents/$DOC_ID" || true)
        grep -q '"stage": *"done"' <<<"$body" && break
        sleep 0.5
    done
    grep -q '"stage": *"done"' <<<"$body" || fail "$1: document $DOC_ID is not ready: $body"
    body=$(http -f "${AUTH[@]}" -H 'Content-Type: application/json' \
        -d '{"query":"who brings relief boats from Hynish","collections":["handbook"],"top_k":3}' \
        $BASE/api/v1/search) || fail "$1: search"
    grep -q Skerryvore <<<"$body" || fail "$1: the document is not found: $body"
    step "$1: document $DOC_ID found by search"
}
present "$V1"
# A scanned page, read by Tesseract under the hardened unit (the package depends on it and
# poppler-utils; the sandbox's seccomp filter and MemoryDenyWriteExecute apply to them too).
SCAN=$(http -f "${AUTH[@]}" -F "file=@appliance/parse/tests/fixtures/scan-en.png;filename=pump-checks.png" \
    $BASE/api/v1/collections/handbook/documents) || fail "uploading a scan"
SCAN_ID=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["documents"][0]["id"])' <<<"$SCAN")
for _ in $(seq 240); do
    body=$(http "${AUTH[@]}" "$BASE/api/v1/collections/handbook/documents/$SCAN_ID" || true)
    grep -q '"stage": *"\(done\|failed\)"' <<<"$body" && break
    sleep 0.5
done
grep -q '"stage": *"done"' <<<"$body" || fail "the scan was not read: $body"
hits=$(http -f "${AUTH[@]}" -H 'Content-Type: application/json' \
    -d '{"query":"when does the alarm sound","collections":["handbook"],"mode":"bm25","top_k":3}' $BASE/api/v1/search) \
    || fail "searching the scan"
grep -q 'the alarm sounds at 6 bar' <<<"$hits" || fail "the scan's text is not searchable: $hits"
step "a scanned PNG read by OCR under the hardened unit, its text searchable"

step "upgrade to $V2 from its bundle (install.sh)"
in_ct sh /media/engram-upgrade/install.sh >>"$LOG" 2>&1 || { tail -20 "$LOG"; fail "the upgrade"; }
wait_active
version_is "$V2"
present "after the upgrade"
history() { http -f "${AUTH[@]}" $BASE/api/v1/admin/version; }
h=$(history) || fail "GET /api/v1/admin/version"
python3 -c '
import json, sys
v1, v2 = sys.argv[1:]
h = json.load(sys.stdin)
ev = h["history"]
assert h["version"] == v2, h["version"]
assert [e["kind"] for e in ev] == ["install", "upgrade"], ev
assert ev[1]["previous"] == v1 and ev[1]["version"] == v2, ev[1]
assert ev[1]["snapshot"].startswith("/var/backups/engram/pre-upgrade-"), ev[1]
' "$V1" "$V2" <<<"$h" || fail "version history after the upgrade: $h"
SNAP=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["history"][1]["snapshot"])' <<<"$h")
[[ -s $ROOT$SNAP ]] || fail "the pre-upgrade snapshot $SNAP is missing"
step "history: install, upgrade (snapshot $SNAP)"

step "roll back to $V1"
in_ct sh /media/engram-upgrade/install.sh "$V1" >>"$LOG" 2>&1 || { tail -20 "$LOG"; fail "the rollback"; }
wait_active
version_is "$V1"
present "after the rollback"
h=$(history) || fail "GET /api/v1/admin/version"
python3 -c 'import json,sys; k=[e["kind"] for e in json.load(sys.stdin)["history"]]; assert k == ["install","upgrade","rollback"], k' <<<"$h" \
    || fail "version history after the rollback: $h"

step "back up through the daemon, wipe /var/lib/engram, restore"
in_ct env ENGRAM_API_KEY="$KEY" /usr/bin/engramd --config /etc/engram/engramd.toml backup --to /root/engram.tar.zst \
    >>"$LOG" 2>&1 || { tail -5 "$LOG"; fail "backup"; }
in_ct systemctl stop engramd.service
in_ct sh -c 'rm -rf /var/lib/engram/* /var/lib/engram/.[!.]*'
[[ -z $(ls -A "$ROOT/var/lib/engram") ]] || fail "the wipe left files"
in_ct /usr/bin/engramd --config /etc/engram/engramd.toml restore /root/engram.tar.zst >>"$LOG" 2>&1 \
    || { tail -5 "$LOG"; fail "restore"; }
in_ct chown -R engram:engram /var/lib/engram
in_ct systemctl start engramd.service
wait_active
present "after the restore"

step "restore through the running daemon: staged, applied at the restart"
LATER=$(http -f "${AUTH[@]}" -H 'Content-Type: application/json' \
    -d '{"name":"later.md","text":"Written after the backup: the fog signal is tested on Sundays."}' \
    $BASE/api/v1/collections/handbook/documents/text) || fail "uploading later.md"
LATER_ID=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["documents"][0]["id"])' <<<"$LATER")
code=$(http -o "$OUT/restore.json" -w '%{http_code}' "${AUTH[@]}" -H 'Content-Type: application/zstd' \
    --data-binary "@$ROOT/root/engram.tar.zst" $BASE/api/v1/admin/restore)
[[ $code == 202 ]] || fail "POST /api/v1/admin/restore: $code $(cat "$OUT/restore.json")"
in_ct systemctl restart engramd.service
wait_active
present "after the staged restore"
code=$(http -o /dev/null -w '%{http_code}' "${AUTH[@]}" \
    "$BASE/api/v1/collections/handbook/documents/$LATER_ID")
[[ $code == 404 ]] || fail "later.md ($LATER_ID), written after the backup, survived the restore ($code)"
[[ ! -e $ROOT/var/lib/engram/.restore-staged ]] || fail "the staged restore is still there"

cleanup
LEADER=
NSPAWN_PID=

# The installer ISO on a blank disk, as a server would boot it (TCG: these machines have no
# nested virtualisation), with no network card and the answers on a second disk labelled
# ENGRAM-CFG. One vCPU: under multi-threaded TCG a second one mostly added locking between the
# vCPU threads (docs/bench/2026-11-27-ci-time.md). The installer copies a system image built
# with the media, so what runs emulated is the live system's boot, the checksum, the copy and
# GRUB (docs/bench/2026-11-28-ci-time.md). The timeout only has to catch a hung installer, not
# a slow host.
VM=$OUT/vm
# Every VM here: TCG, one vCPU, no network card, the serial port into a log.
QEMU=(qemu-system-x86_64 -machine q35 -accel tcg -cpu max -m 3072 -smp 1 -nic none -display none
    -monitor none -no-reboot)
# qemu_until LOG PATTERN QEMU-ARGS...: runs a VM with its serial port in LOG until PATTERN shows
# there (then stops it and succeeds), the VM ends, or 900 s pass.
qemu_until() {
    local log=$1 pattern=$2 qpid seen=1
    shift 2
    : >"$log"
    "${QEMU[@]}" -serial "file:$log" "$@" 2>>"$LOG" &
    qpid=$!
    for _ in $(seq 900); do
        grep -aq "$pattern" "$log" && { seen=0; break; }
        kill -0 "$qpid" 2>/dev/null || break
        sleep 1
    done
    kill "$qpid" 2>/dev/null || true
    wait "$qpid" 2>/dev/null || true
    return $seen
}
if [[ $REUSE == 1 ]] && grep -aqs 'engram-install: INSTALL COMPLETE' "$VM/serial.log"; then
    step "reusing the installed disk in $VM"
else
    rm -rf "$VM"
    mkdir -p "$VM"
    printf '%s\n' disk=auto hostname=engram-vm network=none admin=operator1 listen=0.0.0.0:8080 \
        finish=poweroff >"$VM/engram-install.conf"
    truncate -s 4M "$VM/answers.img"
    mkfs.vfat -n ENGRAM-CFG "$VM/answers.img" >/dev/null
    mcopy -i "$VM/answers.img" "$VM/engram-install.conf" ::engram-install.conf

    # Two VMs at once, one vCPU each: the installer on a blank disk, and beside it the same ISO
    # written badly (4 KiB of the system image overwritten in a copy), which must stop on the
    # checksum, say why, and leave its disk as it was (a marker on it survives).
    step "installer ISO in QEMU (TCG, no network card, answers on ENGRAM-CFG), beside a copy with a damaged system image"
    read -r lba size < <(xorriso -indev "$INSTALLER" -find /install/system.squashfs -exec report_lba -- 2>/dev/null \
        | awk -F' *, *' '/^File data lba:/ { print $2, $4 }')
    [[ -n $lba && -n $size ]] || fail "install/system.squashfs not found on $INSTALLER"
    cp "$INSTALLER" "$VM/damaged.iso"
    head -c 4096 /dev/urandom | dd of="$VM/damaged.iso" bs=4096 seek=$((lba * 2048 / 4096 + size / 8192)) \
        conv=notrunc status=none
    truncate -s 8G "$VM/damaged-disk.raw"
    echo "engram-test: this disk must survive a refused install" | dd of="$VM/damaged-disk.raw" conv=notrunc status=none
    # Its own copy of the answers: QEMU locks a writable image against a second VM.
    cp "$VM/answers.img" "$VM/damaged-answers.img"
    qemu_until "$VM/damaged.log" 'engram-install: FAILED' \
        -drive "file=$VM/damaged.iso,media=cdrom,readonly=on" \
        -drive "file=$VM/damaged-disk.raw,format=raw,if=virtio" \
        -drive "file=$VM/damaged-answers.img,format=raw,if=virtio" -boot d &
    DAMAGED_PID=$!
    truncate -s 8G "$VM/disk.raw"
    installed=0
    timeout 1500 "${QEMU[@]}" -serial "file:$VM/serial.log" \
        -drive "file=$INSTALLER,media=cdrom,readonly=on" \
        -drive "file=$VM/disk.raw,format=raw,if=virtio" \
        -drive "file=$VM/answers.img,format=raw,if=virtio" -boot d || installed=$?
    wait "$DAMAGED_PID" \
        || { grep -a 'engram-install' "$VM/damaged.log" | tail -10; fail "the damaged medium was not refused"; }
    grep -a 'engram-install: FAILED' "$VM/damaged.log" | grep -q 'does not match its signed SHA256SUMS' \
        || fail "the damaged medium was refused for another reason: $(grep -a 'engram-install: FAILED' "$VM/damaged.log")"
    head -c 64 "$VM/damaged-disk.raw" | grep -aq 'this disk must survive a refused install' \
        || fail "the refused install changed the disk"
    step "the damaged medium was refused, its disk untouched:"
    grep -a 'engram-install: FAILED' "$VM/damaged.log" | tr -d '\r' | sed 's/^/  /'
    rm -f "$VM/damaged.iso" "$VM/damaged-disk.raw" "$VM/damaged-answers.img"

    [[ $installed == 0 ]] || { tail -30 "$VM/serial.log"; fail "QEMU ($installed)"; }
    grep -aq 'engram-install: INSTALL COMPLETE' "$VM/serial.log" \
        || { grep -a 'engram-install' "$VM/serial.log" | tail -30; fail "the installer did not complete (see $VM/serial.log)"; }
fi
grep -a 'engram-install: ' "$VM/serial.log" | tr -d '\r' | sed 's/^/  /'
grep -aq 'engram gpu: no NVIDIA GPU on the PCI bus: the GPU stack is not installed' "$VM/serial.log" \
    || { grep -a 'engram gpu' "$VM/serial.log"; fail "the installer did not say what it did about the GPU stack"; }
step "installed; booting the installed disk's root with systemd-nspawn"

# The root partition (GPT entry 3), through a loop device at its offset.
read -r start size < <(sfdisk -J "$VM/disk.raw" | python3 -c '
import json, sys
p = json.load(sys.stdin)["partitiontable"]
r = [x for x in p["partitions"] if x["type"].upper() == "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"][0]
print(r["start"] * p.get("sectorsize", 512), r["size"] * p.get("sectorsize", 512))')
LOOP=$(losetup -f --show -o "$start" --sizelimit "$size" "$VM/disk.raw")
mkdir -p "$VM/root"
mount "$LOOP" "$VM/root"
trap 'cleanup; umount "$VM/root" 2>/dev/null; losetup -d "$LOOP" 2>/dev/null' EXIT
ROOT=$VM/root
for f in /var/log/engram-install.log /etc/engram/first-admin /var/lib/engram/initial-admin-password \
    /boot/grub/grub.cfg /boot/efi; do
    [[ -e $ROOT$f ]] || fail "the installed system has no $f"
done
[[ $(cat "$ROOT/etc/hostname") == engram-vm ]] || fail "hostname"
# The image carries no machine id: the installer gives each server its own.
grep -Eqx '[0-9a-f]{32}' "$ROOT/etc/machine-id" || fail "the installed system has no machine id of its own: $(cat "$ROOT/etc/machine-id")"
# Both boot loaders: GRUB's BIOS core in the BIOS boot partition, the UEFI fallback loader on the ESP.
dd if="$VM/disk.raw" bs=512 count=1 2>/dev/null | grep -aq GRUB || fail "no GRUB in the MBR"
ESP_START=$(sfdisk -J "$VM/disk.raw" | python3 -c '
import json, sys
p = json.load(sys.stdin)["partitiontable"]
print([x for x in p["partitions"] if x["type"].upper() == "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"][0]["start"] * 512)')
mdir -i "$VM/disk.raw@@$ESP_START" ::/EFI/BOOT/BOOTX64.EFI >/dev/null 2>&1 || fail "no EFI/BOOT/BOOTX64.EFI on the ESP"
PASSWORD=$(head -1 "$ROOT/var/lib/engram/initial-admin-password")
CONSOLE=$VM/console.log
systemd-nspawn -q -D "$ROOT" -b --register=no --keep-unit --private-network --machine=engram-vm \
    >"$CONSOLE" 2>&1 </dev/null &
NSPAWN_PID=$!
find_leader
# Listening beyond loopback, engramd speaks TLS with the certificate it made at its first start.
BASE=https://127.0.0.1:8080
CURL_TLS=(--cacert "$ROOT/var/lib/engram/tls/cert.pem")
wait_active
version_is "$V1"
code=$(http -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/console/)
[[ $code == 308 ]] || fail "plain HTTP on the TLS port is not redirected ($code)"
for _ in $(seq 60); do grep -q 'console at https://' "$VM/console.log" && break; sleep 0.5; done
grep -q "console at https://[^ ]*:8080/console/" "$VM/console.log" || fail "the console URL is not on the tty"
FPR=$(cat "$ROOT/var/lib/engram/tls/fingerprint")
grep -q "SHA-256: $FPR" "$VM/console.log" || fail "the certificate's fingerprint is not on the tty"
grep -q "First admin: operator1  password: $PASSWORD" "$VM/console.log" || fail "the first admin is not on the tty"
page=$(http -c "$VM/cookies" $BASE/console/signin)
csrf=$(grep -o 'name="csrf" value="[0-9a-f]*"' <<<"$page" | head -1 | sed 's/.*value="\(.*\)"/\1/')
code=$(http -b "$VM/cookies" -o /dev/null -w '%{http_code}' --data-urlencode name=operator1 \
    --data-urlencode "password=$PASSWORD" --data-urlencode "csrf=$csrf" $BASE/console/signin)
[[ $code == 303 ]] || fail "the first admin cannot sign in ($code)"
step "the installed system runs engramd $V1 over TLS (its own certificate, plain HTTP redirected); the tty shows the console URL, the fingerprint and the first admin, who signs in"
cleanup
LEADER=
NSPAWN_PID=
umount "$VM/root"
losetup -d "$LOOP"
trap - EXIT

# The installed disk booted as a server boots it, under each firmware: UEFI (OVMF, no CSM: the
# ESP's fallback loader) and BIOS (SeaBIOS: GRUB in the MBR), each through the kernel, the
# initramfs and systemd to engramd started and the login prompt, whose banner on the serial port
# must show the console URL, the certificate's fingerprint and the first admin. (engramd's first
# start, which makes the certificate, was the nspawn boot above.)
# Both at once, one vCPU each: -snapshot keeps each VM's writes in a temporary overlay, so
# neither changes the disk the other boots.
declare -A BOOT_PID=()
start_boot() {
    local fw=$1 firmware=()
    if [[ $fw == uefi ]]; then
        cp /usr/share/OVMF/OVMF_VARS_4M.fd "$VM/efivars.fd"
        firmware=(-drive if=pflash,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd
            -drive "if=pflash,format=raw,file=$VM/efivars.fd")
    fi
    qemu_until "$VM/boot-$fw.log" 'engram-vm login: ' "${firmware[@]}" -snapshot \
        -drive "file=$VM/disk.raw,format=raw,if=virtio" &
    BOOT_PID[$fw]=$!
}
check_boot() {
    local fw=$1 log=$VM/boot-$1.log
    wait "${BOOT_PID[$fw]}" || { tail -30 "$log"; fail "$fw boot: no login prompt within 900 s (see $log)"; }
    if [[ $fw == uefi ]]; then
        grep -aq 'efi: EFI v' "$log" || fail "uefi boot: the kernel did not start under UEFI"
    else
        ! grep -aq 'efi: EFI v' "$log" || fail "bios boot: the kernel started under UEFI"
    fi
    grep -aq 'Started .*engramd\.service' "$log" || fail "$fw boot: engramd.service did not start"
    grep -aq "console at https://engram-vm:8080/console/" "$log" || fail "$fw boot: no console URL on the serial console"
    grep -aq "SHA-256: $FPR" "$log" || fail "$fw boot: no certificate fingerprint on the serial console"
    grep -aq "First admin: operator1  password: $PASSWORD" "$log" || fail "$fw boot: no first admin on the serial console"
}
# A failed check leaves no VM behind.
trap 'for p in "${BOOT_PID[@]}"; do pkill -P "$p" 2>/dev/null; kill "$p" 2>/dev/null; done' EXIT
step "booting the installed disk in QEMU under UEFI and under BIOS (two VMs at once)"
start_boot uefi
start_boot bios
for fw in uefi bios; do
    check_boot "$fw"
    step "$fw boot: engramd started, the login prompt shows the console URL, the fingerprint and the first admin"
done
trap - EXIT

step "all checks passed; images in $OUT"
