#!/usr/bin/env python3
"""Checks `hemi export --format onnx` against onnxruntime.

For each model (CifarNet, ResNet-20 (also trained with fp16-master, F16 weights in the
checkpoint), ResNet-56, ResNet-18 and ResNet-50 on 32x32 inputs, a tiny BERT classifier
trained by hemi, the tiny BERT fixture with large weights, and all-MiniLM-L6-v2 with a
seeded classifier head) and each weight dtype (f32, f16) it exports the model with
`--sample N` (N seeded random inputs and hemi's own eval-mode logits), validates the file
with `onnx.checker.check_model(full_check=True)` (which also runs ONNX's shape inference),
runs it in onnxruntime's CPU provider and compares onnxruntime's logits with

  * `logits`: hemi's logits of the model the file holds (for f16: the weights rounded to F16
    as the file stores them, computed in F32 as the file computes), the test of the graph;
  * `logits_f32`: hemi's logits of the F32 model, the cost of storing the weights in F16.

Checkpoints come from `hemi train` (synthetic images, or a small generated sentiment TSV for
the BERT); nothing is downloaded. Needs: pip install onnx onnxruntime numpy safetensors

    cargo build --release -p hemi-cli
    python3 bench/onnx_check.py [--hemi target/release/hemi] [--work target/onnx-check]
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))
MINILM = os.path.join(SHARED, "models", "all-MiniLM-L6-v2")
FIXTURE = os.path.join(ROOT, "crates", "hemi", "tests", "fixtures", "bert", "tiny", "cls")


def run(hemi, args, cwd):
    r = subprocess.run([hemi] + args, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"hemi {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def train_image(hemi, work, model, extra=(), tag=""):
    ck = os.path.join(work, f"ck-{model}{tag}")
    if not os.path.isdir(ck):
        run(hemi, ["train", "--model", model, "--dataset", "synthetic", "--synthetic-size",
                   "512", "--batch-size", "64", "--epochs", "1", "--quiet",
                   "--checkpoint-dir", ck, *extra], work)
    return ["--checkpoint", ck]


def sentiment(work):
    """train.tsv / dev.tsv: a sentiment word among filler words decides the label."""
    d = os.path.join(work, "sent")
    os.makedirs(d, exist_ok=True)
    pos, neg = ["good", "great", "lovely", "superb"], ["bad", "awful", "poor", "dull"]
    filler = ["the", "movie", "was", "plot", "really", "and", "story"]
    for name, n, off in [("train.tsv", 256, 0), ("dev.tsv", 64, 7)]:
        lines = ["sentence\tlabel"]
        for i in range(n):
            k = i * 7 + off
            label = (k // 3) % 2
            words = [filler[(k + j) % 7] for j in range(4 + k % 3)]
            words.insert(k % len(words), (pos if label else neg)[k % 4])
            lines.append(" ".join(words) + f"\t{label}")
        with open(os.path.join(d, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    return d


def train_bert(hemi, work):
    ck = os.path.join(work, "ck-bert")
    if not os.path.isdir(ck):
        cfg = os.path.join(work, "tiny-bert.json")
        with open(cfg, "w") as f:
            json.dump({"model_type": "bert", "vocab_size": 30522, "hidden_size": 32,
                       "num_hidden_layers": 2, "num_attention_heads": 4,
                       "intermediate_size": 64, "hidden_act": "gelu",
                       "max_position_embeddings": 64, "type_vocab_size": 2,
                       "layer_norm_eps": 1e-12, "pad_token_id": 0}, f)
        run(hemi, ["train", "--model", "bert-classifier", "--config", cfg, "--tokenizer",
                   MINILM, "--dataset", "text", "--data-dir", sentiment(work), "--epochs", "2",
                   "--lr", "0.003", "--batch-size", "16", "--quiet", "--checkpoint-dir", ck],
            work)
    return ["--checkpoint", ck]


def check(hemi, work, label, source, dtype, n, length):
    out = os.path.join(work, f"{label}.{dtype}.onnx")
    run(hemi, ["export", *source, "--format", "onnx", "--out", out, "--dtype", dtype,
               "--sample", str(n), "--sample-length", str(length), "--seed", "3"], work)
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    sample = load_file(out + ".sample.safetensors")
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    feed = {i.name: sample[i.name] for i in sess.get_inputs()}
    got = sess.run(["logits"], feed)[0].astype(np.float64)
    want = sample["logits"].astype(np.float64)
    want32 = sample["logits_f32"].astype(np.float64)
    scale = np.abs(want32).max()
    d = np.abs(got - want).max()
    d32 = np.abs(got - want32).max()
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    agree32 = (got.argmax(-1) == want32.argmax(-1)).mean()
    size = os.path.getsize(out) / 1e6
    return dict(model=label, dtype=dtype, n=n, shape=list(got.shape), scale=scale, d=d, rel=d / scale,
                agree=agree, d32=d32, rel32=d32 / scale, agree32=agree32, mb=size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hemi", default=os.path.join(ROOT, "target", "release", "hemi"))
    ap.add_argument("--work", default=os.path.join(ROOT, "target", "onnx-check"))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--no-minilm", action="store_true", help="skip all-MiniLM-L6-v2")
    a = ap.parse_args()
    hemi = os.path.abspath(a.hemi)
    os.makedirs(a.work, exist_ok=True)
    print(f"onnx {onnx.__version__}, onnxruntime {ort.__version__}, {hemi}")
    cases = [
        ("cifar-net", train_image(hemi, a.work, "cifar-net"), 0),
        ("resnet20", train_image(hemi, a.work, "resnet20"), 0),
        ("resnet20-fp16master",
         train_image(hemi, a.work, "resnet20", ["--precision", "fp16-master"], "-fp16m"), 0),
        ("resnet56", train_image(hemi, a.work, "resnet56"), 0),
        ("resnet18@32", train_image(hemi, a.work, "resnet18"), 0),
        ("resnet50@32", train_image(hemi, a.work, "resnet50"), 0),
        ("bert-tiny-trained", train_bert(hemi, a.work), 32),
        ("bert-tiny-fixture", ["--pretrained", FIXTURE], 24),
    ]
    if not a.no_minilm and os.path.isdir(MINILM):
        cases.append(("minilm-l6-cls", ["--pretrained", MINILM, "--classes", "2"], 48))
    rows = []
    for label, source, length in cases:
        for dtype in ["f32", "f16"]:
            rows.append(check(hemi, a.work, label, source, dtype, a.samples, max(length, 1)))
            r = rows[-1]
            print(f"{r['model']:<18} {r['dtype']}  logits {r['shape']}  scale {r['scale']:.3g}  "
                  f"vs hemi (same weights): max|d| {r['d']:.2e} ({r['rel']:.1e} of scale), "
                  f"argmax {100 * r['agree']:.0f}%  |  vs hemi F32: max|d| {r['d32']:.2e} "
                  f"({r['rel32']:.1e}), argmax {100 * r['agree32']:.0f}%  |  {r['mb']:.2f} MB",
                  flush=True)
    bad = [r for r in rows if r["rel"] > 1e-4 or r["agree"] < 1.0]
    if bad:
        sys.exit(f"onnxruntime differs from hemi beyond 1e-4 of the logit scale: "
                 f"{[(r['model'], r['dtype']) for r in bad]}")
    print("all files pass onnx.checker and match hemi's logits within 1e-4 of their scale")


if __name__ == "__main__":
    main()
