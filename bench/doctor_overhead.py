#!/usr/bin/env python3
"""Cost of the precision doctor's machinery on healthy runs: `hemi train` with no policy,
with `--policy` (a pin that changes nothing: the last layer to the preset's own dtype, so
every op consults the pins and the parameter names), and with `--auto-promote` (replays
armed, none needed), in alternating processes; medians of the training throughput.

    python3 bench/doctor_overhead.py --model cifar-net --rounds 5
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--hemi", default="target/release/hemi")
ap.add_argument("--model", default="cifar-net")
ap.add_argument("--precision", default="amp-fp16")
ap.add_argument("--last-layer", default=None, help="module to pin (default: the model's last)")
ap.add_argument("--synthetic-size", type=int, default=2560)
ap.add_argument("--batch-size", type=int, default=128)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--baseline", default=None,
                help="a hemi binary built before the doctor (its plain run joins the rounds)")
args = ap.parse_args()

last = args.last_layer or {"cifar-net": "fc2", "mlp": "fc2", "resnet20": "fc"}.get(args.model, "fc")
dtype = {"amp-fp16": "f16", "amp-bf16": "bf16"}.get(args.precision, "f32")
policy = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
json.dump({"modules": {last: dtype}}, policy)
policy.close()

base = [args.hemi, "train", "--model", args.model, "--precision", args.precision, "--epochs", "1",
        "--synthetic-size", str(args.synthetic_size), "--batch-size", str(args.batch_size),
        "--quiet", "--log-every", "100000"]
configs = {
    "plain": [],
    "policy": ["--policy", policy.name],
    "auto-promote": ["--auto-promote"],
}
if args.baseline:
    configs = {"before": [], **configs}
rates = {k: [] for k in configs}
for r in range(args.rounds):
    for name, extra in configs.items():
        cmd = ([args.baseline] + base[1:]) if name == "before" else base
        out = subprocess.run(cmd + extra, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{name}: {out.stderr}")
        m = re.search(r"summary: .* ([0-9.]+) images/s", out.stdout)
        rates[name].append(float(m.group(1)))
    print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"{args.model} {args.precision}, {args.rounds} rounds, {cpu}")
med = {k: statistics.median(v) for k, v in rates.items()}
for k, v in med.items():
    print(f"  {k:13s} median {v:7.1f} images/s  ratio to plain {v / med['plain']:.3f}")
os.unlink(policy.name)
