#!/usr/bin/env python3
"""Reads a hemi INT8 file (`hemi quantize --out DIR` writes DIR/quantized.safetensors) with
PyTorch, as the README's layout says, and checks it:

- metadata `format` is `hemi-int8/1`; `layers` lists the quantised layers;
- each `L.weight` is int8 with `L.weight_scale` (float32 [out]) and `L.weight_zero_point`
  (int32 [out], zeros); it becomes a per-channel `torch.qint8` tensor through
  `torch._make_per_channel_quantized_tensor`;
- embedding tables listed in `weight_only` are int8 per row with `_scale`;
- static layers carry scalar `input_scale/input_zero_point/output_scale/output_zero_point`
  with zero points in 0..=255;
- with `--float CKPT_DIR/model.safetensors` (default: the `source` recorded in the file), the
  dequantised weights lie within half a step (scale / 2) of the float weights they came
  from, and every other tensor equals the float checkpoint's.

    /tmp/torch-ref/bin/python bench/torch_check_int8.py /tmp/q/cifar-static-minmax
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--float", type=Path, default=None)
    args = ap.parse_args()
    path = args.dir / "quantized.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta.get("format") == "hemi-int8/1", meta
    t = load_file(str(path))
    layers = meta["layers"].split(",")
    fpath = args.float or Path(meta["source"]) / "model.safetensors"
    ref = load_file(str(fpath)) if fpath.exists() else None
    report = {"file": str(path), "mode": meta["mode"], "layers": len(layers), "worst_step_fraction": 0.0}
    for name in layers:
        w, s, z = t[f"{name}.weight"], t[f"{name}.weight_scale"], t[f"{name}.weight_zero_point"]
        assert w.dtype == torch.int8 and s.dtype == torch.float32 and z.dtype == torch.int32, name
        assert s.shape == (w.shape[0],) and z.shape == s.shape and bool((z == 0).all()), name
        q = torch._make_per_channel_quantized_tensor(w, s.double(), z.long(), 0)
        assert q.dtype == torch.qint8 and bool((q.int_repr() == w).all())
        deq = q.dequantize()
        if meta["mode"] == "static":
            for side in ("input", "output"):
                sc, zp = t[f"{name}.{side}_scale"], t[f"{name}.{side}_zero_point"]
                assert sc.shape == () and sc.item() > 0 and 0 <= zp.item() <= 255, (name, side)
        if ref is not None:
            fw = ref[f"{name}.weight"].float()
            shape = [-1] + [1] * (fw.dim() - 1)
            err = ((deq - fw).abs() / s.reshape(shape)).max().item()
            assert err <= 0.5 + 1e-3, f"{name}: dequantised weight {err} steps from the float one"
            report["worst_step_fraction"] = max(report["worst_step_fraction"], err)
    weight_only = [n for n in meta.get("weight_only", "").split(",") if n]
    for name in weight_only:
        w, s = t[name], t[f"{name}_scale"]
        assert w.dtype == torch.int8 and s.shape == (w.shape[0],), name
        deq = w.float() * s[:, None]
        if ref is not None:
            err = ((deq - ref[name].float()).abs() / s[:, None]).max().item()
            assert err <= 0.5 + 1e-3, f"{name}: {err} steps from the float table"
            report["worst_step_fraction"] = max(report["worst_step_fraction"], err)
    report["weight_only"] = len(weight_only)
    if ref is not None:
        quantised = {f"{n}.weight" for n in layers} | set(weight_only)
        for k, v in ref.items():
            if k in quantised:
                continue
            assert k in t, f"{k} missing from the INT8 file"
            assert torch.equal(t[k], v), f"{k} differs from the float checkpoint"
        report["float_checkpoint"] = str(fpath)
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
