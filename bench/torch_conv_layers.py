"""PyTorch's side of `hemi bench conv --layers resnet20-16,resnet20-32,resnet20-64`: the
median time of ResNet-20's three stage convolutions (batch 128, 3x3, padding 1, no bias),
forward under no_grad and backward (input and weight gradients together), F32 and BF16, on
one thread unless --threads says otherwise.

    /tmp/torch-ref/bin/python bench/torch_conv_layers.py --threads 1
"""
import argparse
import time

import torch


def median_ms(f, reps):
    times = []
    for _ in range(reps + 1):
        times.append(f())
    times = sorted(times[1:])
    return times[len(times) // 2] * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for n, c, hw in [(128, 16, 32), (128, 32, 16), (128, 64, 8)]:
        for dt in [torch.float32, torch.bfloat16]:
            x = torch.randn(n, c, hw, hw, dtype=dt, requires_grad=True)
            w = torch.randn(c, c, 3, 3, dtype=dt, requires_grad=True)

            def forward():
                t = time.perf_counter()
                with torch.no_grad():
                    torch.nn.functional.conv2d(x, w, padding=1)
                return time.perf_counter() - t

            def backward():
                y = torch.nn.functional.conv2d(x, w, padding=1)
                gy = torch.ones_like(y)
                t = time.perf_counter()
                torch.autograd.grad(y, [x, w], gy)
                return time.perf_counter() - t

            gflop = 2 * n * c * hw * hw * c * 9 / 1e9
            f, b = median_ms(forward, a.reps), median_ms(backward, a.reps)
            print(f"{n}x{c}x{hw}x{hw} * {c}x{c}x3x3 {str(dt):15} forward {f:6.2f} ms "
                  f"({gflop / f * 1e3:4.0f} GFLOP/s), backward (dx + dw) {b:6.2f} ms "
                  f"({2 * gflop / b * 1e3:4.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
