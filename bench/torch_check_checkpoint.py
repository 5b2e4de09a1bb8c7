#!/usr/bin/env python3
"""Loads a hemi CifarNet checkpoint into PyTorch's network with strict=True and compares
the logits on the same inputs.

    cargo run --release -p hemi --example export_cifarnet -- /tmp/export
    python3 bench/torch_check_checkpoint.py /tmp/export

Needs torch and safetensors (see ../shared/bench/README.md for the venv).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class Net(nn.Module):
    """The documents' CNN with fc1's input fixed to 128*6*6 (3x3 kernels on 32x32)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, 128, 3)
        self.fc1 = nn.Linear(128 * 6 * 6, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def main():
    d = sys.argv[1]
    net = Net()
    net.load_state_dict(load_file(f"{d}/model.safetensors"), strict=True)
    io = load_file(f"{d}/io.safetensors")
    with torch.no_grad():
        got = net(io["x"])
    ref = io["logits"]
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"strict load ok; max |torch - hemi| = {err:.3e} (max |logit| {scale:.3e})")
    # F32 rounding over the 4608-term fc1 dot products: a few ulps of the accumulated sums.
    assert err <= 1e-5 * max(scale, 1.0), "logits differ beyond F32 rounding"


if __name__ == "__main__":
    main()
