#!/bin/bash
# The seam between engine threads on 2 cores (issue "One host is one RNIC on every core"):
# a pair whose vRNICs are on two engine threads ("cross") against a pair on one ("same"),
# daemon on core 0 and both apps on core 1; and 4 engine threads against 1, unpinned.
# Each row: round, configuration (placement size threads pinned), MB/s, Mpps.
# Usage: bash docs/bench/2core-2026-11-28/seam.sh [ROUNDS] (needs perftest; as root).
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=${VRNIC_BIN:-$here/../../../target/release/vrnic}
export NP=--no-persist
for r in $(seq "${1:-7}"); do
    for cfg in "cross 2 2 1" "same 2 2 1" "cross 65536 2 1" "same 65536 2 1" \
               "plain 2 4 0" "plain 2 1 0" "plain 65536 4 0" "plain 65536 1 0"; do
        # shellcheck disable=SC2086
        echo "$r $cfg $(bash "$here/seam-run.sh" "$bin" $cfg)"
    done
done
