#!/usr/bin/env python3
"""A cost model of hemi's data-parallel step on N ranks: ring all-reduce of the gradient
in buckets, with and without overlap, F32 or F16 on the wire.

    python3 bench/allreduce_model.py            # the tables of bench/RESULTS.md

Ring all-reduce of n bytes on N ranks (Patarasuk & Yuan 2009; hemi's `dist::ring`):
2 (N - 1) messages per rank, each of n / N bytes, so

    t_ring(n) = 2 (N - 1) * alpha + 2 (N - 1) / N * n / bw

per bucket (alpha: the latency of one message, bw: the link's bandwidth). F16 adds one
ring all-gather of 4 bytes per bucket (the agreed pre-scale): (N - 1) * alpha. After the
backward every step runs two tiny ring all-gathers (the found-inf flag, and the stop flag
with the loss): t_small = 2 (N - 1) * alpha. A step is

    no overlap:  t = t_c + sum_b t_ring(b) + t_small
    overlap:     t = t_c + max(t_ring(last bucket), sum_b t_ring(b) - t_bwd) + t_small

where t_c is the measured compute of one step on one rank and t_bwd = 2/3 t_c its backward
(buckets start during the backward; the last one cannot). Efficiency = t_c / t; the
throughput of N ranks is N x efficiency x one rank's.
"""

GBIT = 1e9 / 8  # bytes/s per Gbit/s
BUCKET = 25 * 2**20  # hemi's default bucket (DDP's bucket_cap_mb=25)

# Measured inputs (bench/RESULTS.md, "Data-parallel training"): per-rank compute of one
# step (s) and the parameter count. The accelerator row is an assumption, not a
# measurement (no GPU run of hemi exists yet): ResNet-50 at batch 32 in ~30 ms.
MODELS = [
    # name, params, step seconds, where the step time comes from
    ("CifarNet, batch 64/rank", 1_258_122, 0.233, "measured, Zen 3, 1 thread"),
    ("ResNet-20, batch 64/rank", 272_474, 0.97, "measured, Zen 3, 1 thread"),
    ("ResNet-50, batch 32/rank", 25_557_032, 4.6, "measured, Zen 5, 2 threads"),
    ("ResNet-50, batch 32/rank, accelerator", 25_557_032, 0.030, "assumed"),
]
LINKS = [(25, 20e-6), (100, 5e-6)]  # Gbit/s, per-message latency (assumed: TCP / RDMA)
RANKS = [8, 16, 32, 64, 128, 256, 512]


def buckets(params, wire_bytes):
    """Bucket sizes in bytes on the wire (buckets are cut by F32 size, as in hemi)."""
    f32 = params * 4
    full, rest = divmod(f32, BUCKET)
    sizes = [BUCKET] * full + ([rest] if rest else [])
    return [s * wire_bytes // 4 for s in sizes]


def step_time(params, t_c, n, bw_gbit, alpha, wire_bytes, overlap):
    bw = bw_gbit * GBIT
    ring = []
    for b in buckets(params, wire_bytes):
        t = 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / bw
        if wire_bytes == 2:
            t += (n - 1) * alpha  # the pre-scale's all-gather
        ring.append(t)
    total = sum(ring)
    small = 2 * (n - 1) * alpha
    if not overlap:
        return t_c + total + small
    return t_c + max(ring[-1], total - 2 / 3 * t_c) + small


def main():
    for name, params, t_c, src in MODELS:
        print(f"\n**{name}** — {params:,} parameters ({params * 4 / 1e6:.1f} MB in F32), "
              f"step {t_c * 1e3:.0f} ms ({src})\n")
        head = "| Gbit/s | wire | overlap | " + " | ".join(f"N={n}" for n in RANKS) + " |"
        print(head)
        print("|" + "---|" * (3 + len(RANKS)))
        for bw, alpha in LINKS:
            for wire, wb in (("f32", 4), ("f16", 2)):
                for overlap in (False, True):
                    effs = [t_c / step_time(params, t_c, n, bw, alpha, wb, overlap)
                            for n in RANKS]
                    cells = " | ".join(f"{e * 100:.0f} %" for e in effs)
                    print(f"| {bw} | {wire} | {'yes' if overlap else 'no'} | {cells} |")


if __name__ == "__main__":
    main()
