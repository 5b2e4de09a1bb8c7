#!/usr/bin/env python3
"""PyTorch's side of the ResNet-20 accuracy comparison: the `resnet-cifar` recipe of
`hemi train --model resnet20` on the same CIFAR-10 JPEG images, epoch by epoch.

    python3 bench/torch_resnet_cifar.py --data /tmp/cifar-jpeg --mode fp32|bf16|fp16 \
        [--epochs 30] [--run-epochs 10] [--threads 2] [--seed 0]

The recipe, as hemi's (crates/hemi/src/train/recipe.rs): SGD lr 0.1, momentum 0.9, weight
decay 1e-4 on every parameter, batch 128 (the last, partial batch of an epoch kept, as
hemi's loader and PyTorch's DataLoader do), cosine annealing per step from 0.1 to 0 over `--epochs` epochs (the
closed form, as hemi applies it), random crop 32 with padding 4 + horizontal flip,
Normalize(CIFAR-10 mean, std); He et al.'s option-A ResNet-20 (the definition in
../shared/bench/torch_resnet_throughput.py), torchvision's init (kaiming-normal fan_out
convs, BN 1/0). `--run-epochs` stops early (the schedule still spans `--epochs`). fp16 uses
`torch.amp.GradScaler`. Prints one JSON line per epoch: train loss, test accuracy, seconds.

The JPEGs are decoded by Pillow here and by the `image` crate in hemi: decoders may differ
by one grey level on a few pixels, which does not move accuracy.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "shared", "bench"))
from torch_resnet_throughput import CifarResNet  # noqa: E402

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def load(split_dir):
    xs, ys = [], []
    for label, c in enumerate(CLASSES):
        d = os.path.join(split_dir, c)
        for name in sorted(os.listdir(d)):
            with Image.open(os.path.join(d, name)) as im:
                xs.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
            ys.append(label)
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous()  # N,3,32,32 u8
    return x, torch.tensor(ys, dtype=torch.long)


def to_float(x_u8):
    return (x_u8.float() / 255.0 - MEAN) / STD


def augment(x_u8, g):
    n = x_u8.shape[0]
    padded = F.pad(x_u8, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (n,), generator=g)
    dx = torch.randint(0, 9, (n,), generator=g)
    flip = torch.rand(n, generator=g) < 0.5
    out = torch.empty_like(x_u8)
    for i in range(n):
        img = padded[i, :, dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
        out[i] = img.flip(2) if flip[i] else img
    return out


def init(net):
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/cifar-jpeg")
    ap.add_argument("--mode", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--run-epochs", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.time()
    xtr, ytr = load(os.path.join(a.data, "train"))
    xte, yte = load(os.path.join(a.data, "test"))
    print(f"decoded {len(ytr)} train / {len(yte)} test images in {time.time() - t0:.1f} s",
          file=sys.stderr)
    xte_f = to_float(xte)
    net = CifarResNet(3)
    init(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    steps_per_epoch = (len(ytr) + a.batch - 1) // a.batch
    total = a.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: (1.0 + math.cos(math.pi * t / total)) / 2.0)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.mode)
    scaler = torch.amp.GradScaler("cpu", enabled=a.mode == "fp16")
    g = torch.Generator().manual_seed(a.seed)
    run = a.run_epochs or a.epochs
    for epoch in range(1, run + 1):
        start = time.time()
        net.train()
        perm = torch.randperm(len(ytr), generator=g)
        loss_sum = 0.0
        for b in range(steps_per_epoch):
            idx = perm[b * a.batch:(b + 1) * a.batch]
            x = to_float(augment(xtr[idx], g))
            y = ytr[idx]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dt, enabled=dt is not None):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_sum += loss.item()
        train_s = time.time() - start
        net.eval()
        correct = 0
        with torch.no_grad(), torch.autocast("cpu", dtype=dt, enabled=dt is not None):
            for i in range(0, len(yte), 500):
                correct += (net(xte_f[i:i + 500]).argmax(1) == yte[i:i + 500]).sum().item()
        print(json.dumps({"epoch": epoch, "mode": a.mode, "train_loss": loss_sum / steps_per_epoch,
                          "test_accuracy": correct / len(yte), "train_seconds": train_s,
                          "images_per_s": len(ytr) / train_s,
                          "lr": opt.param_groups[0]["lr"], "torch": torch.__version__}),
              flush=True)


if __name__ == "__main__":
    main()
