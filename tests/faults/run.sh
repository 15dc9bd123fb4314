#!/usr/bin/env bash
# Builds engramd and engram and runs the fault-injection suite (tests/faults/faults.py).
#
#   tests/faults/run.sh                 # the full run: 50 kill -9 trials, every scenario (release)
#   tests/faults/run.sh --ci            # the bounded run CI does: 3 trials, small corpora
#   tests/faults/run.sh --only kill9 --trials 10
#   tests/faults/run.sh --debug ...     # with the debug binaries (quicker to build, slower to run)
#
# The binaries are the release build's, or those of the cargo profile ENGRAM_PROFILE names (CI:
# `ci`, scripts/test.sh).
#
# The disk-full scenarios mount tmpfs file systems and need root; elsewhere they are skipped
# with a message. ENGRAM_MODELS_DIR defaults to ./models (scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

profile=${ENGRAM_PROFILE:-release}
args=()
for a in "$@"; do
    if [[ $a == --ci ]]; then
        args+=(--trials 3 --rate 4 --cli-docs 24 --doc-words 3000 --fill-free-mib 2 --drain-timeout 900)
    elif [[ $a == --debug ]]; then
        profile=debug
    else
        args+=("$a")
    fi
done
if [[ $profile == debug ]]; then
    cargo build --quiet --locked -p engram-server -p engram-cli
else
    cargo build --quiet --locked --profile "$profile" -p engram-server -p engram-cli
fi
export ENGRAM_MODELS_DIR="${ENGRAM_MODELS_DIR:-$PWD/models}"
exec python3 tests/faults/faults.py --bins "target/$profile" "${args[@]}"
