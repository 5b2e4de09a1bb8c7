"""The PyTorch + transformers side of hemi's BERT measurements: BertForSequenceClassification
from all-MiniLM-L6-v2 on SST-2, on the CPU.

Throughput (training steps on random token ids of exactly --max-length tokens):

    /tmp/torch-ref/bin/python bench/torch_bert_sst2.py --bench --precision fp32 \
        --batch-size 32 --max-length 64 --steps 20 --threads 2

prints one JSON object: sentences_per_s (from the median step), the median and every step's
seconds, peak_rss_mib.

Fine-tuning (the SST-2 recipe: AdamW lr 5e-5, weight decay 0.01 except biases and LayerNorm
weights, linear warm-up over 6 % of the steps then linear decay to 0, batch 32, max length
64 with dynamic padding, 1 epoch, seed 0):

    /tmp/torch-ref/bin/python bench/torch_bert_sst2.py --finetune --precision bf16 [--max-steps N]

prints JSON lines: the mean train loss every --log-every (50) steps, the dev accuracy after
each epoch. --pretrained DIR starts from another model directory (a classifier checkpoint
keeps its head) and --no-shuffle trains in file order: with a shared starting checkpoint and
dropout 0 in its config.json, hemi (`--pretrained DIR --no-shuffle`) and this script see the
same batches and the same weights, so their losses can be compared step by step.
--save-init DIR writes such a checkpoint (--seed draws the head, --dropout 0 for none):

    /tmp/torch-ref/bin/python bench/torch_bert_sst2.py --save-init /tmp/init0 --dropout 0

--precision: fp32; bf16 = torch.autocast("cpu", torch.bfloat16) (hemi's amp-bf16); fp16 =
torch.autocast("cpu", torch.float16) with a GradScaler (hemi's amp-fp16). Weights and
optimizer state stay F32 in every mode.
"""

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")
if not os.path.isdir(SHARED):
    SHARED = "/work/shared"
MINILM = os.path.join(SHARED, "models", "all-MiniLM-L6-v2")
SST2 = os.path.join(SHARED, "data", "sst2")

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision):
    dt = DTYPES[precision]
    return torch.autocast("cpu", dtype=dt) if dt is not None else contextlib.nullcontext()


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def model_and_optimizer(lr, weight_decay, pretrained=MINILM):
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(pretrained, num_labels=2)
    # No decay for biases and LayerNorm weights (the BERT recipe).
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
    )
    return model, opt


def train_step(model, opt, scaler, batch, precision):
    opt.zero_grad(set_to_none=True)
    with autocast(precision):
        loss = model(**batch).loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    return loss.detach().float().item()


def make_scaler(precision):
    return torch.amp.GradScaler("cpu") if precision == "fp16" else None


def bench(a):
    torch.manual_seed(0)
    model, opt = model_and_optimizer(5e-5, 0.01)
    model.train()
    scaler = make_scaler(a.precision)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    B, L = a.batch_size, a.max_length
    # [CLS] random tokens [SEP], every sequence exactly L long (no padding).
    ids = torch.randint(1000, vocab, (B, L), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(B, L, dtype=torch.int64),
        "token_type_ids": torch.zeros(B, L, dtype=torch.int64),
        "labels": torch.randint(0, 2, (B,), generator=g),
    }
    times = []
    for _ in range(a.warmup):
        train_step(model, opt, scaler, batch, a.precision)
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, scaler, batch, a.precision)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(json.dumps({
        "framework": "pytorch",
        "torch": torch.__version__,
        "model": "BertForSequenceClassification(all-MiniLM-L6-v2)",
        "precision": a.precision,
        "batch_size": B,
        "max_length": L,
        "threads": torch.get_num_threads(),
        "steps": a.steps,
        "warmup_steps": a.warmup,
        "median_step_s": med,
        "step_s": times,
        "sentences_per_s": B / med,
        "last_loss": loss,
        "peak_rss_mib": peak_rss_mib(),
    }))


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    header = lines[0].split("\t")
    si, li = header.index("sentence"), header.index("label")
    rows = [line.split("\t") for line in lines[1:] if line.strip()]
    return [r[si] for r in rows], [int(r[li]) for r in rows]


