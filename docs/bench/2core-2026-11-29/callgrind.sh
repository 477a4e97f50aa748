#!/bin/bash
# callgrind.sh BIN PLACEMENT THREADS N OUT: the daemon under `valgrind --tool=callgrind` (one
# instruction count per function, the same on every run: this machine's speed drifts by 2x
# between minutes, an instruction count does not), an unmodified `ib_write_bw -s 2 -n N`
# between two vRNICs a and b (PLACEMENT cross: on two engine threads; plain: as placed;
# same: a third vRNIC between them keeps both on one thread). Prints the client's MB/s and
# Mpps (meaningless under valgrind) and leaves callgrind's file at OUT; then
#   callgrind_annotate --inclusive=yes OUT | grep 'sched.rs:.*turn_with \['
# gives the instructions the engine's turns took, which divided by N is per work request.
# Needs valgrind (apt-get install valgrind) and perftest; as root.
BIN=$1; PL=$2; TH=$3; N=$4; OUT=$5
SD=/tmp/cg-$$; mkdir -p $SD
valgrind --tool=callgrind --callgrind-out-file="$OUT" "$BIN" --state-dir $SD serve \
    --engine-threads "$TH" --no-persist >/dev/null 2>$SD.err &
DP=$!
for _ in $(seq 300); do "$BIN" --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.2; done
"$BIN" --state-dir $SD create a >/dev/null
[ "$PL" = same ] && "$BIN" --state-dir $SD create x >/dev/null
"$BIN" --state-dir $SD create b >/dev/null
PORT=$((20000 + RANDOM % 20000))
"$BIN" --state-dir $SD run --vrnic a -- ib_write_bw -s 2 -n "$N" -p $PORT >$SD.server.log 2>&1 &
SP=$!
sleep 2
"$BIN" --state-dir $SD run --vrnic b -- ib_write_bw -s 2 -n "$N" -p $PORT localhost \
    >$SD.client.log 2>&1
wait $SP
awk '/^ *2 /{print $4, $5}' $SD.client.log
sleep 1
kill -INT $DP; wait $DP 2>/dev/null
rm -rf $SD $SD.err $SD.server.log $SD.client.log
