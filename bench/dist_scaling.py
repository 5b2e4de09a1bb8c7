#!/usr/bin/env python3
"""Data parallelism on one machine: 2 MPI ranks x 1 thread against 1 rank x 2 threads.

Alternates the processes (1 rank, then 2 ranks with each wire dtype) for --rounds rounds
and prints medians: training images/s (global), bytes sent per step and per rank, messages
per step, and the time per step rank 0 spent waiting in communication. The global batch is
the same on both sides (1 rank x B against 2 ranks x B/2).

    cargo build --release -p hemi-cli --features mpi
    python3 bench/dist_scaling.py --model cifar-net --batch 128 --rounds 3

Prints a markdown table and, with --json FILE, writes the raw runs.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEMI = os.path.join(ROOT, "target", "release", "hemi")

SUMMARY = re.compile(r"summary: .* s of training, ([0-9.]+) \w+/s")
COMM = re.compile(
    r"communication \(rank 0\): ([0-9.]+) MB sent per step in ([0-9.]+) messages, "
    r"([0-9.]+) ms per step waiting for the other ranks; global ([0-9.]+)"
)
STEPS = re.compile(r"precision \S+: \d+ of (\d+) steps skipped")


def run(cmd, env):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def train_args(a, batch, threads):
    return [
        HEMI, "train", "--model", a.model, "--dataset", "synthetic",
        "--synthetic-size", str(a.size), "--epochs", "1", "--batch-size", str(batch),
        "--threads", str(threads), "--workers", "1", "--quiet", "--log-every", "100000",
        "--precision", a.precision,
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cifar-net")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--batch", type=int, default=128, help="global batch")
    ap.add_argument("--size", type=int, default=4096, help="synthetic training images")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wires", default="f32,f16,bf16")
    ap.add_argument("--json")
    a = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    wires = a.wires.split(",")
    runs = {"1x2": []} | {f"2x1-{w}": [] for w in wires}
    for r in range(a.rounds):
        out = run(train_args(a, a.batch, 2), env)
        runs["1x2"].append({"images_per_s": float(SUMMARY.search(out)[1])})
        for w in wires:
            cmd = ["mpirun", "-np", "2"] + train_args(a, a.batch // 2, 1) + ["--allreduce", w]
            out = run(cmd, env)
            m = COMM.search(out)
            runs[f"2x1-{w}"].append({
                "images_per_s": float(m[4]), "mb_per_step": float(m[1]),
                "messages_per_step": float(m[2]), "wait_ms_per_step": float(m[3]),
                "steps": int(STEPS.search(out)[1]),
            })
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    med = lambda k, key: statistics.median(x[key] for x in runs[k])
    base = med("1x2", "images_per_s")
    print(f"{a.model}, {a.precision}, global batch {a.batch}, {a.size} synthetic images, "
          f"medians of {a.rounds} alternating rounds\n")
    print("| run | images/s | vs 1 rank x 2 threads | MB sent per step per rank | "
          "messages per step | wait per step (rank 0) |")
    print("|---|---|---|---|---|---|")
    print(f"| 1 rank x 2 threads | {base:.0f} | 1.00x | – | – | – |")
    for w in wires:
        k = f"2x1-{w}"
        ips = med(k, "images_per_s")
        print(f"| 2 ranks x 1 thread, {w} all-reduce | {ips:.0f} | {ips / base:.2f}x | "
              f"{med(k, 'mb_per_step'):.2f} | {med(k, 'messages_per_step'):.1f} | "
              f"{med(k, 'wait_ms_per_step'):.1f} ms |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
