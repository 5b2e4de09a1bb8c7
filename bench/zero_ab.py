#!/usr/bin/env python3
"""ZeRO's memory and step time (issue 53, part 1): `hemi train` on 1 rank, and on 2 ranks
(`mpirun -np 2`) with `--zero 0`, `1` and `2`, each rank printing its peak heap and the
bytes of optimizer state it holds (`HEMI_COUNT_HEAP=1`: the optimizer's F32 buffers,
fp16-master's F32 masters, and under ZeRO the shard tensors). Step time is the training
seconds of the run (evaluation excluded) over its steps; the configurations alternate
within each round, so a drift in the machine's load hits all of them; medians over rounds.

    cargo build --release -p hemi-cli --features mpi
    python3 bench/zero_ab.py --model resnet50 --precision fp16-master --optimizer adam \
        --batch-size 8 --synthetic-size 64 --rounds 3

Python 3.11 standard library only.
"""
import argparse
import atexit
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--hemi", default="target/release/hemi")
ap.add_argument("--model", default="resnet50")
ap.add_argument("--precision", default="fp16-master")
ap.add_argument("--optimizer", default="adam")
ap.add_argument("--batch-size", type=int, default=8, help="per rank")
ap.add_argument("--synthetic-size", type=int, default=64)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--pretrained", default=None,
                help="text models: a Hugging Face model directory (e.g. ../shared/models/all-MiniLM-L6-v2)")
ap.add_argument("--text-data", default=None,
                help="text models: a GLUE-style directory (train.tsv, dev.tsv); its first "
                     "--synthetic-size training sentences and 32 dev sentences are used")
ap.add_argument("--max-length", type=int, default=64, help="text models: tokens per sequence at most")
ap.add_argument("--configs", default="one,0,1,2",
                help="comma list: one = one rank; 0/1/2 = two ranks with that --zero")
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


ENV = dict(os.environ, HEMI_COUNT_HEAP="1", OMPI_ALLOW_RUN_AS_ROOT="1",
           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,vader,tcp",
           OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def text_subset():
    """A directory with the first --synthetic-size training sentences of --text-data."""
    d = tempfile.mkdtemp(prefix="zero_ab_text")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    for name, n in (("train.tsv", args.synthetic_size), ("dev.tsv", 32)):
        with open(os.path.join(args.text_data, name)) as f:
            lines = f.readlines()[: n + 1]  # the header and n rows
        with open(os.path.join(d, name), "w") as f:
            f.writelines(lines)
    return d


TEXT_DIR = text_subset() if args.text_data else None


def command(config):
    if TEXT_DIR:
        data = ["--pretrained", args.pretrained, "--data-dir", TEXT_DIR,
                "--max-length", str(args.max_length)]
    else:
        data = ["--dataset", "synthetic", "--synthetic-size", str(args.synthetic_size)]
    train = [args.hemi, "train", "--model", args.model, *data, "--epochs", "1",
             "--precision", args.precision, "--optimizer", args.optimizer,
             "--batch-size", str(args.batch_size), "--workers", "1", "--quiet"]
    if config == "one":
        return train + ["--threads", "2"]
    return ["mpirun", "-np", "2"] + train + ["--threads", "1", "--zero", config]


def run(config):
    cmd = command(config)
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    mem = [(float(h), float(o), float(s)) for h, o, s in re.findall(
        r"memory \(rank \d+\): peak heap ([\d.]+) MiB, optimizer state ([\d.]+) MiB, "
        r"ZeRO shard copies ([\d.]+) MiB", p.stderr)]
    m = re.search(r"summary: \d+ epochs in ([\d.]+) s of training", p.stdout)
    steps = args.synthetic_size // (args.batch_size * (1 if config == "one" else 2))
    return (max(x[0] for x in mem), max(x[1] for x in mem), max(x[2] for x in mem),
            float(m.group(1)) / steps, cmd)


configs = args.configs.split(",")
results = {c: [] for c in configs}
cmds = {}
for r in range(args.rounds):
    order = configs if r % 2 == 0 else configs[::-1]
    for c in order:
        heap, opt, shard, step, cmd = run(c)
        results[c].append((heap, opt, shard, step))
        cmds[c] = " ".join(cmd)

print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {args.model} {args.precision} "
      f"{args.optimizer}, batch {args.batch_size} per rank, medians of {args.rounds} rounds")
base = results.get("0")
for c in configs:
    heap = statistics.median(x[0] for x in results[c])
    opt = statistics.median(x[1] for x in results[c])
    shard = statistics.median(x[2] for x in results[c])
    step = statistics.median(x[3] for x in results[c])
    name = "1 rank" if c == "one" else f"2 ranks --zero {c}"
    rel = ""
    if base and c != "one":
        b_opt = statistics.median(x[1] for x in base)
        b_step = statistics.median(x[3] for x in base)
        rel = (f"\n    vs --zero 0: optimizer state {opt / b_opt:.2f}x, with the shard copies "
               f"{(opt + shard) / b_opt:.2f}x, step time {step / b_step:.2f}x")
    print(f"{name:20s} peak heap/rank {heap:7.1f} MiB, optimizer state/rank {opt:6.1f} MiB "
          f"+ shard copies {shard:5.1f} MiB, step {step * 1e3:6.0f} ms{rel}")
    print(f"    {cmds[c]}")
