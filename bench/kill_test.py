#!/usr/bin/env python3
"""Kills `hemi train` at random moments and checks that no checkpoint is ever mixed or
unloadable and that every resumed run ends bit-identical to an uninterrupted one.

For each precision preset in --presets an uninterrupted reference run is made first. Then
each trial starts the same run in a fresh checkpoint directory and stops it by one of:

    kill      SIGKILL at a uniformly random moment of the run
    tmp       SIGKILL right after a save's temporary directory appears (mid-save)
    int       SIGINT at a random moment (the run must exit 130 with a mid-epoch checkpoint,
              or 0 if it had already finished)
    disk      no signal: the checkpoint directory is a tmpfs too small for all checkpoints,
              so a save fails with ENOSPC (the run must fail with an error naming the file)

and checks, after every stop:
  1. every directory with a final name (epoch-NNNN, epoch-NNNN-batch-NNNNNN) has a manifest
     whose files all match in size and SHA-256 (i.e. is loadable);
  2. every whole-epoch checkpoint is byte-identical to the reference run's checkpoint of that
     epoch (so nothing was mixed);
  3. the run resumed from what is there (`--resume`, or a fresh start when nothing complete
     was saved; after a full disk, from a copy on a normal disk) finishes, and its final
     checkpoint is byte-identical to the reference's.

    cargo build --release -p hemi-cli
    python3 bench/kill_test.py --trials 200                # needs root for the disk trials
    python3 bench/kill_test.py --trials 20 --json out.json

Python 3.11 standard library only.
"""
import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEMI = REPO / "target" / "release" / "hemi"


def run_args(preset, ckdir, epochs):
    return [str(HEMI), "train", "--model", "mlp", "--dataset", "synthetic",
            "--synthetic-size", "768", "--batch-size", "64", "--epochs", str(epochs),
            "--optimizer", "adam", "--lr", "0.001", "--precision", preset,
            "--log-every", "4", "--threads", "1", "--workers", "1",
            "--checkpoint-dir", str(ckdir)]


def sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def final_dirs(ck):
    if not Path(ck).is_dir():
        return []
    return sorted(d for d in os.listdir(ck) if d.startswith("epoch-"))


def verify_manifest(d):
    """None if the checkpoint directory d is complete and intact, else what is wrong."""
    m = Path(d) / "MANIFEST.json"
    if not m.is_file():
        return f"{d}: no MANIFEST.json"
    try:
        files = json.loads(m.read_text())["files"]
    except Exception as e:  # noqa: BLE001 - any parse failure is a finding
        return f"{m}: {e}"
    names = {f["name"] for f in files}
    for need in ("model.safetensors", "optimizer.safetensors", "state.json"):
        if need not in names:
            return f"{m}: does not list {need}"
    for f in files:
        p = Path(d) / f["name"]
        if not p.is_file():
            return f"{p}: missing"
        if p.stat().st_size != f["size"] or sha(p) != f["sha256"]:
            return f"{p}: size or SHA-256 differs from the manifest"
    return None


def fingerprint(d):
    return {f: sha(Path(d) / f) for f in ("model.safetensors", "optimizer.safetensors",
                                          "state.json")}


def check_dir(ck, ref):
    """Problems found in checkpoint root ck against the reference fingerprints ref."""
    problems = []
    for name in final_dirs(ck):
        d = Path(ck) / name
        bad = verify_manifest(d)
        if bad:
            problems.append("unloadable: " + bad)
            continue
        if "-batch-" not in name:
            if name not in ref:
                problems.append(f"unexpected checkpoint {name}")
            elif fingerprint(d) != ref[name]:
                problems.append(f"mixed: {d} differs from the reference's {name}")
    return problems


def resume_and_compare(preset, ck, ref, epochs, last):
    complete = [n for n in final_dirs(ck) if not verify_manifest(Path(ck) / n)]
    if last in complete:
        # The run had finished before the stop reached it: nothing to resume.
        return [] if fingerprint(Path(ck) / last) == ref[last] else [f"{last} differs"]
    args = run_args(preset, ck, epochs) + (["--resume"] if complete else [])
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return [f"resume failed ({r.returncode}): {r.stderr.strip()[-300:]}"]
    problems = check_dir(ck, ref)
    d = Path(ck) / last
    if not d.is_dir() or fingerprint(d) != ref[last]:
        problems.append(f"resumed run's {last} differs from the uninterrupted run's")
    return problems


