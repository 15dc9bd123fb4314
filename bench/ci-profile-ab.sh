#!/usr/bin/env bash
# The `ci` profile's opt-level on the heavy dependencies, A/B (docs/bench/2026-12-08-ci-time.md):
# the same crates built from scratch at opt-level 1 and 3 in turn, twice, each into a fresh
# folder under target/ab-N. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
crates=(-p tantivy -p lopdf -p sled -p rustls -p minijinja -p tokio -p regex)
for round in 1 2; do
    for level in 1 3; do
        rm -rf "target/ab-$level"
        start=$(date +%s.%N)
        CARGO_TARGET_DIR="target/ab-$level" cargo build --profile ci "${crates[@]}" \
            --config "profile.ci.opt-level=$level" -q
        echo "round $round opt-level $level: $(echo "$(date +%s.%N) - $start" | bc) s"
    done
done
