#!/usr/bin/env python3
"""Python CUDA paged I/O against the Rust library, same process, same data:
decode of a Llama-3-8B layer (8 KV heads, head_dim 128, 32768 tokens, bf16)
into a vLLM FlashAttention paged cache (block size 16, shuffled block ids)
with ``kvpack.cuda.decode_paged``, and ``kvpack.cuda.encode_paged`` out of
it, each against the library's own ``Gpu::decode_paged`` /
``Gpu::encode_paged`` timed in Rust (``_native.cuda_bench_*``: no Python
in the loop). Both are the whole call (open + CPU staging + upload +
kernels + wait; gather + encode + download + file).

    python tools/bench_cuda.py [--runs 9] [--codecs raw,int4,...]

Needs torch with CUDA and a kvpack build with the ``cuda`` feature. Prints
microseconds and GB/s of bf16 (cache rows written or read) per path and the
Python/Rust throughput ratio; exits 1 when a ratio is below 0.90 (for
encode, the ``out=`` path that writes into a caller buffer; returning
a numpy array that owns the file is printed too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kvpack
import kvpack.cuda
from kvpack import _native

DECODE = "raw,int4,bdr128,hqmq:s96r4,polar:m4n4,kivi:2,innerq:k2v2,turbo:b3,octopus:b3"
ENCODE = "int4,bdr128,hqmq:s96r4"
HEADS, DIM, TOKENS, BLOCK = 8, 128, 32768, 16


def interleaved_us(rust_once, py_once, runs):
    """Medians (us) of the Rust and the Python call, alternating one of each
    per round so that both see the same machine state (host staging and
    PCIe dominate the whole call and drift over a run)."""
    rust_once()
    py_once()
    rust, py = [], []
    for _ in range(runs):
        rust.extend(rust_once())
        t = time.perf_counter()
        py_once()
        py.append(time.perf_counter() - t)
    return statistics.median(rust) * 1e6, statistics.median(py) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--decode", default=DECODE)
    ap.add_argument("--encode", default=ENCODE)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kvpack.cuda.available()):
        print("needs a CUDA GPU and a kvpack build with the cuda feature", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    k = torch.randn(1, HEADS, TOKENS, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(1, HEADS, TOKENS, DIM, generator=g).to(torch.bfloat16)
    nb = TOKENS // BLOCK + 64
    ids = torch.randperm(nb, generator=g)[: TOKENS // BLOCK].tolist()
    ids_t = torch.tensor(ids, dtype=torch.int64)  # a block table as engines hold it
    cache = torch.zeros(2, nb, BLOCK, HEADS, DIM, dtype=torch.bfloat16, device=dev)
    # The layer's rows at the block table's slots (for encode).
    t = torch.arange(TOKENS, device=dev)
    blk, row = torch.tensor(ids, device=dev)[t // BLOCK], t % BLOCK
    cache[0][blk, row] = k[0].to(dev).permute(1, 0, 2)
    cache[1][blk, row] = v[0].to(dev).permute(1, 0, 2)
    stream = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    rows_bytes = 2 * HEADS * TOKENS * DIM * 2
    gbs = lambda us: rows_bytes / us / 1e3  # noqa: E731
    print(f"GPU: {torch.cuda.get_device_name()}; layer K+V 2x[{HEADS},{TOKENS},{DIM}] bf16, bs {BLOCK}, flash_attn")
    print("| codec | op | Rust call (us) | Rust GB/s | Python call (us) | Python GB/s | Python/Rust |")
    print("|---|---|---|---|---|---|---|")
    worst = 1e9
    out = torch.empty_like(cache)
    for codec in filter(None, args.decode.split(",")):
        data = kvpack.compress([(k, v)], codec).data
        rust, py = interleaved_us(
            lambda: _native.cuda_bench_decode_paged(data, [out], ids, layer=0, layout="flash_attn", stream=stream, runs=1),
            lambda: kvpack.cuda.decode_paged(data, out, ids_t, layer=0),
            args.runs,
        )
        r = rust / py
        worst = min(worst, r)
        print(f"| {codec} | decode_paged | {rust:.0f} | {gbs(rust):.1f} | {py:.0f} | {gbs(py):.1f} | {100 * r:.0f}% |")
    for codec in filter(None, args.encode.split(",")):
        same = bytes(kvpack.cuda.encode_paged(cache, ids, TOKENS, codec)) == kvpack.compress([(k, v)], codec).data
        rust_once = lambda: _native.cuda_bench_encode_paged(  # noqa: E731
            [cache], ids, TOKENS, codec, layout="flash_attn", stream=stream, runs=1
        )
        rust, py = interleaved_us(rust_once, lambda: kvpack.cuda.encode_paged(cache, ids_t, TOKENS, codec), args.runs)
        r = rust / py
        print(
            f"| {codec} | encode_paged -> array | {rust:.0f} | {gbs(rust):.1f} | {py:.0f} | {gbs(py):.1f} | {100 * r:.0f}% |"
            + ("" if same else " (FILE DIFFERS FROM kvpack.compress)")
        )
        # Into a caller buffer: no copy into a bytes object.
        buf = torch.empty(rows_bytes + (1 << 20), dtype=torch.uint8).pin_memory()
        rust, py = interleaved_us(
            rust_once, lambda: kvpack.cuda.encode_paged(cache, ids_t, TOKENS, codec, out=buf), args.runs
        )
        r = rust / py
        worst = min(worst, r)
        print(f"| {codec} | encode_paged out= | {rust:.0f} | {gbs(rust):.1f} | {py:.0f} | {gbs(py):.1f} | {100 * r:.0f}% |")
    print(f"worst Python/Rust ratio: {100 * worst:.0f}% (target >= 90%)")
    return 0 if worst >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
