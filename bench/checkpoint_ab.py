#!/usr/bin/env python3
"""Activation checkpointing on and off in alternating processes (`hemi bench train --json`,
with and without `--checkpoint-activations SEGMENTS`): median step time, the heap the
forward keeps for the backward (`kept_heap_mib`), the step's heap peak above what lives
between steps (`step_heap_mib`) and peak RSS, medians over rounds, and the ratios on/off.
The order of on and off alternates per round, so a drift in the machine's load hits both.

    cargo build --release -p hemi-cli
    python3 bench/checkpoint_ab.py --model resnet50 --image-size 224 --batch-size 32 \
        --precision amp-bf16 --segments blocks --rounds 3 --steps 3
    python3 bench/checkpoint_ab.py --model bert-classifier \
        --pretrained ../shared/models/all-MiniLM-L6-v2 --batch-size 32 --max-length 64 \
        --precision amp-bf16 --segments layers --rounds 5 --steps 5

Python 3.11 standard library only.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("--hemi", default="target/release/hemi")
ap.add_argument("--model", required=True)
ap.add_argument("--precision", default="amp-bf16")
ap.add_argument("--segments", default="", help="the --checkpoint-activations value")
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--image-size", type=int, default=32)
ap.add_argument("--max-length", type=int, default=64)
ap.add_argument("--pretrained", default=None)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(on):
    cmd = [args.hemi, "bench", "train", "--model", args.model, "--precision", args.precision,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--threads", str(args.threads), "--json"]
    if args.pretrained:
        cmd += ["--pretrained", args.pretrained, "--max-length", str(args.max_length)]
    else:
        cmd += ["--image-size", str(args.image_size)]
    if on:
        cmd += ["--checkpoint-activations"] + ([args.segments] if args.segments else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return rows[-1]


res = {False: [], True: []}
for r in range(args.rounds):
    for on in ([False, True] if r % 2 == 0 else [True, False]):
        row = run(on)
        res[on].append(row)
        print(f"# round {r} {'on ' if on else 'off'}: step {row['median_step_ms']:.0f} ms, "
              f"kept {row['kept_heap_mib']:.0f} MiB, step heap {row['step_heap_mib']:.0f} MiB, "
              f"peak RSS {row['peak_rss_mib']:.0f} MiB, loss {row['loss']}", flush=True)

loadavg = os.getloadavg()
print(f"# {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads, {args.rounds} rounds x "
      f"{args.steps} steps, load average at the end {loadavg[0]:.1f}")
shape = (f"{args.batch_size}x{args.max_length}" if args.pretrained
         else f"{args.batch_size} {args.image_size}x{args.image_size}")
print(f"| model | precision | batch | checkpointing | step ms | kept MiB | step heap MiB | "
      f"peak RSS MiB |")
print("|---|---|---|---|---:|---:|---:|---:|")
med = {}
for on in (False, True):
    rows = res[on]
    med[on] = {k: statistics.median(x[k] for x in rows)
               for k in ("median_step_ms", "kept_heap_mib", "step_heap_mib", "peak_rss_mib")}
    m = med[on]
    print(f"| {args.model} | {args.precision} | {shape} | "
          f"{(args.segments or 'default') if on else 'off'} | {m['median_step_ms']:.0f} | "
          f"{m['kept_heap_mib']:.0f} | {m['step_heap_mib']:.0f} | {m['peak_rss_mib']:.0f} |")
on, off = med[True], med[False]
print(f"| on/off | | | | {on['median_step_ms'] / off['median_step_ms']:.3f}x | "
      f"{on['kept_heap_mib'] / off['kept_heap_mib']:.3f}x | "
      f"{on['step_heap_mib'] / off['step_heap_mib']:.3f}x | "
      f"{on['peak_rss_mib'] / off['peak_rss_mib']:.3f}x |")
# On a machine whose load drifts, the ratio within each round (on and off run back to back)
# is steadier than the ratio of the medians.
per_round = sorted(b["median_step_ms"] / a["median_step_ms"] for a, b in zip(res[False], res[True]))
print(f"# step time on/off within each round: median {statistics.median(per_round):.3f}x, "
      f"range {per_round[0]:.3f}-{per_round[-1]:.3f}x")
same = all(a["loss"] == b["loss"] for a, b in zip(res[False], res[True]))
print(f"# last losses identical on and off: {same}")
