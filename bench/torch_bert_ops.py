#!/usr/bin/env python3
"""PyTorch's side of `cargo run --release -p hemi --example bert_ops_timing`: the non-GEMM
ops of one BERT-MiniLM layer at batch 64 x 128 tokens (hidden 384, 12 heads, FFN 1536), F32,
inference mode, 2 threads; medians of 7 after one warm-up.

    /tmp/torch-ref/bin/python bench/torch_bert_ops.py
"""
import time

import torch

torch.set_num_threads(2)
b, l, h, heads = 64, 128, 384, 12
d = h // heads
x, y, f = torch.randn(b, l, h), torch.randn(b, l, h), torch.randn(b, l, 4 * h)
w, bias, mask = torch.ones(h), torch.zeros(h), torch.zeros(b, 1, 1, l)


def split(t):
    return t.view(b, l, heads, d).permute(0, 2, 1, 3)


def tm(label, fn, n=7):
    fn()
    v = []
    for _ in range(n):
        t = time.perf_counter()
        r = fn()
        v.append((time.perf_counter() - t) * 1e3)
        del r
    v.sort()
    print(f"{label:>28}: {v[n // 2]:8.2f} ms")


with torch.inference_mode():
    tm("add [64,128,384]", lambda: x + y)
    tm("layer_norm", lambda: torch.nn.functional.layer_norm(x, (h,), w, bias, 1e-12))
    tm("gelu [64,128,1536]", lambda: torch.nn.functional.gelu(f))
    tm("attention", lambda: torch.nn.functional.scaled_dot_product_attention(
        split(x), split(y), split(x), attn_mask=mask))
    ctx = split(x).contiguous()
    tm("permute+reshape copy", lambda: ctx.permute(0, 2, 1, 3).reshape(b, l, h))