def mount_tmpfs(path, size_mib):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return r.returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--presets", default="amp-fp16,fp32,amp-bf16,pure-bf16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the per-trial results here")
    a = ap.parse_args()
    if not HEMI.exists():
        sys.exit(f"{HEMI} not found: cargo build --release -p hemi-cli")
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="hemi-kill-"))
    presets = a.presets.split(",")
    last = f"epoch-{a.epochs:04d}"
    refs, durations = {}, {}
    for p in presets:
        ck = work / f"ref-{p}"
        t0 = time.monotonic()
        subprocess.run(run_args(p, ck, a.epochs), check=True, capture_output=True)
        durations[p] = time.monotonic() - t0
        refs[p] = {n: fingerprint(ck / n) for n in final_dirs(ck)}
        print(f"reference {p}: {durations[p]:.1f} s, {sorted(refs[p])}", flush=True)
    # A tmpfs that holds one checkpoint and a half: the second save runs out of space.
    size = (sum(os.path.getsize(work / f"ref-{presets[0]}" / "epoch-0001" / f)
                for f in ("model.safetensors", "optimizer.safetensors")) * 3 // 2) >> 20
    disk_ok = os.geteuid() == 0
    kinds = ["kill"] * 10 + ["tmp"] * 6 + ["int"] * 3 + (["disk"] if disk_ok else [])
    results, counts = [], {}
    for t in range(a.trials):
        kind = kinds[t % len(kinds)]
        preset = presets[t % len(presets)]
        ck = work / f"t{t}"
        mnt = None
        note = ""
        if kind == "disk":
            mnt = work / f"mnt{t}"
            if not mount_tmpfs(mnt, max(size, 1)):
                kind, mnt = "kill", None
            else:
                ck = mnt / "ck"
        args = run_args(preset, ck, a.epochs)
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        if kind in ("kill", "int"):
            time.sleep(rng.uniform(0.0, durations[preset]))
            proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGINT)
        elif kind == "tmp":
            # Wait for the k-th save (k random) to create its temporary directory, then kill
            # within a few milliseconds of it appearing.
            k = rng.randint(1, a.epochs)
            seen = set()
            deadline = time.monotonic() + 3 * durations[preset]
            while proc.poll() is None and time.monotonic() < deadline:
                if ck.is_dir():
                    seen |= {n for n in os.listdir(ck) if n.startswith(".tmp-")}
                if len(seen) >= k:
                    time.sleep(rng.uniform(0.0, 0.02))
                    break
                time.sleep(0.0005)
            note = f"save {k}"
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        code = proc.returncode
        problems = []
        if kind == "int" and code == -signal.SIGINT and not ck.exists():
            note = "SIGINT before the handler was installed (nothing started)"
        elif kind == "int" and code not in (130, 0):
            problems.append(f"SIGINT: exit {code}, expected 130: {err.strip()[-200:]}")
        if kind == "int" and code == 130 and "interrupted" not in err:
            problems.append(f"SIGINT: no message: {err.strip()[-200:]}")
        if kind == "disk":
            if code == 0:
                note = "finished (the disk did not fill)"
            elif "No space left" not in err or not any(
                    f in err for f in ("safetensors", "state.json", "MANIFEST.json")):
                problems.append(f"full disk: unclear error: {err.strip()[-300:]}")
        stopped_with = final_dirs(ck)
        problems += check_dir(ck, refs[preset])
        if kind == "disk":
            # Resume on a normal disk from a copy of what the full one holds.
            copy = work / f"t{t}-copy"
            shutil.copytree(ck, copy, symlinks=True)
            subprocess.run(["umount", str(mnt)], check=False)
            ck = copy
        problems += resume_and_compare(preset, ck, refs[preset], a.epochs, last)
        counts[kind] = counts.get(kind, 0) + 1
        results.append({"trial": t, "kind": kind, "preset": preset, "exit": code,
                        "checkpoints_at_stop": stopped_with, "problems": problems,
                        "note": note})
        status = "ok" if not problems else "FAIL " + "; ".join(problems)
        print(f"[{t + 1:3}/{a.trials}] {kind:4} {preset:9} exit {code:4} "
              f"{len(stopped_with)} ckpt  {status}", flush=True)
        shutil.rmtree(ck, ignore_errors=True)
    failed = [r for r in results if r["problems"]]
    mid_save = sum(1 for r in results if r["kind"] == "tmp")
    print(f"\n{len(results)} trials ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}; "
          f"{mid_save} killed mid-save): {len(failed)} with problems "
          f"(mixed or unloadable checkpoints, or a resume that differs)")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "counts": counts}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