def finetune(a):
    from transformers import AutoTokenizer, get_linear_schedule_with_warmup

    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.pretrained)
    train_x, train_y = read_tsv(os.path.join(SST2, "train.tsv"))
    dev_x, dev_y = read_tsv(os.path.join(SST2, "dev.tsv"))
    model, opt = model_and_optimizer(5e-5, 0.01, a.pretrained)
    scaler = make_scaler(a.precision)
    steps_per_epoch = math.ceil(len(train_x) / a.batch_size)
    total = steps_per_epoch * a.epochs
    if a.max_steps:
        total = min(total, a.max_steps)
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)

    def encode(xs):
        # Dynamic padding: each batch is padded to its own longest sentence.
        return tok(xs, padding=True, truncation=True, max_length=a.max_length, return_tensors="pt")

    def evaluate():
        model.eval()
        correct = 0
        with torch.no_grad(), autocast(a.precision):
            for i in range(0, len(dev_x), 128):
                logits = model(**encode(dev_x[i : i + 128])).logits
                correct += (logits.argmax(-1) == torch.tensor(dev_y[i : i + 128])).sum().item()
        model.train()
        return correct / len(dev_x)

    g = torch.Generator().manual_seed(a.seed)
    step, window, t0 = 0, [], time.perf_counter()
    for epoch in range(a.epochs):
        model.train()
        order = list(range(len(train_x))) if a.no_shuffle else torch.randperm(len(train_x), generator=g).tolist()
        for i in range(0, len(order), a.batch_size):
            if step >= total:
                break
            idx = order[i : i + a.batch_size]
            batch = dict(encode([train_x[j] for j in idx]))
            batch["labels"] = torch.tensor([train_y[j] for j in idx])
            window.append(train_step(model, opt, scaler, batch, a.precision))
            sched.step()
            step += 1
            if step % a.log_every == 0:
                print(json.dumps({"step": step, "epoch": epoch, "train_loss": sum(window) / len(window),
                                  "lr": sched.get_last_lr()[0], "elapsed_s": time.perf_counter() - t0}), flush=True)
                window = []
        print(json.dumps({"epoch": epoch, "step": step, "dev_accuracy": evaluate(),
                          "elapsed_s": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib()}), flush=True)
        if step >= total:
            break


def save_init(a):
    import shutil

    from transformers import BertForSequenceClassification

    torch.manual_seed(a.seed)
    model = BertForSequenceClassification.from_pretrained(
        MINILM, num_labels=2, hidden_dropout_prob=a.dropout, attention_probs_dropout_prob=a.dropout
    )
    model.save_pretrained(a.save_init)
    for f in ["tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"]:
        shutil.copy(os.path.join(MINILM, f), a.save_init)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bench", action="store_true")
    mode.add_argument("--finetune", action="store_true")
    mode.add_argument("--save-init", metavar="DIR", help="write all-MiniLM-L6-v2 with a fresh head "
                      "(--seed) and dropout --dropout as a classifier checkpoint, with its tokenizer")
    p.add_argument("--dropout", type=float, default=0.1, help="--save-init: every dropout probability")
    p.add_argument("--precision", choices=list(DTYPES), default="fp32")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps (--bench)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (--bench)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pretrained", default=MINILM, help="--finetune: the model directory (a classifier "
                   "checkpoint keeps its head: both frameworks can start from the same weights)")
    p.add_argument("--no-shuffle", action="store_true", help="--finetune: train in file order")
    p.add_argument("--log-every", type=int, default=50, help="--finetune: mean train loss every N steps")
    p.add_argument(
        "--seed", type=int, default=0, help="--finetune: head init, dropout and shuffling seed"
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.save_init:
        save_init(a)
    else:
        bench(a) if a.bench else finetune(a)


if __name__ == "__main__":
    main()
