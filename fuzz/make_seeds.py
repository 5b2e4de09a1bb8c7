#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into fuzz/seeds/<target>/: small valid files
of each format, generated here (no data set is copied).
Run from fuzz/: python3 make_seeds.py"""
import gzip, json, os, struct

def put(target, name, data):
    d = os.path.join("seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)

# CIFAR-10: one and two records (label byte, 1024 R, 1024 G, 1024 B).
rec = lambda label, v: bytes([label]) + bytes((v + i) % 256 for i in range(3072))
put("cifar10", "one", rec(3, 0))
put("cifar10", "two", rec(0, 7) + rec(9, 200))

# IDX: 2 images of 3x4, 2 labels, and an empty (count 0) image file.
imgs = struct.pack(">IIII", 0x803, 2, 3, 4) + bytes(range(24))
labs = struct.pack(">II", 0x801, 2) + bytes([1, 9])
empty = struct.pack(">IIII", 0x803, 0, 28, 28)
for name, b in [("images", imgs), ("labels", labs), ("empty", empty)]:
    put("idx_raw", name, b)
    put("idx_gz", name + ".gz", gzip.compress(b, mtime=0))
put("idx_gz", "two_members.gz", gzip.compress(labs[:5], mtime=0) + gzip.compress(labs[5:], mtime=0))

# Images (seeds/image/) are written by make_image_seeds.rs with the image crate.

# safetensors: an 8-byte header length, the JSON header, the data.
def st(tensors, meta=None):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data
put("safetensors", "f32", st([("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))]))
put("safetensors", "mixed", st([
    ("a.weight", "F16", [3], b"\x00\x3c" * 3),
    ("a.bias", "BF16", [1, 1], b"\x80\x3f"),
    ("step", "I64", [], struct.pack("<q", 7)),
    ("x", "F64", [0, 4], b""),
], {"format": "pt"}))
put("safetensors", "u8", st([("m", "U8", [2], b"\x01\x02")]))
