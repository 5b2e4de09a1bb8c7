#!/usr/bin/env python3
"""hemi against PyTorch on the same machine: training images/s and peak memory.

CifarNet by default, or a ResNet with --model (see below).

Pairs, each run a separate process, interleaved round by round so that a burst of load on
a shared machine hits both sides alike:

    PyTorch fp32             / hemi fp32
    PyTorch autocast bf16    / hemi amp-bf16
    PyTorch autocast fp16    / hemi amp-fp16

PyTorch runs the reference script `shared/bench/torch_cnn_throughput.py` (variant k3, the
documents' CNN = hemi's cifar-net), hemi runs `hemi bench train --json`. Both on random
data, batch 128, 2 threads. Peak memory is the child's ru_maxrss from os.wait4 for both
sides (hemi's self-reported peak_rss_mib is kept too). Prints medians, the ratios
hemi / PyTorch, and whether the speed issue's targets are met.

With `--model resnet20|resnet18|resnet50` PyTorch runs
`shared/bench/torch_resnet_throughput.py --model NAME --size S` instead (its own CIFAR
resnet20, or torchvision's resnet18/50 with 10 classes; SGD momentum 0.9, weight decay
1e-4) and hemi `hemi bench train --model NAME --image-size S` (SGD momentum 0.9);
defaults: resnet20 batch 128 at 32x32, resnet18/50 batch 32 at 224x224. The speed issue's
targets are CifarNet's and are only checked for it.

    cargo build --release -p hemi-cli
    python3 bench/torch_side_by_side.py                 # 3 rounds
    python3 bench/torch_side_by_side.py --rounds 1 --steps 5 --json runs.json
    python3 bench/torch_side_by_side.py --hemi-baseline OLD/target/release/hemi
        # a third side per pair: an earlier hemi build, run in the same rounds, so a change
        # is measured before and after in one run (medians and the after/before ratio)
    python3 bench/torch_side_by_side.py --model resnet20 --pairs fp32,bf16
    python3 bench/torch_side_by_side.py --model resnet50 --rounds 1 --steps 3
    python3 bench/torch_side_by_side.py --model resnet20 --cpu-level avx2   # an AVX2 CPU's kernels

--cpu-level caps both sides at an instruction-set level, so that any machine here measures
what an AVX2 + FMA + F16C CPU runs: hemi gets `--cpu-level LEVEL` (HEMI_CPU_LEVEL for a
--hemi-baseline build older than the flag), PyTorch ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA, and the script checks that PyTorch reports the capability. Every run
also prints its utilisation: achieved GFLOP/s (a training step's multiply-adds, counted per
model below, times 2) against the level's FMA peak on the cores used (2 FMA units, at the
clock /proc/cpuinfo reports).

Python 3.11 standard library only. Needs a PyTorch venv (see --torch-python).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_HINT = ("python3 -m venv /tmp/torch-ref && "
             "/tmp/torch-ref/bin/pip install torch==2.15.0 numpy")

# (label, PyTorch --mode, hemi --precision)
PAIRS = [("fp32", "fp32", "fp32"), ("bf16", "bf16", "amp-bf16"), ("fp16", "fp16", "amp-fp16")]

# --model: (title, PyTorch script, its model arguments, default batch, default image side).
# Multiply-adds of one image's forward pass (convolutions and linear layers), at the
# model's default image size; a training step is counted as 3 forward passes (forward,
# input gradients, weight gradients). CifarNet: 3->64 3x3 on 30x30, 64->128 3x3 on 13x13,
# 4608->256, 256->10. ResNets: He et al. / torchvision's published counts.
FORWARD_MACS = {"cifar-net": 15.2e6, "resnet20": 40.8e6, "resnet18": 1.82e9,
                "resnet50": 4.11e9}

from cpu_level import LEVELS, check_torch_level, cpu_ghz, torch_env


MODELS = {
    "cifar-net": ("CifarNet (k3)", "torch_cnn_throughput.py", ["--variant", "k3"], 128, 32),
    "resnet20": ("ResNet-20 (CIFAR, option A)", "torch_resnet_throughput.py",
                 ["--model", "resnet20"], 128, 32),
    "resnet18": ("ResNet-18 (torchvision, 10 classes)", "torch_resnet_throughput.py",
                 ["--model", "resnet18"], 32, 224),
    "resnet50": ("ResNet-50 (torchvision, 10 classes)", "torch_resnet_throughput.py",
                 ["--model", "resnet50"], 32, 224),
}


def find_torch_script(given, name):
    if given:
        return Path(given)
    # shared/ sits beside the repository's checkout (…/main and …/shared); a worktree may
    # sit one level deeper.
    for base in (REPO.parent, REPO.parent.parent):
        p = base / "shared" / "bench" / name
        if p.exists():
            return p
    return REPO.parent / "shared" / "bench" / name


def run_child(cmd, env=None):
    """Runs cmd to completion; returns (stdout, wall seconds, peak RSS MiB of the child)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        # Read stdout to its end before waiting (stderr goes to a file, so the child cannot
        # block on a full pipe); the child is still unreaped then, so wait4 gets its rusage.
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, ru = os.wait4(proc.pid, 0)
        errf.seek(0)
        err = errf.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{err}")
    # ru_maxrss is in KiB on Linux.
    return out, wall, ru.ru_maxrss / 1024.0


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hemi", default=str(REPO / "target" / "release" / "hemi"))
    ap.add_argument("--hemi-baseline", metavar="HEMI",
                    help="an earlier hemi binary to run beside --hemi in every round")
    ap.add_argument("--torch-python", default="/tmp/torch-ref/bin/python")
    ap.add_argument("--torch-script", default=None,
                    help="default: shared/bench/torch_cnn_throughput.py beside the repo "
                         "(torch_resnet_throughput.py for the ResNets)")
    ap.add_argument("--model", default="cifar-net", choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run (both sides)")
    ap.add_argument("--torch-warmup", type=int, default=3)
    ap.add_argument("--torch-fp16-steps", type=int, default=3,
                    help="PyTorch fp16 on CPU is very slow: fewer steps (warm-up 1)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="default: 128 (cifar-net, resnet20), 32 (resnet18, resnet50)")
    ap.add_argument("--image-size", type=int, default=None,
                    help="ResNets only; default 32 (resnet20), 224 (resnet18, resnet50)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", default="fp32,bf16,fp16")
    ap.add_argument("--json", metavar="FILE", help="write every raw run here ('-': stdout)")
    ap.add_argument("--cpu-level", default="native", choices=list(LEVELS),
                    help="cap both sides' kernels at this instruction-set level")
    a = ap.parse_args()

    if not Path(a.torch_python).exists():
        sys.exit(f"no PyTorch python at {a.torch_python}; make one with:\n  {VENV_HINT}\n"
                 f"or pass --torch-python")
    title, script_name, torch_model_args, batch0, size0 = MODELS[a.model]
    a.batch_size = a.batch_size or batch0
    a.image_size = a.image_size or size0
    if a.model == "cifar-net" and a.image_size != 32:
        sys.exit("cifar-net is fixed to 32x32 images")
    # The CNN script takes no --size; hemi's flag is only passed where it matters, so that
    # an older hemi binary (--hemi-baseline) still runs CifarNet.
    size_args = [] if a.model == "cifar-net" else ["--size", str(a.image_size)]
    hemi_size_args = [] if a.model == "cifar-net" else ["--image-size", str(a.image_size)]
    script = find_torch_script(a.torch_script, script_name)
    if not script.exists():
        sys.exit(f"PyTorch reference script not found at {script}; pass --torch-script")
    if not Path(a.hemi).exists():
        print(f"{a.hemi} missing: cargo build --release -p hemi-cli", file=sys.stderr)
        subprocess.run(["cargo", "build", "--release", "-p", "hemi-cli"], cwd=REPO, check=True)

    torch_capability = check_torch_level(a.torch_python, a.cpu_level)
    print(f"--cpu-level {a.cpu_level}: PyTorch reports {torch_capability}", file=sys.stderr)
    hemi_env = dict(os.environ, HEMI_CPU_LEVEL=a.cpu_level)
    step_gflop = 3 * 2 * FORWARD_MACS[a.model] * (a.image_size / size0) ** 2 / 1e9
    peak_gflops = a.threads * cpu_ghz() * LEVELS[a.cpu_level][3]
    pairs = [p for p in PAIRS if p[0] in a.pairs.split(",")]
    runs = []  # one dict per process
    for r in range(a.rounds):
        for label, mode, prec in pairs:
            steps, warm = ((a.torch_fp16_steps, 1) if mode == "fp16"
                           else (a.steps, a.torch_warmup))
            out, wall, rss = run_child(
                [a.torch_python, str(script), "--mode", mode, *torch_model_args, *size_args,
                 "--steps", str(steps), "--warmup", str(warm), "--batch", str(a.batch_size),
                 "--threads", str(a.threads)], env=torch_env(a.cpu_level))
            j = last_json(out)
            runs.append({"round": r + 1, "pair": label, "side": "torch", "mode": mode,
                         "images_per_s": j["images_per_s"],
                         "ms_per_step": j.get("ms_per_step", j.get("median_step_ms")),
                         "peak_rss_mib": rss, "wall_s": wall, "raw": j})
            print(f"round {r + 1}: torch {mode:9s} {j['images_per_s']:8.1f} img/s  "
                  f"peak {rss:7.1f} MiB  ({wall:.0f} s)", file=sys.stderr)

            sides = [("hemi", a.hemi)]
            if a.hemi_baseline:
                # Alternate which build goes first, so neither always follows PyTorch.
                sides.insert(r % 2, ("base", a.hemi_baseline))
            for side, binary in sides:
                level_args = [] if side == "base" else ["--cpu-level", a.cpu_level]
                out, wall, rss = run_child(
                    [binary, *level_args, "bench", "--threads", str(a.threads), "train",
                     "--model", a.model, "--precision", prec, "--batch-size",
                     str(a.batch_size), *hemi_size_args, "--steps", str(a.steps), "--json"],
                    env=hemi_env)
                j = last_json(out)
                runs.append({"round": r + 1, "pair": label, "side": side, "mode": prec,
                             "images_per_s": j["images_per_s"],
                             "ms_per_step": j["median_step_ms"], "peak_rss_mib": rss,
                             "self_peak_rss_mib": j.get("peak_rss_mib"), "wall_s": wall,
                             "raw": j})
                print(f"round {r + 1}: {side:5s} {prec:9s} {j['images_per_s']:8.1f} img/s  "
                      f"peak {rss:7.1f} MiB (self-reported {j.get('peak_rss_mib') or 0:.1f})  "
                      f"({wall:.0f} s)", file=sys.stderr)

    def med(pair, side, key):
        v = [x[key] for x in runs if x["pair"] == pair and x["side"] == side
             and x.get(key) is not None]
        return statistics.median(v) if v else float("nan")

    print(f"\n{title}, batch {a.batch_size} ({a.image_size}x{a.image_size}), {a.threads} "
          f"threads, --cpu-level {a.cpu_level} (PyTorch: {torch_capability}), random data, medians "
          f"of {a.rounds} rounds; timed steps: {a.steps} (PyTorch fp16: "
          f"{a.torch_fp16_steps}); peak RSS = child's ru_maxrss")
    print("| pair | PyTorch img/s | hemi img/s | hemi/PyTorch speed "
          "| PyTorch peak MiB | hemi peak MiB (self) | hemi/PyTorch memory |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    m = {}
    for label, mode, prec in pairs:
        ti, hi = med(label, "torch", "images_per_s"), med(label, "hemi", "images_per_s")
        tr, hr = med(label, "torch", "peak_rss_mib"), med(label, "hemi", "peak_rss_mib")
        hs = med(label, "hemi", "self_peak_rss_mib")
        m[label] = (ti, hi, tr, hr)
        print(f"| torch {mode} / hemi {prec} | {ti:.0f} | {hi:.0f} | {hi / ti:.2f}x "
              f"| {tr:.0f} | {hr:.0f} ({hs:.0f}) | {hr / tr:.2f}x |")
    print(f"\nutilisation: a training step is {step_gflop:.3f} GFLOP per image; the "
          f"{a.cpu_level} FMA peak of {a.threads} cores at {cpu_ghz():.2f} GHz is "
          f"{peak_gflops:.0f} GFLOP/s")
    for label, mode, prec in pairs:
        for side, name in (("torch", f"torch {mode}"), ("hemi", f"hemi {prec}")):
            ips = med(label, side, "images_per_s")
            g = ips * step_gflop
            print(f"  {name:14s} {g:7.1f} GFLOP/s = {100 * g / peak_gflops:5.1f} % of peak")

    if a.hemi_baseline:
        print(f"\nhemi ({a.hemi}) against the baseline ({a.hemi_baseline}), same rounds:")
        print("| preset | baseline img/s | hemi img/s | after/before | median of paired ratios "
              "| baseline peak MiB | hemi peak MiB |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, mode, prec in pairs:
            bi, hi = med(label, "base", "images_per_s"), med(label, "hemi", "images_per_s")
            br, hr = med(label, "base", "peak_rss_mib"), med(label, "hemi", "peak_rss_mib")
            by_round = {}
            for x in runs:
                if x["pair"] == label and x["side"] in ("base", "hemi"):
                    by_round.setdefault(x["round"], {})[x["side"]] = x["images_per_s"]
            paired = [v["hemi"] / v["base"] for v in by_round.values() if len(v) == 2]
            pr = statistics.median(paired) if paired else float("nan")
            print(f"| {prec} | {bi:.0f} | {hi:.0f} | {hi / bi:.3f}x | {pr:.3f}x "
                  f"| {br:.0f} | {hr:.0f} |")

    checks = []
    if a.model != "cifar-net":
        m = {}  # the speed issue's targets are CifarNet's
    if "fp32" in m:
        checks.append(("hemi fp32 >= 1.3x PyTorch fp32", m["fp32"][1] / m["fp32"][0], 1.3))
    if "bf16" in m:
        checks.append(("hemi amp-bf16 >= 1.4x PyTorch bf16", m["bf16"][1] / m["bf16"][0], 1.4))
    if "fp16" in m:
        if "fp32" in m:
            r = m["fp16"][1] / m["fp32"][1]
            print(f"\nhemi amp-fp16 / hemi fp32 speed: {r:.2f}x")
            checks.append(("hemi amp-fp16 >= 0.9x hemi fp32", r, 0.9))
        checks.append(("hemi amp-fp16 >= 8x PyTorch fp16", m["fp16"][1] / m["fp16"][0], 8.0))
    for label, v in m.items():
        checks.append((f"hemi peak RSS <= 0.5x PyTorch's ({label})", v[3] / v[2], 0.5))
    if checks:
        print("\ntargets:")
    for name, got, want in checks:
        ok = got <= want if "<=" in name else got >= want
        print(f"  {'met    ' if ok else 'NOT met'}  {name}: {got:.2f}x")

    if a.json:
        doc = {"model": a.model, "image_size": a.image_size, "cpu_level": a.cpu_level,
               "torch_cpu_capability": torch_capability, "step_gflop": step_gflop,
               "peak_gflops": peak_gflops,
               "batch_size": a.batch_size, "threads": a.threads, "rounds": a.rounds,
               "steps": a.steps, "torch_fp16_steps": a.torch_fp16_steps,
               "torch_script": str(script), "runs": runs}
        if a.json == "-":
            print(json.dumps(doc, indent=1))
        else:
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
            print(f"raw runs: {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
