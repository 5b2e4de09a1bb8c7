#!/usr/bin/env python3
"""Records PyTorch's SGD, Adam, AdamW and GradScaler trajectories, bit for bit, as fixtures
for crates/hemi/tests/models/torch_parity.rs (which replays them through hemi's public API and
compares every step's F32 bits).

    /tmp/torch-ref/bin/python bench/torch_parity_fixtures.py          # rewrites the fixtures
    /tmp/torch-ref/bin/python bench/torch_parity_fixtures.py --check  # compares, writes nothing

Needs torch (2.x, CPU) and numpy. Writes crates/hemi/tests/fixtures/torch_parity/CASE.json
(configuration, shapes, events, layout) and CASE.bin (little-endian data) per case.

Inputs are exact on both sides: initial parameters and every step's gradients come from an
integer hash (`value` below, mirrored in the Rust test), each a 24-bit integer times a power
of two, so they are F32 values without any decimal round trip. Hyper-parameters are stored
as the bits of the Python floats PyTorch used.

What is recorded per step (CASE.bin, in this order):
  hash     u64[steps]        `params_hash` of all parameters' F32 bits after the step
  snapshot f32[len(snapshots) * total]  every parameter's values after each snapshot step
  scale    u32[steps]        scaler cases: the F32 bits of the scale after `update()`
  skipped  u8[steps]         scaler cases: 1 when the step found inf/NaN (optimizer skipped)
The hash tells the test the first step that differs; the snapshots tell it the index.

The optimizers run PyTorch's single-tensor CPU paths (`foreach=False`, no `fused`), the
ones a CPU user gets by default. One deliberate deviation, for Adam/AdamW only: PyTorch's
CPU `Tensor.sqrt` goes through MKL's `vsSqrt`, which on the machine these fixtures were
made on (AMD EPYC, MKL 2024.2) is not correctly rounded (it is 1 ulp off the IEEE square
root for about 17% of inputs; `--check` prints the measured share). hemi uses the IEEE
square root, as every other backend does, so the Adam fixtures are recorded with
`Tensor.sqrt` replaced by numpy's correctly rounded one; everything else is PyTorch's own
arithmetic. The script prints how far the unpatched (MKL) trajectories end up from the
recorded ones.
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "crates" / "hemi" / "tests" / "fixtures" / "torch_parity"

U64 = np.uint64
M1, M2, GOLDEN = U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB), U64(0x9E3779B97F4A7C15)


def mix(z):
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z + GOLDEN
    z = (z ^ (z >> U64(30))) * M1
    z = (z ^ (z >> U64(27))) * M2
    return z ^ (z >> U64(31))


def value(seed, step, param, n, amp):
    """n exact F32 values for (seed, step, parameter): a signed 24-bit integer u from the top
    of a hash, times 2^(amp - 30 + s) with s in 0..8 from the hash's low bits, so magnitudes
    spread over eight binades below 2^amp."""
    idx = (U64(param) << U64(20)) + np.arange(n, dtype=U64)
    h = mix(U64(seed) ^ mix((U64(step) << U64(32)) ^ idx))
    u = (h >> U64(40)).astype(np.int64) - (1 << 23)
    e = (h & U64(7)).astype(np.int64) + (amp - 30)
    return np.ldexp(u.astype(np.float64), e).astype(np.float32)


def params_hash(arrays):
    """sum_k bits_k * (2k+1) * GOLDEN (mod 2^64) over all parameters' F32 bits in order: any
    single changed element changes it (the multiplier is odd)."""
    bits = np.concatenate([a.view(np.uint32) for a in arrays]).astype(U64)
    k = np.arange(bits.size, dtype=U64)
    return int(np.sum(bits * ((k * U64(2) + U64(1)) * GOLDEN), dtype=U64))


def f64_bits(x):
    return struct.unpack("<Q", struct.pack("<d", float(x)))[0]


# ----- the cases ---------------------------------------------------------------------------

def sgd(name, sizes, steps, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
        nesterov=False, amp=2):
    return dict(name=name, kind="sgd", sizes=sizes, steps=steps, amp=amp,
                hyper=dict(lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay), flags=dict(nesterov=nesterov))


def adam(name, kind, sizes, steps, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=None,
         amsgrad=False, amp=0):
    if weight_decay is None:
        weight_decay = 0.0 if kind == "adam" else 1e-2
    return dict(name=name, kind=kind, sizes=sizes, steps=steps, amp=amp,
                hyper=dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                           weight_decay=weight_decay), flags=dict(amsgrad=amsgrad))


def scaler(name, sizes, steps, growth_interval, infs, growth_factor=2.0, backoff_factor=0.5,
           init_scale=65536.0, lr=0.01, momentum=0.9, amp=0):
    """SGD through torch.amp.GradScaler; `infs` = {step: "inf" | "-inf" | "nan"} poisons one
    gradient element of parameter 0 (index step*7 mod its length) before scaling."""
    return dict(name=name, kind="scaler", sizes=sizes, steps=steps, amp=amp,
                hyper=dict(lr=lr, momentum=momentum, init_scale=init_scale,
                           growth_factor=growth_factor, backoff_factor=backoff_factor),
                flags=dict(growth_interval=growth_interval),
                infs={str(k): v for k, v in sorted(infs.items())})


A, B = [37, 1000], [5, 37, 67]
CASES = [
    sgd("sgd_plain", A, 200, lr=0.1),
    sgd("sgd_momentum_long", [37], 2000, lr=0.05, momentum=0.9),
    sgd("sgd_momentum", A, 200, lr=0.03, momentum=0.9),
    sgd("sgd_dampening", B, 200, lr=0.2, momentum=0.8, dampening=0.3),
    sgd("sgd_nesterov_wd", A, 200, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4),
    sgd("sgd_weight_decay", B, 200, lr=0.07, weight_decay=5e-4),
    sgd("sgd_momentum_wd_lr1", B, 100, lr=1.0, momentum=0.5, weight_decay=0.1, amp=-4),
    adam("adam", "adam", A, 300, lr=1e-3),
    adam("adam_wd", "adam", B, 300, lr=3e-4, betas=(0.8, 0.99), weight_decay=1e-2),
    adam("adam_amsgrad", "adam", B, 300, lr=2e-3, amsgrad=True),
    adam("adam_small_beta1", "adam", B, 200, lr=1e-2, betas=(0.3, 0.9), eps=1e-6),
    adam("adamw", "adamw", A, 300, lr=1e-3),
    adam("adamw_amsgrad", "adamw", B, 300, lr=5e-3, weight_decay=0.1, amsgrad=True),
    scaler("scaler_default", [37, 67], 2100, 2000, {5: "inf", 17: "nan", 40: "-inf"}),
    scaler("scaler_interval3_to_max", [37, 67], 700, 3,
           {10: "inf", 50: "nan", 51: "inf", 500: "-inf", 520: "inf", 521: "inf"}),
    scaler("scaler_odd_factors", [37, 67], 300, 3,
           {k: ("inf", "nan", "-inf")[k % 3] for k in range(7, 300, 11)},
           growth_factor=1.7, backoff_factor=0.3, init_scale=1000.0, momentum=0.0),
]
SNAPSHOTS = (1, 10, 100, 1000)


def snapshot_steps(steps):
    return sorted({s for s in SNAPSHOTS if s <= steps} | {steps})


# ----- running PyTorch ---------------------------------------------------------------------

def ieee_sqrt(self):
    return torch.from_numpy(np.sqrt(self.detach().numpy()))


def run(case, seed, patch_sqrt):
    sizes, steps, h = case["sizes"], case["steps"], case["hyper"]
    params = [torch.from_numpy(value(seed, 0, j, n, 0)).requires_grad_()
              for j, n in enumerate(sizes)]
    kind = case["kind"]
    if kind in ("sgd", "scaler"):
        opt = torch.optim.SGD(params, lr=h["lr"], momentum=h["momentum"],
                              dampening=h.get("dampening", 0.0),
                              weight_decay=h.get("weight_decay", 0.0),
                              nesterov=case["flags"].get("nesterov", False), foreach=False)
    else:
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        opt = cls(params, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                  weight_decay=h["weight_decay"], amsgrad=case["flags"]["amsgrad"],
                  foreach=False, fused=False)
    gs = None
    if kind == "scaler":
        gs = torch.amp.GradScaler("cpu", init_scale=h["init_scale"],
                                  growth_factor=h["growth_factor"],
                                  backoff_factor=h["backoff_factor"],
                                  growth_interval=case["flags"]["growth_interval"])
        gs.scale(torch.zeros(()))  # creates the F32 scale tensor (PyTorch does it lazily)
    infs = case.get("infs", {})
    hashes, snaps, scales, skipped = [], [], [], []
    want_snaps = set(snapshot_steps(steps))
    saved_sqrt = torch.Tensor.sqrt
    if patch_sqrt:
        torch.Tensor.sqrt = ieee_sqrt
    try:
        for t in range(1, steps + 1):
            for j, (p, n) in enumerate(zip(params, sizes)):
                g = value(seed, t, j, n, case["amp"])
                if j == 0 and str(t) in infs:
                    g[(t * 7) % n] = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}[infs[str(t)]]
                g = torch.from_numpy(g)
                p.grad = g * gs._scale if gs is not None else g
            if gs is None:
                opt.step()
            else:
                before = [p.detach().clone() for p in params]
                gs.unscale_(opt)
                found = sum(v.item() for v in gs._found_inf_per_device(opt).values())
                gs.step(opt)
                gs.update()
                moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
                assert moved != bool(found), f"{case['name']} step {t}: skip flag disagrees"
                scales.append(int(gs._scale.view(torch.int32).item()) & 0xFFFFFFFF)
                skipped.append(1 if found else 0)
            vals = [p.detach().numpy().copy() for p in params]
            hashes.append(params_hash(vals))
            if t in want_snaps:
                snaps.append(np.concatenate(vals))
    finally:
        torch.Tensor.sqrt = saved_sqrt
    return hashes, snaps, scales, skipped


def encode(case, hashes, snaps, scales, skipped):
    out = bytearray(np.array(hashes, dtype="<u8").tobytes())
    out += np.concatenate(snaps).astype("<f4").tobytes()
    if case["kind"] == "scaler":
        out += np.array(scales, dtype="<u4").tobytes()
        out += np.array(skipped, dtype=np.uint8).tobytes()
    return bytes(out)


def manifest(case, seed):
    m = {
        "name": case["name"],
        "kind": case["kind"],
        "seed": seed,
        "sizes": case["sizes"],
        "steps": case["steps"],
        "amp": case["amp"],
        "hyper": {k: v for k, v in case["hyper"].items()},
        "hyper_bits": {k: f"{f64_bits(v):016x}" for k, v in case["hyper"].items()},
        "flags": case["flags"],
        "infs": case.get("infs", {}),
        "snapshot_steps": snapshot_steps(case["steps"]),
        "layout": ["hash:u64[steps]", "snapshots:f32[snapshot_steps*sum(sizes)]"]
        + (["scale:u32[steps]", "skipped:u8[steps]"] if case["kind"] == "scaler" else []),
        "torch": torch.__version__,
    }
    return m


def ulps(a, b):
    """Largest distance in F32 ulps between two equally long float32 arrays."""
    def key(x):
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return int(np.max(np.abs(key(a) - key(b))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files, write nothing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    ok = True
    for k, case in enumerate(CASES):
        seed = 1000 + k
        adam_like = case["kind"] in ("adam", "adamw")
        rec = run(case, seed, patch_sqrt=adam_like)
        data = encode(case, *rec)
        man = json.dumps(manifest(case, seed), indent=1) + "\n"
        note = ""
        if adam_like:
            mkl = run(case, seed, patch_sqrt=False)
            first = next((i + 1 for i, (a, b) in enumerate(zip(rec[0], mkl[0])) if a != b), None)
            note = (f"  with MKL's sqrt: first differs at step {first}, "
                    f"final max {ulps(rec[1][-1], mkl[1][-1])} ulp")
        jp, bp = OUT / f"{case['name']}.json", OUT / f"{case['name']}.bin"
        if args.check:
            same = jp.exists() and bp.exists() and jp.read_text() == man and bp.read_bytes() == data
            ok &= same
            print(f"{case['name']:28s} {'same' if same else 'DIFFERS'}{note}")
        else:
            jp.write_text(man)
            bp.write_bytes(data)
            print(f"{case['name']:28s} {len(data):7d} bytes{note}")
    if args.check:
        x = torch.rand(1 << 16) * 3
        share = np.mean(x.sqrt().numpy() != np.sqrt(x.numpy()))
        print(f"Tensor.sqrt differs from the IEEE square root on {share:.1%} of inputs here")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
