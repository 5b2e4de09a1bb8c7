#!/usr/bin/env python3
"""Records PyTorch's INT8 arithmetic as fixtures for crates/hemi/tests/models/quant_torch.rs, which
replays the same inputs through hemi and compares bit for bit.

    /tmp/torch-ref/bin/python bench/quant_fixtures.py          # rewrites the fixture
    /tmp/torch-ref/bin/python bench/quant_fixtures.py --check  # compares, writes nothing

Writes crates/hemi/tests/fixtures/quant/torch_quant.json. Every float is stored as the
bits of its F32 value (an integer), so nothing passes through a decimal round trip.

Cases:
  per_tensor     torch.quantize_per_tensor (quint8 and qint8) on ties (half-integer
                 multiples of the scale), their F32 neighbours, random, huge and infinite
                 values, signed zeros and subnormals, and dequantize() of the result.
                 Values beyond ±2³¹ steps are recorded as PyTorch gives them, but the
                 test does not compare them: PyTorch's float-to-int conversion overflows
                 there (+inf comes out as qmin), where hemi saturates. NaN is left out: PyTorch's result for NaN differs between its vector path
                 (qmax) and its scalar tail (qmin); hemi maps it to the zero point.
  per_channel    PerChannelMinMaxObserver(qint8, per_channel_symmetric) scales of a weight
                 and torch.quantize_per_channel with them: hemi's weight quantisation.
  minmax         MinMaxObserver(quint8, per_tensor_affine, reduce_range=False) over three
                 batches: min, max, scale, zero point.
  moving_average MovingAverageMinMaxObserver(averaging_constant=0.01, same dtype) over
                 five batches.
  fake_quant     torch.fake_quantize_per_tensor_affine forward values and the gradient of
                 sum(y * w) (the straight-through estimator).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.ao.quantization.observer import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)

OUT = Path(__file__).resolve().parent.parent / "crates/hemi/tests/fixtures/quant/torch_quant.json"


def bits(t):
    return np.asarray(t, dtype=np.float32).reshape(-1).view(np.uint32).tolist()


def f32(x):
    return np.float32(x)


def edge_values(scale, rng):
    s = np.float32(scale)
    ties = (np.arange(-300, 301, dtype=np.float64) * 0.5 * float(s)).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    rand = (rng.uniform(-300, 300, 300) * float(s)).astype(np.float32)
    special = np.array(
        [0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, -1.1754944e-38, 3.4028235e38, -3.4028235e38,
         1e30, -1e30, 3e9, -3e9, np.inf, -np.inf],
        dtype=np.float32,
    )
    return np.concatenate([ties[::2], near[::3], rand, special]).astype(np.float32)


def build():
    rng = np.random.default_rng(1234)
    torch.manual_seed(1234)
    out = {"torch": torch.__version__, "per_tensor": []}
    for scale, zp, dtype in [
        (0.1, 128, torch.quint8),
        (1.0 / 3.0, 77, torch.quint8),
        (0.0371, 0, torch.quint8),
        (0.0078125, -5, torch.qint8),
        (1e-3, 0, torch.qint8),
        (2.5, 255, torch.quint8),
    ]:
        x = edge_values(scale, rng)
        q = torch.quantize_per_tensor(torch.from_numpy(x), float(f32(scale)), zp, dtype)
        out["per_tensor"].append(
            {
                "scale": bits([scale])[0],
                "zero_point": zp,
                "dtype": "u8" if dtype == torch.quint8 else "i8",
                "x": bits(x),
                "q": q.int_repr().int().tolist(),
                "dequantized": bits(q.dequantize().numpy()),
            }
        )

    w = torch.from_numpy(rng.normal(0, 0.2, (7, 45)).astype(np.float32))
    w[3] = 0.0  # an all-zero channel: the smallest scale
    obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    obs(w)
    scales, zps = obs.calculate_qparams()
    qw = torch.quantize_per_channel(w, scales.float(), zps.long(), 0, torch.qint8)
    out["per_channel"] = {
        "shape": list(w.shape),
        "x": bits(w.numpy()),
        "scales": bits(scales.float().numpy()),
        "zero_points": zps.int().tolist(),
        "q": qw.int_repr().int().reshape(-1).tolist(),
    }

    def observer_case(make, batches):
        o = make()
        for b in batches:
            o(torch.from_numpy(b))
        s, z = o.calculate_qparams()
        return {
            "batches": [bits(b) for b in batches],
            "min": bits([o.min_val.item()])[0],
            "max": bits([o.max_val.item()])[0],
            "scale": bits([s.item()])[0],
            "zero_point": int(z.item()),
        }

    batches = [rng.normal(m, sd, 333).astype(np.float32) for m, sd in [(0.3, 1.0), (-1.0, 2.0), (2.0, 0.5)]]
    out["minmax"] = observer_case(
        lambda: MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False),
        batches,
    )
    pos = [np.abs(rng.normal(0, 1 + i, 257)).astype(np.float32) for i in range(2)]
    out["minmax_positive"] = observer_case(
        lambda: MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False),
        pos,
    )
    batches = [rng.normal(0.1 * i, 1.0 + 0.3 * i, 200).astype(np.float32) for i in range(5)]
    out["moving_average"] = observer_case(
        lambda: MovingAverageMinMaxObserver(
            averaging_constant=0.01, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False
        ),
        batches,
    )

    x = torch.from_numpy(rng.uniform(-4, 9, 500).astype(np.float32)).requires_grad_()
    g = torch.from_numpy(rng.uniform(-1, 1, 500).astype(np.float32))
    scale, zp = 0.05, 60
    y = torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, 255)
    (y * g).sum().backward()
    out["fake_quant"] = {
        "scale": bits([scale])[0],
        "zero_point": zp,
        "x": bits(x.detach().numpy()),
        "w": bits(g.numpy()),
        "y": bits(y.detach().numpy()),
        "grad": bits(x.grad.numpy()),
    }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    torch.backends.quantized.engine = "x86"
    data = build()
    text = json.dumps(data, separators=(",", ":"))
    if args.check:
        old = json.loads(OUT.read_text())
        old.pop("torch"), data.pop("torch")
        same = old == data
        print("fixture matches" if same else "fixture differs")
        sys.exit(0 if same else 1)
    OUT.write_text(text + "\n")
    print(f"wrote {OUT} ({len(text)} bytes, torch {data['torch']})")


if __name__ == "__main__":
    main()
