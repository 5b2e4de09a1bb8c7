#!/usr/bin/env python3
"""PyTorch's side of bench/gpu_check.sh: training steps on a CUDA GPU, random data.

    python3 bench/torch_cuda_train.py --model cifar-net|resnet50|bert --mode fp32|bf16|fp16 \
        [--batch N] [--steps N] [--warmup N] [--image-size S] [--length L] [--config FILE]

The same work as `hemi bench train --device gpu` for the same model: CifarNet (the
documents' CNN with 3x3 kernels, fc1 over 128*6*6) and ResNet-50 (torchvision, 10 classes)
with SGD (lr 1e-3, momentum 0.9) and cross-entropy; BERT (transformers'
BertForSequenceClassification from --config, fresh weights, 2 labels) with AdamW (lr 5e-5,
weight decay 0.01) on random ids of exactly --length tokens. fp16 runs torch.autocast with
a GradScaler, bf16 autocast alone. A step is timed from zero_grad to the loss read back
(`loss.item()`, which waits for the GPU), as hemi's is. Prints one JSON line; exits 2 with a
JSON line saying why when PyTorch, CUDA, torchvision or transformers is missing.
"""
import argparse
import json
import statistics
import sys
import time


ARGS = None


def fail(why, **kw):
    run = {"model": ARGS.model, "mode": ARGS.mode} if ARGS else {}
    print(json.dumps({"status": "unavailable", "why": why, **run, **kw}))
    sys.exit(2)


def cifar_net(nn, F):
    class Net(nn.Module):
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
            x = F.relu(self.fc1(x.flatten(1)))
            return self.fc2(x)

    return Net()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["cifar-net", "resnet50", "bert"], required=True)
    ap.add_argument("--mode", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--config", default=None, help="BERT: a config.json")
    a = ap.parse_args()
    global ARGS
    ARGS = a
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError as e:
        fail(f"PyTorch is not installed for {sys.executable}: {e}")
    if not torch.cuda.is_available():
        fail("torch.cuda.is_available() is False (no CUDA GPU or a CPU-only PyTorch)",
             torch=torch.__version__)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    text = a.model == "bert"
    if a.model == "cifar-net":
        model, batch, size = cifar_net(nn, F), a.batch or 128, a.image_size or 32
    elif a.model == "resnet50":
        try:
            import torchvision
        except ImportError as e:
            fail(f"torchvision is not installed: {e}", torch=torch.__version__)
        model = torchvision.models.resnet50(num_classes=10)
        batch, size = a.batch or 32, a.image_size or 224
    else:
        try:
            from transformers import BertConfig, BertForSequenceClassification
        except ImportError as e:
            fail(f"transformers is not installed: {e}", torch=torch.__version__)
        if not a.config:
            fail("--model bert needs --config (bench/minilm_config.json)")
        cfg = BertConfig.from_json_file(a.config)
        cfg.num_labels = 2
        model, batch = BertForSequenceClassification(cfg), a.batch or 32
    model = model.to(dev).train()
    if text:
        opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
        ids = torch.randint(1000, cfg.vocab_size, (batch, a.length), device=dev)
        mask = torch.ones_like(ids)
        y = torch.randint(0, 2, (batch,), device=dev)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(batch, 3, size, size, device=dev)
        y = torch.randint(0, 10, (batch,), device=dev)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.mode)
    scaler = torch.amp.GradScaler("cuda", enabled=a.mode == "fp16")
    times, loss_v = [], float("nan")
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            if text:
                loss = model(input_ids=ids, attention_mask=mask, labels=y).loss
            else:
                loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        loss_v = loss.item()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rate = "sentences_per_s" if text else "images_per_s"
    out = {"status": "ok", "side": "pytorch-cuda", "model": a.model, "mode": a.mode,
           "batch_size": batch, "steps": a.steps, rate: batch / med, "median_step_ms": med * 1e3,
           "loss": loss_v, "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    if text:
        out["max_length"] = a.length
    else:
        out["image_size"] = size
    print(json.dumps(out))


if __name__ == "__main__":
    main()
