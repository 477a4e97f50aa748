#!/bin/bash
# flood2.sh BIN: engine on core 0; 4 ib_read_bw -e -q 16 1 MiB pairs on core 1; the flood's
# READ MB/s over 3 s alone, then beside an event-mode ping-pong (ibv_rc_pingpong -e), and the
# ping-pong's round trip (its own -n 20000 run beside the flood).
BIN=$1
SD=/tmp/fl2-$$; mkdir -p $SD
taskset -c 0 $BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 & DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PIDS=""
for k in 1 2 3 4; do P=$((31000 + k))
  taskset -c 1 $BIN --state-dir $SD run -- ib_read_bw -e -q 16 -s 1048576 -n 1000000 -p $P >/dev/null 2>&1 & PIDS="$PIDS $!"; done
sleep 0.5
for k in 1 2 3 4; do P=$((31000 + k))
  taskset -c 1 $BIN --state-dir $SD run -- ib_read_bw -e -q 16 -s 1048576 -n 1000000 -p $P localhost >/dev/null 2>&1 & PIDS="$PIDS $!"; done
sleep 3
rb() { $BIN --state-dir $SD stats --json | python3 -c 'import json,sys; print(sum(v["received"]["read"]["bytes"] for v in json.load(sys.stdin)))'; }
a=$(rb); sleep 3; b=$(rb); alone=$(( (b-a)/3000000 ))
taskset -c 1 $BIN --state-dir $SD run -- ibv_rc_pingpong -e -s 64 -n 150000 -p 31100 >$SD.s 2>&1 & S=$!
sleep 0.3
taskset -c 1 $BIN --state-dir $SD run -- ibv_rc_pingpong -e -s 64 -n 150000 -p 31100 localhost >$SD.c 2>&1 & C=$!
sleep 0.5
a=$(rb); sleep 3; b=$(rb); beside=$(( (b-a)/3000000 ))
wait $C; wait $S
rt=$(awk '/iters in/{print $(NF-1)}' $SD.c)
echo "alone_MBps=$alone beside_MBps=$beside kept=$(( 100*beside/alone ))% pingpong_e_us=$rt"
kill $PIDS 2>/dev/null; sleep 0.5; kill $DP; wait $DP 2>/dev/null; umount $SD 2>/dev/null; rm -rf $SD $SD.s $SD.c
