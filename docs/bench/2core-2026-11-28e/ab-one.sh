#!/bin/bash
# ab-one.sh ROUNDS OLD_DIR NEW_DIR PROG:SIZE...: perftest figures of two builds alternated,
# one fresh daemon per run (../2core-2026-11-28d/one.sh). Each line: round build prog size figure.
R=$1; OLD=$2; NEW=$3; shift 3
ONE=$(dirname "$0")/../2core-2026-11-28d/one.sh
for r in $(seq "$R"); do
    for ps in "$@"; do
        p=${ps%:*}; s=${ps#*:}
        for b in old new; do
            [ $b = old ] && D=$OLD || D=$NEW
            echo "$r $b $p $s $(bash "$ONE" "$D/vrnic" "$p" "$s" | awk '{print $NF}')"
        done
    done
done
