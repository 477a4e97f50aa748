#!/usr/bin/env python3
"""quick-compare.py DIR [KIND]: the medians of `vrnic bench --quick` runs KIND-base-N.txt and
KIND-final-N.txt in DIR (KIND: quick, the default, or quick-pinned), measurement by
measurement, and their ratio (final / base)."""
import glob, re, statistics, sys

def read(path):
    out = {}
    for line in open(path):
        m = re.match(r"  (\S.*?)\s{2,}([\d,.]+) (\S+)", line)
        if m:
            out[m.group(1)] = (float(m.group(2).replace(",", "")), m.group(3))
    return out

d = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else "quick"
runs = {b: [read(p) for p in sorted(glob.glob(f"{d}/{kind}-{b}-*.txt"))] for b in ("base", "final")}
for name, (_, unit) in runs["base"][0].items():
    vals = {b: [r[name][0] for r in runs[b] if name in r] for b in runs}
    if not vals["base"] or not vals["final"]:
        continue
    mb, mn = statistics.median(vals["base"]), statistics.median(vals["final"])
    print(f"{name:55s} {mb:>12,.2f} {mn:>12,.2f} {unit:5s} final/base {mn / mb if mb else float('nan'):.2f}")
