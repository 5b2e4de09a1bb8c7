"""Writes crates/hemi/tests/fixtures/text/tokens.json: what Hugging Face's tokenizer
(transformers.AutoTokenizer, the fast Rust tokenizer behind it) makes of SST-2 dev
sentences and tricky strings, for tests/io/text_data.rs to compare hemi::data::Tokenizer with.

    /tmp/torch-ref/bin/pip install transformers tokenizers
    /tmp/torch-ref/bin/python bench/tokenizer_fixtures.py [--shared /work/shared]

Each case: text (and pair, for sentence pairs), max_length, and the input_ids,
attention_mask and token_type_ids of tokenizer(text[, pair], truncation=True,
max_length=max_length).
"""

import argparse
import csv
import json
import os

import tokenizers
import transformers
from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "crates", "hemi", "tests", "fixtures", "text", "tokens.json")
MAX_LENGTH = 64

LONG = " ".join(
    "the quick brown fox jumps over the lazy dog while unbelievably "
    "uncharacteristic tokenisation happens".split()
    * 8
)

TRICKY = [
    "Café crème brûlée, naïve façade — résumé!",
    "ÀÉÎÕÜ Ångström Øresund straße",
    "我爱北京天安门 and 東京 too",
    "What?!?!... Really??? (yes) -- [no] {maybe} ***",
    "",
    "   \t  ",
    "emoji 😀 and tab\tand\nnewline",
    "[MASK] is special but [mask] and [UNK] texts?",
    "don't can't won't it's y'all",
    "numbers 3.14159 1,000,000 and 2026-12-01",
    LONG,
]

PAIRS = [
    ("A man is playing a guitar.", "Someone plays an instrument."),
    (LONG, "a short second sentence that gets truncated less"),
    ("short first", LONG + " " + LONG),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default="/work/shared")
    args = ap.parse_args()
    model = os.path.join(args.shared, "models", "all-MiniLM-L6-v2")
    tok = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(args.shared, "data", "sst2", "dev.tsv"), newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert rows[0] == ["sentence", "label"], rows[0]
    sentences = [r[0] for r in rows[1:41]]

    cases = []

    def add(text, pair=None, max_length=MAX_LENGTH):
        enc = tok(text, pair, truncation=True, max_length=max_length)
        case = {"text": text, "max_length": max_length}
        if pair is not None:
            case["pair"] = pair
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            case[k] = list(enc[k])
        case["special_tokens_mask"] = tok.get_special_tokens_mask(
            enc["input_ids"], already_has_special_tokens=True
        )
        cases.append(case)

    for s in sentences + TRICKY:
        add(s)
    for a, b in PAIRS:
        add(a, b)
    add(LONG, max_length=8)
    add(PAIRS[0][0], PAIRS[0][1], max_length=9)

    out = {
        "tokenizer": "all-MiniLM-L6-v2",
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        # One case per line: small, and a diff shows which case changed.
        head = {k: v for k, v in out.items() if k != "cases"}
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    print(f"wrote {len(cases)} cases to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
