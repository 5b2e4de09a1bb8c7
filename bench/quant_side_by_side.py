#!/usr/bin/env python3
"""hemi against PyTorch on INT8 dynamic quantisation: BERT inference latency side by side.

The same model on both sides: transformers' BertForSequenceClassification from
all-MiniLM-L6-v2 with 2 labels (the classifier head drawn once from --seed by PyTorch and
saved with the encoder into a temporary directory that both sides load), the same random
token ids (drawn here from --seed and written to a file both sides read), sequence length
128, full attention masks, 2 threads on both sides. Variants:

    torch-float         PyTorch float, eval, torch.inference_mode()
    torch-int8          torch.ao.quantization.quantize_dynamic(model, {nn.Linear},
                        dtype=torch.qint8) with torch.backends.quantized.engine = "x86"
    torch-int8-fbgemm   the same with the "fbgemm" engine (--no-fbgemm drops it)
    hemi-float          `hemi bench infer --quant none`
    hemi-int8           `hemi bench infer --quant dynamic` (hemi::quant::quantize_dynamic)

Each measurement (variant × batch size) is a separate process, alternated round by round
so that load from elsewhere falls on all alike: warm-up forwards, then the median of the
timed ones. Peak memory is the child's ru_maxrss (os.wait4), the same measure for both
sides. Also printed: the logits of hemi float against PyTorch float (max abs difference)
and of each INT8 model against its own float one, the CPU, and hemi's INT8 kernel. The
issue's target: hemi INT8 at least 1.2x as fast as PyTorch's quantised model.

    cargo build --release -p hemi-cli
    python3 bench/quant_side_by_side.py --rounds 3
    python3 bench/quant_side_by_side.py --rounds 1 --batches 1 --json runs.json

Python 3.11 standard library only; the PyTorch side (this script again, `--torch-worker`)
runs in a venv with torch and transformers (--torch-python, default
/tmp/torch-ref/bin/python; `/tmp/torch-ref/bin/pip install transformers` if it lacks it).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
if not SHARED.is_dir():
    SHARED = Path("/work/shared")
MINILM = SHARED / "models" / "all-MiniLM-L6-v2"
VENV_HINT = ("python3 -m venv /tmp/torch-ref && "
             "/tmp/torch-ref/bin/pip install torch==2.15.0 transformers")

# label -> (side, quantised, PyTorch quantized engine)
VARIANTS = {
    "torch-float": ("torch", False, None),
    "torch-int8": ("torch", True, "x86"),
    "torch-int8-fbgemm": ("torch", True, "fbgemm"),
    "hemi-float": ("hemi", False, None),
    "hemi-int8": ("hemi", True, None),
}


# ---------------------------------------------------------------------------- PyTorch side

def torch_prepare(src, out, seed):
    """BertForSequenceClassification (2 labels) from `src`, its head drawn from `seed`,
    saved to `out` (config.json + model.safetensors) for both sides to load."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    from transformers import BertForSequenceClassification
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.manual_seed(seed)
    m = BertForSequenceClassification.from_pretrained(src, num_labels=2)
    m.save_pretrained(out, safe_serialization=True)
    import transformers
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "engines": list(torch.backends.quantized.supported_engines),
                      "attn_implementation": m.config._attn_implementation}))


def torch_worker(a):
    """One measurement: prints a JSON line like `hemi bench infer --json --outputs`."""
    import resource
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from transformers import BertForSequenceClassification
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = BertForSequenceClassification.from_pretrained(a.model_dir).eval()
    if a.engine:
        torch.backends.quantized.engine = a.engine
    if a.quant:
        model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    setup_s = time.perf_counter() - t0
    ids = [int(t) for t in Path(a.ids).read_text().split()]
    b, l = a.batch, a.seq_len
    x = torch.tensor(ids[:b * l], dtype=torch.long).reshape(b, l)
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), token_type_ids=torch.zeros_like(x))
    times = []
    with torch.inference_mode():
        first = model(**kw).logits
        for _ in range(a.warmup - 1):
            model(**kw)
        for _ in range(a.reps):
            t = time.perf_counter()
            model(**kw)
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    print(json.dumps({
        "bench": "infer", "side": "torch", "quant": "dynamic" if a.quant else "none",
        "engine": torch.backends.quantized.engine, "batch": b, "seq_len": l,
        "threads": torch.get_num_threads(), "reps": a.reps, "warmup": a.warmup,
        "median_ms": med * 1e3, "min_ms": min(times) * 1e3, "items_per_s": b / med,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "setup_s": setup_s, "output_shape": list(first.shape),
        "output": first.flatten().tolist(),
    }))


