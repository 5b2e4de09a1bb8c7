#!/usr/bin/env python3
"""Epoch-by-epoch test accuracy of several runs side by side, as a Markdown table.

    python3 bench/compare_epochs.py LABEL=FILE [LABEL=FILE ...]

Each FILE is JSON lines: a hemi `--metrics` file (its `"kind": "epoch"` lines) or the output
of bench/torch_resnet_cifar.py (one line per epoch). Prints accuracy per epoch and run, the
last common epoch's differences from the first run, and seconds per epoch.
"""
import json
import sys


def epochs(path):
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            j = json.loads(line)
            if j.get("kind", "epoch") != "epoch":
                continue
            secs = j.get("seconds", j.get("train_seconds"))
            out[j["epoch"]] = (j["test_accuracy"], j["train_loss"], secs)
    return out


def main():
    runs = []
    for arg in sys.argv[1:]:
        label, _, path = arg.partition("=")
        runs.append((label, epochs(path)))
    if not runs:
        sys.exit(__doc__)
    last = max(max(r, default=0) for _, r in runs)
    print("| epoch | " + " | ".join(f"{l} acc % (loss)" for l, _ in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for e in range(1, last + 1):
        cells = []
        for _, r in runs:
            cells.append(f"{100 * r[e][0]:.2f} ({r[e][1]:.3f})" if e in r else "–")
        print(f"| {e} | " + " | ".join(cells) + " |")
    common = [e for e in range(1, last + 1) if all(e in r for _, r in runs)]
    if common:
        e = common[-1]
        base_label, base = runs[0]
        for label, r in runs[1:]:
            d = 100 * (r[e][0] - base[e][0])
            worst = max(abs(100 * (r[k][0] - base[k][0])) for k in common)
            print(f"\n{label} − {base_label} at epoch {e}: {d:+.2f} points "
                  f"(largest |Δ| over epochs 1–{e}: {worst:.2f})")
    for label, r in runs:
        secs = sorted(v[2] for v in r.values() if v[2] is not None)
        if secs:
            print(f"{label}: median {secs[len(secs) // 2]:.0f} s per epoch")


if __name__ == "__main__":
    main()
