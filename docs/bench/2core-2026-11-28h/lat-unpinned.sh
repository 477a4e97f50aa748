#!/bin/bash
# lat-unpinned.sh BIN [SIZE]: unpinned daemon and ib_write_lat -s SIZE -n 2000; prints t_min, t_typical, t_avg (us).
BIN=$1; SZ=${2:-2}
SD=/tmp/lu-$$; mkdir -p $SD
$BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 & DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PORT=$((20000 + RANDOM % 20000))
$BIN --state-dir $SD run -- ib_write_lat -s $SZ -n 2000 -p $PORT >$SD.s 2>&1 & SP=$!
sleep 0.4
timeout 60 $BIN --state-dir $SD run -- ib_write_lat -s $SZ -n 2000 -p $PORT localhost >$SD.c 2>&1
wait $SP
awk '/^ *'$SZ' /{print $3, $5, $6}' $SD.c
kill $DP; wait $DP 2>/dev/null; umount $SD 2>/dev/null; rm -rf $SD $SD.s $SD.c
