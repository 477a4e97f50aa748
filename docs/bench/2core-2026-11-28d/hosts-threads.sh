#!/bin/bash
# Across two hosts (network namespaces, one veth), daemons with engine threads: two builds
# alternated in one sitting. Usage: bash hosts-threads.sh ROUNDS OLD_BIN NEW_BIN (as root).
# Each row: round, build, threads, program, size, figure(s).
set -u
here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq "$1"); do
    for th in 2 1; do
        for t in "ib_write_bw 65536" "ib_write_bw 1048576" "ib_write_lat 2"; do
            for b in old new; do
                if [ $b = old ]; then bin=$2; else bin=$3; fi
                # shellcheck disable=SC2086
                echo "$r $b $th $t $(bash "$here/hosts-threads-run.sh" "$bin" $th $t)"
            done
        done
    done
done
