#!/usr/bin/env bash
# Idle QoS limiter A/B: vrnic bench --quick --sections perftest, alternated, without and with
# --max-bw 1T --max-rate 1T on the pairs' vRNICs. Figures: the "ib_write_bw -s 2 message rate".
set -u
V=${V:-$(realpath "$(dirname "$0")/../../../../target/release/vrnic")}
N=${N:-6}
out=${TMPDIR:-/tmp}/vrnic-meter-qos/ab; mkdir -p $out
for i in $(seq 1 $N); do
  # The order alternates each round: A B, B A, ...
  if [ $((i % 2)) -eq 1 ]; then order="A B"; else order="B A"; fi
  for v in $order; do
    if [ $v = A ]; then extra=""; else extra="--max-bw 1T --max-rate 1T"; fi
    $V bench --quick --sections perftest --json $out/$v$i.json $extra > $out/$v$i.log 2>&1
    r=$(python3 -c "
import json,sys
j=json.load(open('$out/$v$i.json'))
for f in j['figures']:
    if f['name']=='ib_write_bw -s 2 message rate': print(f['samples'])
" 2>/dev/null)
    echo "$(date +%T) $v$i $r load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
