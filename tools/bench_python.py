#!/usr/bin/env python3
"""Zero-copy check: Python decode of a kvpack file into preallocated numpy
arrays and CPU torch tensors against the Rust library decoding the same
file into preallocated Rust buffers, in the same process and run.

    python tools/bench_python.py [--codec bdr128] [--runs 200] [--threads N]

Prints GB/s of decoded bf16 output (source bytes / median time) for each
path and the Python/Rust ratio. Uses the committed Gemma-3-270M fixture.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import struct
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fixture_kv():
    raw = (ROOT / "fixtures" / "gemma3-270m-gpl3-520.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        p = name.split(".")
        if p[0] == "past_key_values":
            a, b = t["data_offsets"]
            out[(int(p[1]), "K" if p[2] == "key" else "V")] = np.frombuffer(
                raw[8 + n + a : 8 + n + b], dtype=np.uint16
            ).reshape(t["shape"])
    return out


def median_time(f, runs):
    f()  # warm-up (page faults, pools)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", default="bdr128")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import kvpack
    from kvpack import _native

    kv = fixture_kv()
    data = kvpack.compress(kv, args.codec, dtype="bf16").data
    ar = kvpack.open(data)
    out_bytes = sum(a.nbytes for a in kv.values())
    _native.bench_decode_into(data, 3)
    rust = statistics.median(_native.bench_decode_into(data, args.runs))

    outs_np = {k: np.empty(a.shape, np.uint16) for k, a in kv.items()}
    t_np = median_time(lambda: ar.decode_into(outs_np, dtype="bf16"), args.runs)
    rows = [("rust (library, preallocated)", rust), ("python numpy decode_into", t_np)]
    try:
        import torch

        outs_t = {k: torch.empty(a.shape, dtype=torch.bfloat16) for k, a in kv.items()}
        rows.append(("python torch decode_into", median_time(lambda: ar.decode_into(outs_t), args.runs)))
        rows.append(("python torch decode (owned)", median_time(lambda: ar.decode(output="torch"), args.runs)))
    except ImportError:
        print("torch not installed: torch rows skipped", file=sys.stderr)
    rows.append(("python numpy decode (owned)", median_time(lambda: ar.decode(output="numpy"), args.runs)))
    res = [
        {"path": name, "seconds": t, "gb_per_s": out_bytes / t / 1e9, "vs_rust": rust / t}
        for name, t in rows
    ]
    if args.json:
        print(json.dumps({"codec": args.codec, "bytes": out_bytes, "threads": os.cpu_count(), "rows": res}, indent=1))
        return
    print(f"codec {args.codec}, {out_bytes / 1e6:.2f} MB of bf16 output, median of {args.runs} runs")
    for r in res:
        print(f"  {r['path']:32s} {r['seconds'] * 1e3:8.3f} ms  {r['gb_per_s']:6.2f} GB/s  {100 * r['vs_rust']:5.1f}% of rust")


if __name__ == "__main__":
    main()
