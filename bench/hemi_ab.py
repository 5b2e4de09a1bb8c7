#!/usr/bin/env python3
"""One hemi build against another on the same machine, in alternating processes: training
images/s (`hemi bench train --json`, median step) and peak memory, medians over rounds and
the ratio new / old, per model and precision. For a change that must not cost speed (a
refactor, a move) when PyTorch's side of `torch_side_by_side.py` is not needed.

    cargo build --release -p hemi-cli
    python3 bench/hemi_ab.py --old /tmp/hemi-base --rounds 5
    python3 bench/hemi_ab.py --old OLD/hemi --models cifar-net:fp32,resnet20:amp-bf16 --cpu-level avx2

Python 3.11 standard library only.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("--new", default="target/release/hemi")
ap.add_argument("--old", required=True, help="the earlier hemi binary")
ap.add_argument("--models", default="cifar-net:fp32,cifar-net:amp-bf16,cifar-net:amp-fp16,"
                "resnet20:fp32,resnet20:amp-bf16",
                help="comma-separated MODEL:PRECISION pairs")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--cpu-level", default="native")
ap.add_argument("--text-args", default="--config bench/minilm_config.json --batch-size 32 --max-length 64",
                help="extra `hemi bench train` flags for the text models (bert-*)")
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


def run(binary, model, precision):
    cmd = [binary, "bench", "train", "--model", model, "--precision", precision,
           "--steps", str(args.steps), "--threads", str(args.threads), "--json",
           "--cpu-level", args.cpu_level]
    if model.startswith("bert"):
        cmd += args.text_args.split()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return rows[-1]


def rate(row):
    """Images/s of an image model's bench row, sentences/s of a text model's."""
    return row["images_per_s"] if "images_per_s" in row else row["sentences_per_s"]


pairs = [p.split(":") for p in args.models.split(",")]
res = {(m, p, side): [] for m, p in pairs for side in ("old", "new")}
for r in range(args.rounds):
    for m, p in pairs:
        # Alternate which side goes first, so a drift in load hits both alike.
        order = [("old", args.old), ("new", args.new)]
        if r % 2:
            order.reverse()
        for side, binary in order:
            res[(m, p, side)].append(run(binary, m, p))

print(f"# {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads, cpu level {args.cpu_level}, "
      f"{args.rounds} rounds x {args.steps} steps")
print(f"# {' '.join(['python3', 'bench/hemi_ab.py', '--old', args.old, '--new', args.new, '--models', args.models, '--rounds', str(args.rounds), '--steps', str(args.steps)])}")
print("| model | precision | old items/s | new items/s | new/old | old peak MiB | new peak MiB |")
print("|---|---|---:|---:|---:|---:|---:|")
for m, p in pairs:
    o, n = res[(m, p, "old")], res[(m, p, "new")]
    mo = statistics.median(rate(x) for x in o)
    mn = statistics.median(rate(x) for x in n)
    po = statistics.median(x.get("peak_rss_mib", 0) for x in o)
    pn = statistics.median(x.get("peak_rss_mib", 0) for x in n)
    print(f"| {m} | {p} | {mo:.0f} | {mn:.0f} | {mn / mo:.3f} | {po:.0f} | {pn:.0f} |")
