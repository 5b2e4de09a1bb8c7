#!/usr/bin/env python3
"""hemi against PyTorch + transformers on BERT training: sentences/s and peak memory.

BertForSequenceClassification from all-MiniLM-L6-v2, batch 32 × length 64 of random token
ids, 2 threads, on both sides. Pairs, each run a separate process, interleaved round by
round so that load from elsewhere falls on both alike:

    PyTorch fp32             / hemi fp32
    PyTorch autocast bf16    / hemi amp-bf16
    PyTorch autocast fp16    / hemi amp-fp16   (GradScaler on both sides)

PyTorch runs `bench/torch_bert_sst2.py --bench`, hemi `hemi bench train --model
bert-classifier --json`. Peak memory is each side's own report (ru_maxrss). Prints the
medians of the rounds, hemi / PyTorch, and the issue's targets.

    cargo build --release -p hemi-cli
    python3 bench/bert_side_by_side.py --rounds 3 --steps 8
    python3 bench/bert_side_by_side.py --pairs fp32,bf16 --json runs.json
    python3 bench/bert_side_by_side.py --cpu-level avx2      # both sides capped at AVX2

--cpu-level caps both sides at an instruction-set level (bench/cpu_level.py): what an AVX2
+ FMA + F16C CPU runs, measured on any machine here. Each run's utilisation is printed
against the level's FMA peak (BERT-MiniLM's multiply-adds per sentence of 64 tokens,
counted below, times 2, times 3 for a training step).

Python 3.11 standard library only; the PyTorch side needs a venv with torch and
transformers (--torch-python, default /tmp/torch-ref/bin/python).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from cpu_level import LEVELS, check_torch_level, cpu_ghz, torch_env

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
if not SHARED.is_dir():
    SHARED = Path("/work/shared")
MINILM = SHARED / "models" / "all-MiniLM-L6-v2"

# Multiply-adds of one sentence of 64 tokens through all-MiniLM-L6-v2's encoder (6 layers,
# hidden 384, intermediate 1536): per layer 64 x (4 x 384^2 + 2 x 384 x 1536) for the
# projections and feed-forward, plus 2 x 64^2 x 384 for the attention products.
FORWARD_MACS = 6 * (64 * (4 * 384 * 384 + 2 * 384 * 1536) + 2 * 64 * 64 * 384)

# (label, PyTorch --precision, hemi --precision)
PAIRS = [("fp32", "fp32", "fp32"), ("bf16", "bf16", "amp-bf16"), ("fp16", "fp16", "amp-fp16")]


def run(cmd, env=None):
    """Runs cmd and returns its last JSON line (both sides report their own peak RSS)."""
    proc = subprocess.run(cmd, capture_output=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stderr.decode()[-2000:]}")
    lines = [l for l in proc.stdout.decode().splitlines() if l.strip().startswith("{")]
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", default="fp32,bf16,fp16")
    p.add_argument("--hemi", default=str(REPO / "target" / "release" / "hemi"))
    p.add_argument("--torch-python", default="/tmp/torch-ref/bin/python")
    p.add_argument("--json", help="write every run's numbers here")
    p.add_argument("--cpu-level", default="native", choices=list(LEVELS),
                   help="cap both sides' kernels at this instruction-set level")
    a = p.parse_args()
    capability = check_torch_level(a.torch_python, a.cpu_level)
    print(f"--cpu-level {a.cpu_level}: PyTorch reports {capability}", flush=True)
    pairs = [x for x in PAIRS if x[0] in a.pairs.split(",")]
    rows = {label: {"torch": [], "hemi": [], "torch_rss": [], "hemi_rss": []} for label, _, _ in pairs}
    env = dict(torch_env(a.cpu_level), OMP_NUM_THREADS=str(a.threads),
               MKL_NUM_THREADS=str(a.threads))
    for r in range(a.rounds):
        for label, tp, hp in pairs:
            t = run([a.torch_python, str(REPO / "bench" / "torch_bert_sst2.py"), "--bench",
                        "--precision", tp, "--batch-size", "32", "--max-length", "64",
                        "--steps", str(a.steps), "--threads", str(a.threads)], env)
            h = run([a.hemi, "--cpu-level", a.cpu_level, "bench", "train", "--model",
                     "bert-classifier", "--pretrained",
                        str(MINILM), "--precision", hp, "--batch-size", "32", "--max-length", "64",
                        "--steps", str(a.steps), "--reps", "1", "--threads", str(a.threads),
                        "--json"])
            rows[label]["torch"].append(t["sentences_per_s"])
            rows[label]["hemi"].append(h["sentences_per_s"])
            rows[label]["torch_rss"].append(t["peak_rss_mib"])
            rows[label]["hemi_rss"].append(h["peak_rss_mib"])
            print(f"round {r + 1} {label}: PyTorch {t['sentences_per_s']:.1f} sent/s "
                  f"({t['peak_rss_mib']:.0f} MiB), hemi {h['sentences_per_s']:.1f} sent/s "
                  f"({h['peak_rss_mib']:.0f} MiB)", flush=True)
    med = {k: {f: statistics.median(v) for f, v in row.items()} for k, row in rows.items()}
    print(f"\nBERT-MiniLM training, batch 32 x 64, {a.threads} threads, --cpu-level "
          f"{a.cpu_level} (PyTorch: {capability}), medians of {a.rounds} rounds")
    print(f"{'pair':6} {'PyTorch sent/s':>15} {'hemi sent/s':>12} {'hemi/PyTorch':>13} "
          f"{'PyTorch MiB':>12} {'hemi MiB':>9} {'memory':>7}")
    for label, m in med.items():
        print(f"{label:6} {m['torch']:15.1f} {m['hemi']:12.1f} {m['hemi'] / m['torch']:12.2f}x "
              f"{m['torch_rss']:12.0f} {m['hemi_rss']:9.0f} {m['hemi_rss'] / m['torch_rss']:6.2f}x")
    step_gflop = 3 * 2 * FORWARD_MACS / 1e9
    peak = a.threads * cpu_ghz() * LEVELS[a.cpu_level][3]
    print(f"\nutilisation: {step_gflop:.3f} GFLOP per sentence and step; the {a.cpu_level} "
          f"FMA peak of {a.threads} cores is {peak:.0f} GFLOP/s")
    for label, m in med.items():
        for side in ("torch", "hemi"):
            g = m[side] * step_gflop
            print(f"  {side:5} {label:5} {g:7.1f} GFLOP/s = {100 * g / peak:5.1f} % of peak")
    if "fp32" in med and "bf16" in med:
        f, b = med["fp32"], med["bf16"]
        print("\ntargets: hemi fp32 >= 1.2x PyTorch fp32: "
              f"{f['hemi'] / f['torch']:.2f}x; hemi amp-bf16 >= 1.3x PyTorch bf16: "
              f"{b['hemi'] / b['torch']:.2f}x; hemi amp-bf16 >= 1.5x hemi fp32: "
              f"{b['hemi'] / f['hemi']:.2f}x; peak RSS <= 0.5x: "
              f"{max(m['hemi_rss'] / m['torch_rss'] for m in med.values()):.2f}x at most")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": rows, "medians": med,
                                            "cpu_level": a.cpu_level,
                                            "torch_cpu_capability": capability}, indent=1))


if __name__ == "__main__":
    main()
