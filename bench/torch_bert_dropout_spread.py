"""PyTorch's side of `cargo run --release -p hemi --example bert_dropout_spread`: how far
transformers' BertModel (all-MiniLM-L6-v2) moves from its eval-mode outputs under training-
mode dropout, on the first 32 sentences of SST-2's train.tsv (max length 64). Prints the
mean squared deviation of the last hidden states (real tokens only) and of the pooled
output over --draws passes, as one JSON object.

    /tmp/torch-ref/bin/python bench/torch_bert_dropout_spread.py --draws 50 --seed 0
"""

import argparse
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")
MINILM = os.path.join(SHARED, "models", "all-MiniLM-L6-v2")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draws", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    from transformers import AutoTokenizer, BertModel

    torch.set_num_threads(a.threads)
    with open(os.path.join(SHARED, "data", "sst2", "train.tsv"), encoding="utf-8") as f:
        xs = [line.split("\t")[0] for line in f.read().splitlines()[1:33]]
    tok = AutoTokenizer.from_pretrained(MINILM)
    enc = tok(xs, padding=True, truncation=True, max_length=64, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    model = BertModel.from_pretrained(MINILM).eval()
    torch.manual_seed(a.seed)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
        h0, p0 = out.last_hidden_state.double(), out.pooler_output.double()
        model.train()
        sq_h = sq_p = 0.0
        for _ in range(a.draws):
            out = model(input_ids=ids, attention_mask=mask)
            dh = (out.last_hidden_state.double() - h0) * mask[..., None]
            sq_h += (dh**2).sum().item()
            sq_p += ((out.pooler_output.double() - p0) ** 2).sum().item()
    real, hidden = mask.sum().item(), h0.shape[-1]
    print(json.dumps({"framework": "pytorch", "draws": a.draws, "batch": list(ids.shape),
                      "msd_hidden": sq_h / (a.draws * real * hidden),
                      "msd_pooled": sq_p / (a.draws * p0.numel())}))


if __name__ == "__main__":
    main()
