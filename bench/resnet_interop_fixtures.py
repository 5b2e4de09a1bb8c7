#!/usr/bin/env python3
"""ResNet interop between hemi and PyTorch/torchvision: fixtures for
`crates/hemi/tests/models/resnet_interop.rs`, and the reverse check (a hemi-written ResNet loaded
into torchvision with strict=True).

    /tmp/torch-ref/bin/python bench/resnet_interop_fixtures.py          # (re)write fixtures
    cargo run --release -p hemi --example export_resnet -- resnet18 /tmp/r18
    /tmp/torch-ref/bin/python bench/resnet_interop_fixtures.py --check-hemi /tmp/r18

Fixtures (crates/hemi/tests/fixtures/resnet/), all torchvision state_dict names:

  resnet20.safetensors     the CIFAR resnet20 (hemi's option-A layout, see CifarResNet below)
                           state_dict exactly as `safetensors.torch.save_file` writes it:
                           F32 tensors, `num_batches_tracked` I64 scalars. Weights from
                           torch's own init (seed 0), BN affine and running statistics
                           randomised so that eval-mode BN is not the identity. The file
                           keeps tensors sorted by dtype, then name (safetensors' order, not
                           the state_dict's); metadata "state_dict_order" is a JSON list of
                           the names in state_dict order.
  resnet20_io.safetensors  x [2,3,32,32], x_odd [2,3,33,33] and for each the logits of the
                           eval-mode network in F32 (`logits`, `logits_odd`) and in F64
                           (`logits_f64`, `logits_odd_f64`, the same weights cast to double).

  resnet18 (1000 classes) and resnet50 (10 classes) have 11.7M and 23.5M parameters, too
  many to commit (hemi's ResNetConfig has no width multiplier to shrink them). Their
  weights are instead a pure function of an integer hash that the Rust test recomputes:

  resnet{18,50}.json       {"arch", "num_classes", "seed", "tensors": [...]}: torchvision's
                           state_dict in order, each entry {name, shape, dtype ("F32"|"I64"),
                           bits, offset, exp, hash}. Element i of the k-th tensor is
                               h = mix(seed ^ mix((k << 32) + i))       (SplitMix64 finaliser)
                               u = (h >> (64 - bits)) - 2^(bits-1)      (signed, `bits` bits)
                               value = (offset + u) * 2^exp             (exact in F32; I64:
                                                                          offset + u)
                           and `hash` = sum_i bits(value_i) * (2i+1) * 0x9E3779B97F4A7C15
                           mod 2^64 over the F32 bit patterns (I64: the integer) checks the
                           Rust generator tensor by tensor.
  resnet{18,50}_io.safetensors  x ([2,3,57,57] for resnet18: odd sizes exercise the
                           stride/padding arithmetic; [2,3,64,64] for resnet50) and `logits`
                           (F32), `logits_f64` (F64) of the eval-mode torchvision network.

Ranges: conv/fc weights uniform within +-2^p, 2^p the power of two nearest to the
kaiming-uniform bound sqrt(6 / fan_in) (fc: 1/sqrt(fan_in), PyTorch's Linear bound, also for
fc.bias); BN weight and running_var in [0.5, 1.5); BN bias and running_mean in [-0.25,
0.25); num_batches_tracked in [0, 2^16).

--check-hemi DIR: DIR/model.safetensors (a hemi ResNet's state_dict; the arch and classes
in its metadata) is loaded into torchvision's model (or the CIFAR definition below) with
strict=True, run in eval mode on DIR/io.safetensors' x, and compared with hemi's logits.

Needs torch, torchvision, safetensors, numpy (the /tmp/torch-ref venv).
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from safetensors.torch import load_file, save_file
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "crates" / "hemi" / "tests" / "fixtures" / "resnet"
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


# ----- the CIFAR ResNet exactly as hemi builds it -------------------------------------------

class CifarBlock(nn.Module):
    """He et al.'s BasicBlock with option-A shortcut as hemi implements it: x[:, :, ::s, ::s]
    between zero channels, half of the extra ones before and the rest after (as
    ../shared/bench/torch_resnet_throughput.py and the widely used PyTorch CIFAR ResNet do,
    so that their weights carry over to hemi).
    """

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.extra = stride, cout - cin

    def forward(self, x):
        o = F.relu(self.bn1(self.conv1(x)))
        o = self.bn2(self.conv2(o))
        s = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.extra:
            s = F.pad(s, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
        return F.relu(o + s)


class CifarResNet(nn.Module):
    def __init__(self, n=3, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        cin = 16
        for i, c in enumerate([16, 32, 64]):
            blocks = []
            for j in range(n):
                blocks.append(CifarBlock(cin, c, 2 if (j == 0 and i > 0) else 1))
                cin = c
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


CIFAR_N = {"resnet20": 3, "resnet32": 5, "resnet56": 9}


def build(arch, num_classes):
    if arch in CIFAR_N:
        return CifarResNet(CIFAR_N[arch], num_classes)
    return getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)


# ----- the hash the Rust test recomputes ----------------------------------------------------

def mix(z):
    """SplitMix64's finaliser on a numpy uint64 array (wrapping arithmetic)."""
    z = z + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hashed(seed, k, n, bits, offset, exp, dtype):
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = mix(np.uint64(seed) ^ mix((np.uint64(k) << np.uint64(32)) + i))
    u = (h >> np.uint64(64 - bits)).astype(np.int64) - (1 << (bits - 1))
    q = offset + u
    if dtype == "I64":
        return q
    assert abs(offset) + (1 << (bits - 1)) <= 1 << 24, "not exact in F32"
    return q.astype(np.float32) * np.float32(2.0 ** exp)


