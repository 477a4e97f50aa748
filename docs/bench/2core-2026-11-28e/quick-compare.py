#!/usr/bin/env python3
"""quick-compare.py DIR: the medians of `vrnic bench --quick` runs quick-base-N.txt and
quick-new-N.txt in DIR, measurement by measurement, and their ratio (new / base)."""
import glob, re, statistics, sys

def read(path):
    out = {}
    for line in open(path):
        m = re.match(r"  (\S.*?)\s{2,}([\d,.]+) (\S+)", line)
        if m:
            out[m.group(1)] = (float(m.group(2).replace(",", "")), m.group(3))
    return out

d = sys.argv[1]
runs = {b: [read(p) for p in sorted(glob.glob(f"{d}/quick-{b}-*.txt"))] for b in ("base", "new")}
for name, (_, unit) in runs["base"][0].items():
    vals = {b: [r[name][0] for r in runs[b] if name in r] for b in runs}
    if not vals["base"] or not vals["new"]:
        continue
    mb, mn = statistics.median(vals["base"]), statistics.median(vals["new"])
    print(f"{name:55s} {mb:>12,.2f} {mn:>12,.2f} {unit:5s} new/base {mn / mb if mb else float('nan'):.2f}")
