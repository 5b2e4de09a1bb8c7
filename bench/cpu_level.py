"""Capping PyTorch and hemi at one CPU instruction-set level, for the side-by-side scripts.

hemi takes `--cpu-level LEVEL` (or HEMI_CPU_LEVEL); PyTorch takes ATEN_CPU_CAPABILITY (its
own kernels) and ONEDNN_MAX_CPU_ISA (oneDNN's convolutions and GEMMs), and reports what it
uses through torch.backends.cpu.get_cpu_capability(), which `check_torch_level` insists on.
Python 3.11 standard library only.
"""
import os
import subprocess
import sys
from pathlib import Path

# (PyTorch's ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, what torch must report, FLOP/cycle
# of one core with 2 FMA units) per level.
LEVELS = {"native": (None, None, None, 64),
          "avx512": ("avx512", "AVX512_CORE_BF16", "AVX512", 64),
          "avx2": ("avx2", "AVX2", "AVX2", 32)}


def cpu_ghz():
    """The clock /proc/cpuinfo reports for the first core, in GHz (NaN if unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1000.0
    except OSError:
        pass
    return float("nan")


def torch_env(level):
    env = dict(os.environ)
    aten, onednn, _, _ = LEVELS[level]
    if aten:
        env["ATEN_CPU_CAPABILITY"] = aten
        env["ONEDNN_MAX_CPU_ISA"] = onednn
    return env


def check_torch_level(python, level):
    """PyTorch's reported CPU capability under the level's environment; exits if wrong."""
    want = LEVELS[level][2]
    got = subprocess.run([python, "-c", "import torch; "
                          "print(torch.backends.cpu.get_cpu_capability())"],
                         env=torch_env(level), capture_output=True, text=True).stdout.strip()
    if want and got != want:
        sys.exit(f"PyTorch reports CPU capability {got!r} under --cpu-level {level}, "
                 f"expected {want!r}")
    return got