def bits_hash(values, dtype):
    raw = values.view(np.uint32).astype(np.uint64) if dtype == "F32" else values.view(np.uint64)
    m = (np.arange(len(raw), dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(GOLDEN)
    with np.errstate(over="ignore"):
        return int(np.sum(raw * m, dtype=np.uint64))


def spec(name, shape, fc_in):
    """(bits, offset, exp) of a tensor's values (see the module docstring); fc_in is fc's
    fan-in (fc.bias takes fc.weight's bound, as PyTorch's Linear)."""
    leaf = name.rsplit(".", 1)[1]
    if leaf == "num_batches_tracked":
        return 16, 1 << 15, 0
    if len(shape) >= 2:  # conv or fc weight
        fan_in = math.prod(shape[1:])
        bound = 1 / math.sqrt(fan_in) if name.startswith("fc.") else math.sqrt(6 / fan_in)
        return 24, 0, round(math.log2(bound)) - 23
    if name == "fc.bias":
        return 24, 0, round(math.log2(1 / math.sqrt(fc_in))) - 23
    if leaf in ("weight", "running_var"):
        return 23, 1 << 23, -23  # [0.5, 1.5)
    if leaf in ("bias", "running_mean"):
        return 24, 0, -25  # [-0.25, 0.25)
    raise ValueError(name)



def hashed_state(net, seed):
    entries, state = [], {}
    fc_in = net.state_dict()["fc.weight"].shape[1]
    for k, (name, t) in enumerate(net.state_dict().items()):
        shape = list(t.shape)
        dtype = "I64" if t.dtype == torch.int64 else "F32"
        bits, offset, exp = spec(name, shape, fc_in)
        v = hashed(seed, k, max(1, math.prod(shape)), bits, offset, exp, dtype)
        entries.append({"name": name, "shape": shape, "dtype": dtype, "bits": bits,
                        "offset": offset, "exp": exp, "hash": bits_hash(v, dtype)})
        state[name] = torch.from_numpy(v.reshape(shape).copy())
    return entries, state


def randomise_bn(net, gen):
    """Random BN affine and running statistics (eval-mode BN then matters)."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(c, generator=gen) * 0.5 - 0.25)
                m.running_mean.copy_(torch.rand(c, generator=gen) * 0.5 - 0.25)
                m.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
                m.num_batches_tracked.fill_(int(torch.randint(0, 1 << 16, (), generator=gen)))


def logits(net, x):
    net.eval()
    with torch.no_grad():
        y32 = net(x).contiguous()
        y64 = net.double()(x.double()).contiguous()
    net.float()
    return y32, y64


def report(name, y32, y64):
    err = (y32.double() - y64).abs().max().item()
    print(f"{name}: max |logit| {y64.abs().max().item():.4g}, "
          f"torch F32 vs F64 max |d| {err:.3e} "
          f"({err / (2.0 ** -23 * y64.abs().max().item()):.1f} eps*max|logit|)")


def write_fixtures():
    OUT.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    # resnet20: torch-written state_dict.
    torch.manual_seed(0)
    net = CifarResNet(3, 10)
    randomise_bn(net, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 32, 32, generator=gen)
    x_odd = torch.randn(2, 3, 33, 33, generator=gen)
    y, y64 = logits(net, x)
    yo, yo64 = logits(net, x_odd)
    report("resnet20 32x32", y, y64)
    report("resnet20 33x33", yo, yo64)
    sd = net.state_dict()
    # safetensors stores tensors by dtype alignment, then name, whatever order save_file
    # is given: torchvision's (state_dict) order travels in the metadata.
    save_file({k: v.contiguous() for k, v in sd.items()}, str(OUT / "resnet20.safetensors"),
              metadata={"arch": "resnet20", "num_classes": "10",
                        "state_dict_order": json.dumps(list(sd))})
    save_file({"x": x, "logits": y, "logits_f64": y64,
               "x_odd": x_odd, "logits_odd": yo, "logits_odd_f64": yo64},
              str(OUT / "resnet20_io.safetensors"))

    # resnet18 / resnet50: hashed weights, manifest + io only.
    for arch, classes, seed, size in [("resnet18", 1000, 18, 57), ("resnet50", 10, 50, 64)]:
        net = build(arch, classes)
        entries, state = hashed_state(net, seed)
        net.load_state_dict(state, strict=True)
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))
        y, y64 = logits(net, x)
        report(f"{arch} {size}x{size}", y, y64)
        doc = {"arch": arch, "num_classes": classes, "seed": seed, "tensors": entries}
        (OUT / f"{arch}.json").write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        save_file({"x": x, "logits": y, "logits_f64": y64}, str(OUT / f"{arch}_io.safetensors"))
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


def check_hemi(d):
    d = Path(d)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        meta = f.metadata() or {}
    arch, classes = meta.get("arch"), int(meta.get("num_classes", 0))
    if not arch or not classes:
        sys.exit("model.safetensors lacks the 'arch'/'num_classes' metadata "
                 "(written by `cargo run --example export_resnet`)")
    net = build(arch, classes)
    state = load_file(str(d / "model.safetensors"))
    net.load_state_dict(state, strict=True)  # raises on any missing/unexpected/shape
    dtypes = sorted({str(v.dtype) for v in state.values()})
    io = load_file(str(d / "io.safetensors"))
    net.eval()
    with torch.no_grad():
        got = net(io["x"])
    ref = io["logits"]
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    # The Rust test's bound (crates/hemi/tests/models/resnet_interop.rs, `tolerance`):
    # 16 * eps_f32 * max|logit| * sqrt(depth), depth = weight layers on the longest path.
    eps = 2.0 ** -23
    tol = 16 * eps * scale * math.sqrt(int(arch[len("resnet"):]))
    print(f"{arch} ({classes} classes): strict load ok, {len(state)} tensors {dtypes}; "
          f"x {list(io['x'].shape)}; max |torch - hemi| = {err:.3e} "
          f"= {err / (eps * scale):.1f} eps*max|logit| (max |logit| {scale:.3e}; "
          f"tolerance {tol:.3e} = {tol / (eps * scale):.1f})")
    assert err <= tol, "logits differ beyond F32 rounding"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-hemi", metavar="DIR",
                    help="load DIR/model.safetensors into torchvision (strict) and compare")
    a = ap.parse_args()
    if a.check_hemi:
        check_hemi(a.check_hemi)
    else:
        write_fixtures()


if __name__ == "__main__":
    main()
