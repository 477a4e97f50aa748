#!/bin/bash
# lat-sweep.sh BIN: unpinned daemon and ib_write_lat -a -n 100 (as vrnic bench --quick runs it); prints the typical latency (us) at 2 B, 4 KiB and 64 KiB.
BIN=$1
SD=/tmp/ls-$$; mkdir -p $SD
$BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 & DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PORT=$((20000 + RANDOM % 20000))
$BIN --state-dir $SD run -- ib_write_lat -a -n 100 -p $PORT >$SD.s 2>&1 & SP=$!
sleep 0.4
timeout 120 $BIN --state-dir $SD run -- ib_write_lat -a -n 100 -p $PORT localhost >$SD.c 2>&1
wait $SP
echo $(awk '/^ *(2|4096|65536) /{print $5}' $SD.c)
kill $DP; wait $DP 2>/dev/null; umount $SD 2>/dev/null; rm -rf $SD $SD.s $SD.c
