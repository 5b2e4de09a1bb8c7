"""Reference fixtures for hemi's BERT (crates/hemi/tests/fixtures/bert/), from PyTorch and
Hugging Face transformers, and a check that hemi-written BERT checkpoints load into
transformers with no missing or unexpected keys.

    /tmp/torch-ref/bin/python bench/bert_fixtures.py            # writes the fixtures
    /tmp/torch-ref/bin/python bench/bert_fixtures.py --check-hemi DIR [--kind cls|mlm|base]

hemi's side of the check: `HEMI_BERT_EXPORT=/tmp/x cargo test --release -p hemi --test models
save_pretrained` leaves hemi-written models in /tmp/x/cls and /tmp/x/mlm.

Fixtures (see the README this script writes beside them):
  minilm_sst2.safetensors  the first 32 SST-2 dev sentences through all-MiniLM-L6-v2
  tiny/cls/, tiny/mlm/     a tiny random BERT saved by transformers (config.json +
                           model.safetensors) as BertForSequenceClassification and
                           BertForMaskedLM, with tiny/batch.safetensors and their logits
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "hemi", "tests", "fixtures", "bert")
MINILM = os.path.join(ROOT, "..", "shared", "models", "all-MiniLM-L6-v2")
if not os.path.isdir(MINILM):
    MINILM = "/work/shared/models/all-MiniLM-L6-v2"
SST2_DEV = os.path.join(os.path.dirname(MINILM), "..", "data", "sst2", "dev.tsv")

N_SENTENCES = 32
N_HIDDEN = 4
MAX_LENGTH = 64

TINY = dict(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    hidden_act="gelu",
    max_position_embeddings=40,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    num_labels=3,
    pad_token_id=0,
    # Weights of size O(1) rather than transformers' default 0.02, so that activations
    # reach the nonlinear range of GELU, tanh and softmax and the logits tell apart what
    # a near-linear network would not (the exact GELU from its tanh approximation).
    initializer_range=0.5,
)


def sst2_sentences(n):
    with open(SST2_DEV, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines[0].split("\t")[0] == "sentence", lines[0]
    return [line.split("\t")[0] for line in lines[1 : n + 1]]


def mean_pool_normalise(hidden, mask):
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def minilm_fixture():
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    sentences = sst2_sentences(N_SENTENCES)
    tok = AutoTokenizer.from_pretrained(MINILM)
    enc = tok(sentences, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    model = AutoModel.from_pretrained(MINILM).eval()
    with torch.no_grad():
        out = model(**enc)
    emb = mean_pool_normalise(out.last_hidden_state, enc["attention_mask"])
    st = SentenceTransformer(MINILM, device="cpu")
    st_emb = torch.tensor(st.encode(sentences, batch_size=N_SENTENCES))
    cos = torch.nn.functional.cosine_similarity(emb, st_emb, dim=1)
    print(f"sentence embeddings vs SentenceTransformer.encode: min cosine {cos.min():.8f}, "
          f"max |d| {(emb - st_emb).abs().max():.3e}")
    assert cos.min() > 0.99999, cos.min()
    tensors = {
        "input_ids": enc["input_ids"].to(torch.int64).contiguous(),
        "attention_mask": enc["attention_mask"].to(torch.int64).contiguous(),
        "token_type_ids": enc["token_type_ids"].to(torch.int64).contiguous(),
        "last_hidden_state": out.last_hidden_state[:N_HIDDEN].float().contiguous(),
        "pooler_output": out.pooler_output.float().contiguous(),
        "sentence_embedding": emb.float().contiguous(),
    }
    save_file(tensors, os.path.join(OUT, "minilm_sst2.safetensors"),
              metadata={"sentences": json.dumps(sentences), "transformers": __import__("transformers").__version__})
    print("minilm_sst2:", {k: list(v.shape) for k, v in tensors.items()})


def tiny_batch():
    # Three sequences padded to 9: [CLS]=1 ... [SEP]=2, pad 0; the second is a pair.
    g = torch.Generator().manual_seed(1)
    B, L = 3, 9
    lengths = [9, 7, 4]
    ids = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, dtype=torch.int64)
    types = torch.zeros(B, L, dtype=torch.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, TINY["vocab_size"], (n,), generator=g)
        ids[b, 0], ids[b, n - 1] = 1, 2
        mask[b, :n] = 1
    types[1, 4:7] = 1
    return ids, mask, types


def tiny_fixture():
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    ids, mask, types = tiny_batch()
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    for kind, cls in (("cls", BertForSequenceClassification), ("mlm", BertForMaskedLM)):
        torch.manual_seed(0)
        cfg = BertConfig(**TINY)
        model = cls(cfg).eval()
        d = os.path.join(OUT, "tiny", kind)
        model.save_pretrained(d, safe_serialization=True)
        with torch.no_grad():
            logits = model(**batch).logits
        batch[f"{kind}_logits"] = logits.float().contiguous()
        names = sorted(load_file(os.path.join(d, "model.safetensors")).keys())
        print(f"tiny/{kind}: {len(names)} tensors; cls.* = {[n for n in names if n.startswith('cls')]}; "
              f"logits {list(logits.shape)}")
    save_file(batch, os.path.join(OUT, "tiny", "batch.safetensors"))


README = """# BERT reference fixtures

Made by `bench/bert_fixtures.py` (run from the repository root):

    /tmp/torch-ref/bin/python bench/bert_fixtures.py

