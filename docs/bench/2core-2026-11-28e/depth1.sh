#!/bin/bash
# depth1.sh BIN PROG SIZE: one work request in flight (`-t 1`), the daemon on core 0, both apps
# on core 1 (the server side only waits), so each work request is a round trip between the
# app's core and the engine's: post, execute, complete, poll. Prints the message rate (Mpps).
BIN=$1; PROG=$2; SZ=$3
SD=/tmp/d1-$$; mkdir -p $SD
taskset -c 0 $BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 & DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PORT=$((20000 + RANDOM % 20000))
taskset -c 1 $BIN --state-dir $SD run -- $PROG -s $SZ -t 1 -D 2 -p $PORT >$SD.s 2>&1 & SP=$!
sleep 0.4
taskset -c 1 $BIN --state-dir $SD run -- $PROG -s $SZ -t 1 -D 2 -p $PORT localhost >$SD.c 2>&1
wait $SP
awk '/^ *'$SZ' /{print $5}' $SD.c
kill $DP; wait $DP 2>/dev/null; umount $SD 2>/dev/null; rm -rf $SD $SD.s $SD.c
