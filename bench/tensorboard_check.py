#!/usr/bin/env python3
"""TensorBoard's own code against hemi's event files, both ways.

  python3 bench/tensorboard_check.py fixture OUT.tfevents
      writes a small event file with TensorBoard's Python writer (scalars and a histogram
      with known values); crates/hemi/tests/io/tensorboard.rs reads the committed copy
      (crates/hemi/tests/fixtures/tensorboard/python.tfevents) and checks every value.

  python3 bench/tensorboard_check.py check LOGDIR [--metrics FILE]
      loads a directory that `hemi train --tensorboard LOGDIR` wrote with TensorBoard's
      EventAccumulator (what the TensorBoard UI reads) and checks the scalar tags, their
      steps, the histograms, and (with --metrics, the run's JSON lines) that the logged
      epoch values equal the metrics file's. Exits non-zero on any mismatch.

Needs `pip install tensorboard` (2.21 was used).
"""
import argparse
import json
import math
import sys


def fixture(out):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    def event(step, **kw):
        return event_pb2.Event(wall_time=1700000000.5 + step, step=step, **kw)

    with open(out, "wb") as f:
        w = RecordWriter(f)
        w.write(event(0, file_version="brain.Event:2").SerializeToString())
        for step, v in [(1, 2.5), (2, -0.125), (10, 1e-8)]:
            s = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="train/loss", simple_value=v)])
            w.write(event(step, summary=s).SerializeToString())
        h = summary_pb2.HistogramProto(min=-1.0, max=3.0, num=6, sum=4.5, sum_squares=12.25,
                                       bucket_limit=[0.0, 1.0, 3.0], bucket=[2, 1, 3])
        s = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="params/w", histo=h)])
        w.write(event(7, summary=s).SerializeToString())
        w.flush()
    print(f"wrote {out}")


def check(logdir, metrics):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    tags = acc.Tags()
    bad = []
    want = ["train/loss", "train/lr", "epoch/test_accuracy", "epoch/train_loss", "epoch/test_loss"]
    for t in want:
        if t not in tags["scalars"]:
            bad.append(f"scalar tag {t} missing")
    print(f"scalars: {sorted(tags['scalars'])}")
    print(f"histograms: {len(tags['histograms'])} tags")
    if "train/loss" in tags["scalars"]:
        steps = [e.step for e in acc.Scalars("train/lr")]
        if steps != list(range(1, len(steps) + 1)):
            bad.append("train/lr steps are not 1, 2, 3, ...")
        print(f"train/lr: {len(steps)} steps")
    for t in tags["histograms"]:
        for e in acc.Histograms(t):
            h = e.histogram_value
            if sum(h.bucket) != h.num or not (h.min <= h.max):
                bad.append(f"histogram {t} at step {e.step}: buckets sum {sum(h.bucket)} != num {h.num}")
    if metrics:
        epochs = [json.loads(l) for l in open(metrics) if '"kind":"epoch"' in l.replace(" ", "")]
        acc_tb = acc.Scalars("epoch/test_accuracy")
        if len(acc_tb) != len(epochs):
            bad.append(f"{len(acc_tb)} epoch points in TensorBoard, {len(epochs)} in the metrics file")
        for e, m in zip(acc_tb, epochs):
            # TensorBoard stores F32: compare at F32 precision.
            if not math.isclose(e.value, m["test_accuracy"], rel_tol=2**-23, abs_tol=1e-12):
                bad.append(f"epoch {m['epoch']}: test accuracy {e.value} in TensorBoard, {m['test_accuracy']} in metrics")
        print(f"epochs: {len(epochs)} in metrics, test accuracy {[round(e.value, 4) for e in acc_tb]}")
    for b in bad:
        print("MISMATCH:", b)
    print("OK" if not bad else f"{len(bad)} mismatches")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("out")
    c = sub.add_parser("check")
    c.add_argument("logdir")
    c.add_argument("--metrics")
    a = ap.parse_args()
    if a.cmd == "fixture":
        fixture(a.out)
        return 0
    return check(a.logdir, a.metrics)


if __name__ == "__main__":
    sys.exit(main())
