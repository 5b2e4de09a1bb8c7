#!/usr/bin/env python3
"""Side-by-side images/s and peak resident memory of CifarNet training per precision preset.

Each preset runs in its own process (`hemi bench train ... --json`), so that the process's
peak RSS is that preset's; rounds interleave the presets so that a burst of load on a shared
machine hits them alike. Prints medians over the rounds and the ratios to fp32.

    cargo build --release -p hemi-cli
    python3 bench/amp_presets.py --batch-size 512 --steps 3 --rounds 3
"""
import argparse
import json
import statistics
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("--hemi", default="target/release/hemi")
p.add_argument("--batch-size", type=int, default=512)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--presets", default="fp32,amp-fp16,amp-bf16,fp16-master")
a = p.parse_args()

presets = a.presets.split(",")
runs = {q: [] for q in presets}
for r in range(a.rounds):
    for q in presets:
        out = subprocess.run(
            [a.hemi, "bench", "train", "--precision", q, "--batch-size", str(a.batch_size),
             "--steps", str(a.steps), "--threads", str(a.threads), "--json"],
            check=True, capture_output=True, text=True).stdout
        j = json.loads(out.strip().splitlines()[-1])
        runs[q].append(j)
        print(f"round {r + 1}: {q:12s} {j['images_per_s']:7.1f} img/s  peak {j['peak_rss_mib']:7.1f} MiB",
              file=sys.stderr)

med = {q: (statistics.median(x["images_per_s"] for x in runs[q]),
           statistics.median(x["peak_rss_mib"] for x in runs[q])) for q in presets}
base_ips, base_rss = med.get("fp32", (None, None))
print(f"CifarNet, batch {a.batch_size}, {a.threads} threads, medians of {a.rounds} rounds "
      f"({a.steps} timed steps each)")
print("| preset | images/s | × fp32 | peak RSS MiB | × fp32 |")
print("|---|---:|---:|---:|---:|")
for q in presets:
    ips, rss = med[q]
    r1 = f"{ips / base_ips:.2f}" if base_ips else "-"
    r2 = f"{rss / base_rss:.2f}" if base_rss else "-"
    print(f"| {q} | {ips:.0f} | {r1} | {rss:.0f} | {r2} |")
