#!/bin/bash
# ab-seam.sh ROUNDS OLD_DIR NEW_DIR: the 2-byte seam configurations, two builds alternated.
# Each line: round build config MB/s Mpps. Uses ../2core-2026-11-27/seam-run.sh.
R=$1; OLD=$2; NEW=$3
H=$(dirname "$0")/../2core-2026-11-27/seam-run.sh
for r in $(seq "$R"); do
    for b in old new; do
        [ $b = old ] && D=$OLD || D=$NEW
        echo "$r $b cross-pinned $(bash "$H" "$D/vrnic" cross 2 2 1)"
        echo "$r $b same-pinned $(bash "$H" "$D/vrnic" same 2 2 1)"
        echo "$r $b t4-unpinned $(bash "$H" "$D/vrnic" cross 2 4 0)"
        echo "$r $b t1-unpinned $(bash "$H" "$D/vrnic" plain 2 1 0)"
    done
done