with torch {torch}, transformers {transformers}, sentence-transformers {st}, on CPU in F32,
every model in eval mode (no dropout).

## minilm_sst2.safetensors

The first {n} sentences of `shared/data/sst2/dev.tsv` (also in the file's metadata,
`sentences`), tokenised by `AutoTokenizer.from_pretrained(shared/models/all-MiniLM-L6-v2)`
with `padding=True, truncation=True, max_length={maxlen}`, through
`AutoModel.from_pretrained(...)` (a `BertModel` with its pooler).

| tensor | dtype | shape | what |
|---|---|---|---|
| input_ids | I64 | [{n}, L] | token ids, padded with 0 to the longest sentence |
| attention_mask | I64 | [{n}, L] | 1 for tokens, 0 for padding |
| token_type_ids | I64 | [{n}, L] | all 0 |
| last_hidden_state | F32 | [{nh}, L, 384] | the encoder's output, first {nh} sentences only (size) |
| pooler_output | F32 | [{n}, 384] | `tanh(pooler.dense(h[:, 0]))` |
| sentence_embedding | F32 | [{n}, 384] | mean of `last_hidden_state` over the mask, then L2-normalised; the script checks it against `SentenceTransformer(dir).encode` (cosine > 0.99999) |

## tiny/

A tiny random BERT: {tiny}. `torch.manual_seed(0)` then
`BertForSequenceClassification(config)` (`tiny/cls/`) or `BertForMaskedLM(config)`
(`tiny/mlm/`), each saved by `save_pretrained(dir, safe_serialization=True)` as
`config.json` + `model.safetensors`, so the files carry transformers' own names (the
MLM's decoder weight is tied to the word embeddings; see which names the file holds).

`tiny/batch.safetensors`:

| tensor | dtype | shape | what |
|---|---|---|---|
| input_ids | I64 | [3, 9] | random ids in [3, 101), 1 first and 2 last, 0-padded; lengths 9, 7, 4 |
| attention_mask | I64 | [3, 9] | 1 for tokens, 0 for padding |
| token_type_ids | I64 | [3, 9] | 0, except tokens 4..7 of the second sequence (1) |
| cls_logits | F32 | [3, 3] | `BertForSequenceClassification` logits (eval) |
| mlm_logits | F32 | [3, 9, 101] | `BertForMaskedLM` logits (eval) |

## Tied weights in transformers' files

`BertForMaskedLM`'s decoder is tied (`_tied_weights_keys`: `cls.predictions.decoder.weight`
→ `bert.embeddings.word_embeddings.weight`, `cls.predictions.decoder.bias` →
`cls.predictions.bias`), and `save_pretrained` leaves both tied names out of
`model.safetensors` (`tiny/mlm/model.safetensors` holds 42 tensors, none of them
`cls.predictions.decoder.*`); PyTorch's in-memory `state_dict()` does list them. hemi's
`state_dict` matches the file, and hemi's loader ignores the two names when an older file
holds them. transformers 5 saves no `embeddings.position_ids` buffer; older files (the
MiniLM one) hold it and hemi ignores it.

## Checking hemi-written checkpoints in transformers

    HEMI_BERT_EXPORT=/tmp/x cargo test --release -p hemi --test models save_pretrained
    /tmp/torch-ref/bin/python bench/bert_fixtures.py --check-hemi /tmp/x/cls --kind cls
    /tmp/torch-ref/bin/python bench/bert_fixtures.py --check-hemi /tmp/x/mlm --kind mlm

Each loads with `output_loading_info=True` and fails on any missing, unexpected or
mismatched key, or a value that differs from the file.
"""


def write_readme():
    import sentence_transformers
    import transformers

    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write(README.format(torch=torch.__version__, transformers=transformers.__version__,
                              st=sentence_transformers.__version__, n=N_SENTENCES, nh=N_HIDDEN,
                              maxlen=MAX_LENGTH,
                              tiny=", ".join(f"{k} {v}" for k, v in TINY.items())))


def check_hemi(d, kind):
    """Loads a hemi-written config.json + model.safetensors into transformers and fails
    unless there are no missing, unexpected or mismatched keys."""
    from transformers import BertForMaskedLM, BertForSequenceClassification, BertModel

    cls = {"cls": BertForSequenceClassification, "mlm": BertForMaskedLM, "base": BertModel}[kind]
    model, info = cls.from_pretrained(d, output_loading_info=True)
    print(json.dumps({k: sorted(v) if isinstance(v, (list, set)) else str(v) for k, v in info.items()}))
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"{d}: transformers reports {bad}")
    # The file's values are what the model holds (a tied decoder equals the embeddings).
    sd = load_file(os.path.join(d, "model.safetensors"))
    msd = model.state_dict()
    for name, t in sd.items():
        assert torch.equal(msd[name].to(t.dtype), t), name
    if kind == "mlm":
        # The decoder is tied: the same tensor as the word embeddings.
        assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    print(f"{d}: loads into {cls.__name__} with no missing or unexpected keys; {len(sd)} tensors equal")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check-hemi", metavar="DIR")
    p.add_argument("--kind", default="cls", choices=["cls", "mlm", "base"])
    a = p.parse_args()
    torch.set_num_threads(2)
    if a.check_hemi:
        check_hemi(a.check_hemi, a.kind)
        return
    os.makedirs(os.path.join(OUT, "tiny"), exist_ok=True)
    minilm_fixture()
    tiny_fixture()
    write_readme()


if __name__ == "__main__":
    main()