# ---------------------------------------------------------------------------- the driver

def run_child(cmd, env=None):
    """Runs cmd; returns (its last JSON line, wall seconds, peak RSS MiB of the child)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        # stdout to its end before waiting; the child is unreaped, so wait4 has its rusage.
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, ru = os.wait4(proc.pid, 0)
        errf.seek(0)
        err = errf.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"failed ({code}): {' '.join(map(str, cmd))}\n{err[-3000:]}")
    lines = [x for x in out.splitlines() if x.strip().startswith("{")]
    if not lines:
        sys.exit(f"no JSON line from: {' '.join(map(str, cmd))}\n{out[-2000:]}\n{err[-2000:]}")
    return json.loads(lines[-1]), time.perf_counter() - t0, ru.ru_maxrss / 1024.0


def cpu_info():
    name, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
            "amx_int8", "amx_bf16"]
    return name, [f for f in keep if f in flags], os.cpu_count()


def max_abs(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) if a and b else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20, help="timed forwards at batches up to 8")
    p.add_argument("--reps-large", type=int, default=4,
                   help="timed forwards at batches above 8 (a forward takes seconds)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-fbgemm", action="store_true", help="drop torch-int8-fbgemm")
    p.add_argument("--model-dir", default=str(MINILM))
    p.add_argument("--hemi", default=str(REPO / "target" / "release" / "hemi"))
    p.add_argument("--torch-python", default="/tmp/torch-ref/bin/python")
    p.add_argument("--json", metavar="FILE", help="write every run here")
    # Internal: the PyTorch side.
    p.add_argument("--torch-prepare", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--quant", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.torch_prepare:
        return torch_prepare(a.torch_prepare[0], a.torch_prepare[1], a.seed)
    if a.torch_worker:
        return torch_worker(a)

    if not Path(a.torch_python).exists():
        sys.exit(f"no PyTorch python at {a.torch_python}; make one with:\n  {VENV_HINT}")
    if not Path(a.hemi).exists():
        sys.exit(f"no hemi binary at {a.hemi}: cargo build --release -p hemi-cli")
    batches = [int(x) for x in a.batches.split(",")]
    variants = [v for v in a.variants.split(",") if v in VARIANTS]
    if a.no_fbgemm and "torch-int8-fbgemm" in variants:
        variants.remove("torch-int8-fbgemm")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    me = str(Path(__file__).resolve())
    work = Path(tempfile.mkdtemp(prefix="quant-sbs-"))
    model_dir = work / "model"
    info, _, _ = run_child([a.torch_python, me, "--torch-prepare", a.model_dir, str(model_dir),
                            "--seed", str(a.seed)], env)
    # The token ids: above BERT's special tokens, as `hemi bench infer` draws its own.
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(a.seed)
    ids_path = work / "ids.txt"
    rows = [" ".join(str(rng.randrange(1000, vocab)) for _ in range(a.seq_len))
            for _ in range(max(batches))]
    ids_path.write_text("\n".join(rows) + "\n")
    cpu, flags, ncpu = cpu_info()
    print(f"CPU: {cpu} ({ncpu} logical CPUs; {' '.join(flags)})")
    print(f"PyTorch {info['torch']}, transformers {info['transformers']} (attention "
          f"{info['attn_implementation']}), quantized engines {info['engines']}")
    print(f"model: BertForSequenceClassification from {a.model_dir} (2 labels, head seed "
          f"{a.seed}) in {model_dir}; ids {ids_path}", flush=True)

    def command(variant, b):
        side, quant, engine = VARIANTS[variant]
        reps = a.reps if b <= 8 else a.reps_large
        warmup = a.warmup if b <= 8 else min(a.warmup, 1)
        if side == "torch":
            cmd = [a.torch_python, me, "--torch-worker", "--model-dir", str(model_dir),
                   "--ids", str(ids_path), "--batch", str(b), "--seq-len", str(a.seq_len),
                   "--threads", str(a.threads), "--reps", str(reps), "--warmup", str(warmup)]
            return cmd + (["--quant", "--engine", engine] if quant else [])
        return [a.hemi, "bench", "infer", "--model", "bert-classifier", "--pretrained",
                str(model_dir), "--ids", str(ids_path), "--batch", str(b), "--seq-len",
                str(a.seq_len), "--quant", "dynamic" if quant else "none", "--threads",
                str(a.threads), "--reps", str(reps), "--warmup", str(warmup), "--json",
                "--outputs"]

    runs = []
    kernel = None
    for r in range(a.rounds):
        # Alternate the order round by round, so that no variant always runs first.
        order = variants if r % 2 == 0 else variants[::-1]
        for b in batches:
            for v in order:
                load = os.getloadavg()[0]
                j, wall, rss = run_child(command(v, b), env)
                kernel = j.get("int8_kernel", kernel)
                runs.append({"round": r + 1, "variant": v, "batch": b, "median_ms": j["median_ms"],
                             "min_ms": j["min_ms"], "items_per_s": j["items_per_s"],
                             "peak_rss_mib": rss, "self_peak_rss_mib": j.get("peak_rss_mib"),
                             "wall_s": wall, "load1": load, "reps": j["reps"],
                             "engine": j.get("engine"), "output": j["output"]})
                print(f"round {r + 1} batch {b:3} {v:18} {j['median_ms']:10.1f} ms "
                      f"(min {j['min_ms']:.1f}) {j['items_per_s']:8.1f} items/s "
                      f"{rss:6.0f} MiB  load {load:.1f}", flush=True)

    def med(v, b, f):
        xs = [x[f] for x in runs if x["variant"] == v and x["batch"] == b]
        return statistics.median(xs) if xs else float("nan")

    print(f"\nBERT MiniLM-L6 inference, seq len {a.seq_len}, {a.threads} threads, medians of "
          f"{a.rounds} rounds (each a median of its process's forwards); hemi INT8 kernel "
          f"{kernel}")
    print(f"CPU: {cpu}")
    print("(min ms: the fastest forward of any round, the least disturbed by other load)")
    print(f"{'variant':18} {'batch':>5} {'median ms':>10} {'items/s':>9} {'min ms':>9} "
          f"{'peak MiB':>9}")
    for b in batches:
        for v in variants:
            fastest = min((x["min_ms"] for x in runs if x["variant"] == v and x["batch"] == b),
                          default=float("nan"))
            print(f"{v:18} {b:5} {med(v, b, 'median_ms'):10.1f} {med(v, b, 'items_per_s'):9.1f} "
                  f"{fastest:9.1f} {med(v, b, 'peak_rss_mib'):9.0f}")

    def paired(x, y, b):
        """Median over rounds of y's ms / x's ms within the same round."""
        by = {}
        for run in runs:
            if run["batch"] == b and run["variant"] in (x, y):
                by.setdefault(run["round"], {})[run["variant"]] = run["median_ms"]
        rs = [d[y] / d[x] for d in by.values() if x in d and y in d]
        return statistics.median(rs) if rs else float("nan")

    print("\nratios: the second's median ms / the first's (> 1: the first is faster); "
          "in brackets the median of the per-round ratios")
    pairs = [("hemi-int8 vs torch-int8 (target >= 1.2)", "hemi-int8", "torch-int8"),
             ("hemi-int8 vs torch-int8-fbgemm", "hemi-int8", "torch-int8-fbgemm"),
             ("hemi-float vs torch-float", "hemi-float", "torch-float"),
             ("torch-int8 vs torch-float", "torch-int8", "torch-float"),
             ("hemi-int8 vs hemi-float", "hemi-int8", "hemi-float")]
    for label, x, y in pairs:
        if x in variants and y in variants:
            cells = "  ".join(f"batch {b}: {med(y, b, 'median_ms') / med(x, b, 'median_ms'):5.2f}x "
                              f"[{paired(x, y, b):5.2f}x]" for b in batches)
            print(f"  {label:42} {cells}")

    print("\noutputs (logits [batch, 2] of round 1; max abs difference, and max |logit| for "
          "scale)")

    def out(v, b):
        return next((x["output"] for x in runs if x["variant"] == v and x["batch"] == b), None)

    comparisons = [("hemi-float", "torch-float"), ("torch-int8", "torch-float"),
                   ("torch-int8-fbgemm", "torch-float"), ("hemi-int8", "hemi-float"),
                   ("hemi-int8", "torch-int8")]
    for b in batches:
        ref = out("torch-float", b) or out("hemi-float", b) or []
        scale = max((abs(x) for x in ref), default=float("nan"))
        print(f"  batch {b}: max |logit| of the float model {scale:.4g}")
        for x, y in comparisons:
            ox, oy = out(x, b), out(y, b)
            if ox and oy:
                argmax = sum((p[0] > p[1]) == (q[0] > q[1])
                             for p, q in zip(zip(ox[::2], ox[1::2]), zip(oy[::2], oy[1::2])))
                print(f"    {x:18} vs {y:12} max abs diff {max_abs(ox, oy):.3e}  "
                      f"same argmax {argmax}/{len(ox) // 2}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu, "flags": flags, "torch": info,
                                            "int8_kernel": kernel, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
