#!/bin/bash
# abseam.sh ROUNDS BUILD... : per round, for each build: cross pinned (4 threads), plain pinned 1 thread, unpinned 4 and 1 threads; 2 B
here=/work/main/docs/bench/2core-2026-11-27
export NP=--no-persist
R=$1; shift
for r in $(seq $R); do for b in "$@"; do for cfg in "cross 2 4 1" "plain 2 1 1" "plain 2 4 0" "plain 2 1 0"; do echo "$r $b $cfg $(bash $here/seam-run.sh /tmp/ab/$b/vrnic $cfg)"; done; done; done
