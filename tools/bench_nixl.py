#!/usr/bin/env python3
"""Prefill-to-decode handoff over NIXL (``kvpack.nixl``): time until the
last layer of a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads,
head_dim 128, 32768 tokens, bf16: 4 GiB) is decoded into the decode side's
paged cache, per codec and link rate, two processes (prefill = this one,
decode = a spawned child), NIXL with UCX.

    # GPU to GPU on one device (paged caches in GPU memory, 4 GiB each side)
    python tools/bench_nixl.py --device cuda --wire VRAM --json out.json
    # host DRAM to host DRAM, fewer tokens (this host has 2 cores)
    python tools/bench_nixl.py --device cpu --tokens 4096 --rates 10,0

Per run: the prefill side encodes each layer as soon as the previous one is
handed to NIXL (``Outgoing.send_layer``: ``kvpack.cuda.encode_paged`` on
the GPU, ``kvpack.paged.encode_paged`` on the host) and posts its write; the decode side
waits for each layer and decodes it (``Incoming.decode_layer``). Nothing
else runs between layers, so this is the pipeline of an engine whose
prefill has already finished (the handoff tail).

Link pacing: a link of R bit/s delivers a layer of n bytes n*8/R seconds
after the link is free and the layer is encoded. The prefill side posts
each layer's NIXL write at that moment, ``due = max(link_free, encoded) +
n*8/R``, ``link_free = due`` (``Sender.accept(link_gbit=R)``); the real
transfer (loopback / NVLink / PCIe here) then adds its own, small, time.
Rate 0 means unpaced: post as soon as encoded.

Columns (with ``--repeats N``, the run with the median total; all totals
are in the JSON): ``total`` first encode start (prefill) to last decode end (decode
side), both ``time.perf_counter()`` (the system-wide monotonic clock);
``x raw`` total over raw's at the same rate; ``first`` layer 0's decode end
minus its encode start; ``encode`` and ``decode`` GB/s of bf16 cache (source
bytes over the summed per-layer call times); ``wire`` Gbit/s of frame bytes
over the summed per-layer times from post to NIXL's completion (the actual
transfer, pacing excluded); ``bytes`` frame bytes over source bytes.
Data: Gaussian K with per-channel scales (a few large channels, like RoPE'd
keys) and Gaussian V, fixed seed; every codec measured here is fixed-rate,
so sizes and speeds do not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
from typing import Any, Dict, List

import numpy as np

CODECS = "raw,int4,bdr128,turbo:b4,polar:m4n4,hqmq:s96r4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alloc(args, layer_seed: int, fill: bool) -> Any:
    """One layer's flash_attn paged cache ``[2, num_blocks, block, heads,
    dim]`` (bf16: torch on CUDA, uint16 bit patterns on the host)."""
    nb = args.num_blocks
    shape = (2, nb, args.block_size, args.kv_heads, args.head_dim)
    if args.device == "cuda":
        import torch

        if not fill:
            return torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(layer_seed)
        c = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
        scale = 1 + 4 * (torch.rand(args.head_dim, generator=g, device="cuda") > 0.95)
        c[0] *= scale
        return c.to(torch.bfloat16)
    if not fill:
        return np.zeros(shape, np.uint16)
    rng = np.random.default_rng(layer_seed)
    c = rng.standard_normal(shape, dtype=np.float32)
    c[0] *= 1 + 4 * (rng.random(args.head_dim) > 0.95)
    return (c.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation


def _block_ids(args, seed: int) -> List[int]:
    n = -(-args.tokens // args.block_size)
    if not args.scatter:
        return list(range(n))
    return [int(b) for b in np.random.default_rng(seed).permutation(args.num_blocks)[:n]]


def _decode_side(args, port: int, peer_port: int, jobs, results) -> None:
    """Child: the decode worker. For each job (spec), receive and decode
    every layer, report the per-layer stats."""
    from kvpack import nixl as kn

    try:
        caches = [_alloc(args, 0, False) for _ in range(args.layers)]
        blocks = _block_ids(args, 2)
        rx = kn.Receiver("bench-decode", port=port, progress_thread=args.progress_thread)
        rx.connect("bench-prefill", "127.0.0.1", peer_port)
        results.put("ready")
        while True:
            job = jobs.get()
            if job is None:
                return
            spec = kn.HandoffSpec.from_json(job)
            inc = rx.expect(spec, blocks, peer="bench-prefill", memory=args.wire)
            stats = [vars(inc.decode_layer(layer, caches[layer])) for layer in range(args.layers)]
            if args.device == "cuda":
                import torch

                torch.cuda.synchronize()
            inc.close()
            results.put(stats)
    except BaseException as e:  # reported to the parent
        results.put(f"decode side failed: {e!r}")


def _run(args, tx, jobs, results, caches, blocks, codec: str, rate: float) -> Dict[str, Any]:
    from kvpack import nixl as kn

    spec = kn.HandoffSpec(
        model="llama-3-8b-shaped", codec=codec, num_layers=args.layers, kv_heads=args.kv_heads,
        head_dim=args.head_dim, num_tokens=args.tokens, block_size=args.block_size, dtype="bf16",
    )
    jobs.put(spec.to_json())
    out = tx.accept(timeout=120, memory=args.wire, link_gbit=rate or None)
    for layer in range(args.layers):
        out.send_layer(layer, caches[layer], blocks)
    tx_stats = out.finish(timeout=600)
    rx_stats = results.get(timeout=600)
    if isinstance(rx_stats, str):
        raise RuntimeError(rx_stats)
    out.close()
    src = 2 * args.kv_heads * args.tokens * args.head_dim * 2  # bytes per layer
    frames = sum(s.frame_bytes for s in tx_stats.values())
    enc = sum(s.encode_end - s.encode_start for s in tx_stats.values())
    wire = sum(s.done - s.posted for s in tx_stats.values())
    dec = sum(s["decode_end"] - s["decode_start"] for s in rx_stats)
    t0 = min(s.encode_start for s in tx_stats.values())
    ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
    tx0, rx0 = tx_stats[0], rx_stats[0]
    ends = sorted(s["decode_end"] for s in rx_stats)
    gaps = sorted(b - a for a, b in zip(ends, ends[1:]))
    return {
        "codec": codec,
        "rate_gbit": rate,
        "total_ms": (max(s["decode_end"] for s in rx_stats) - t0) * 1e3,
        "first_layer_ms": (rx_stats[0]["decode_end"] - tx_stats[0].encode_start) * 1e3,
        "encode_gbps": src * args.layers / enc / 1e9,
        "wire_gbit": frames * 8 / wire / 1e9 if wire > 0 else float("inf"),
        "decode_gbps": src * args.layers / dec / 1e9,
        "frame_bytes": frames,
        "source_bytes": src * args.layers,
        "bytes_ratio": frames / (src * args.layers),
        # layer 0's path, ms: encode call, queued until posted (pacing and
        # thread hand-off), posted until the decode side saw the
        # notification, seen until decode_layer started, the decode call
        "first_stages_ms": {
            "encode": ms(tx0.encode_start, tx0.encode_end),
            "to_post": ms(tx0.encode_end, tx0.posted),
            "post_to_seen": ms(tx0.posted, rx0["landed"]),
            "seen_to_decode": ms(rx0["landed"], rx0["decode_start"]),
            "decode": ms(rx0["decode_start"], rx0["decode_end"]),
        },
        # median time between consecutive layers' decode ends (the pipeline's
        # steady-state period per layer)
        "layer_period_ms": round(gaps[len(gaps) // 2] * 1e3, 3) if gaps else 0.0,
        # per layer, ms after the first encode start: prefill side encode
        # start/end, write posted/completed; decode side notification seen,
        # decode start/end (the JSON's timeline of the run)
        "timeline_ms": [
            {
                "layer": i,
                "encode_start": ms(t0, tx_stats[i].encode_start),
                "encode_end": ms(t0, tx_stats[i].encode_end),
                "posted": ms(t0, tx_stats[i].posted),
                "done": ms(t0, tx_stats[i].done),
                "seen": ms(t0, rx_stats[i]["landed"]),
                "decode_start": ms(t0, rx_stats[i]["decode_start"]),
                "decode_end": ms(t0, rx_stats[i]["decode_end"]),
            }
            for i in range(args.layers)
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="where the paged caches live")
    ap.add_argument("--wire", choices=("DRAM", "VRAM"), default=None, help="NIXL buffers (default: VRAM for cuda, DRAM for cpu)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--scatter", action=argparse.BooleanOptionalAction, default=None,
                    help="shuffled block tables (default: on for cuda, off for cpu)")
    ap.add_argument("--codecs", default=CODECS)
    ap.add_argument("--rates", default="25,100,400,0", help="link rates in Gbit/s, 0 = unpaced")
    ap.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=False,
                    help="NIXL's own progress thread in both agents (default off, as in kvpack.nixl)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per codec and rate; the median run (by total) is reported")
    ap.add_argument("--threads", type=int, default=None,
                    help="codec threads per side (RAYON_NUM_THREADS; default: all cores)")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args()
    args.wire = args.wire or ("VRAM" if args.device == "cuda" else "DRAM")
    args.scatter = args.device == "cuda" if args.scatter is None else args.scatter
    args.num_blocks = -(-args.tokens // args.block_size) + (64 if args.scatter else 0)
    if args.threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before the first codec call; the child inherits it

    from kvpack import nixl as kn

    if not kn.available():
        print("NIXL is not installed (pip install nixl)", file=sys.stderr)
        return 2
    codecs = [c for c in args.codecs.split(",") if c]
    rates = [float(r) for r in args.rates.split(",") if r]
    if "raw" not in codecs:
        codecs.insert(0, "raw")

    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    port, peer_port = _free_port(), _free_port()
    tx = kn.Sender("bench-prefill", port=peer_port, progress_thread=args.progress_thread)
    child = ctx.Process(target=_decode_side, args=(args, port, peer_port, jobs, results))
    child.start()
    try:
        ready = results.get(timeout=300)
        if ready != "ready":
            raise RuntimeError(ready)
        caches = [_alloc(args, 1000 + layer, True) for layer in range(args.layers)]
        blocks = _block_ids(args, 1)
        if args.device == "cuda":
            blocks = np.asarray(blocks, dtype=np.int32)  # read by encode_paged through DLPack
        # Warm-up, untimed: connections, registrations, and each codec's
        # first use (the GPU kernels are compiled by NVRTC then, once per
        # process: seconds that an engine pays at start-up, not per request).
        for codec in codecs:
            _run(args, tx, jobs, results, caches, blocks, codec, 0)
        rows = []
        for rate in rates:
            for codec in codecs:
                runs = sorted((_run(args, tx, jobs, results, caches, blocks, codec, rate) for _ in range(args.repeats)),
                              key=lambda r: r["total_ms"])
                rows.append(dict(runs[len(runs) // 2], runs_total_ms=[r["total_ms"] for r in runs]))
                print(f"  {codec:>12} @ {rate or 'unpaced'}: {rows[-1]['total_ms']:.1f} ms", file=sys.stderr, flush=True)
        jobs.put(None)
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()

    raw = {r["rate_gbit"]: r["total_ms"] for r in rows if r["codec"] == "raw"}
    for r in rows:
        r["x_raw"] = r["total_ms"] / raw[r["rate_gbit"]]
    src_mib = rows[0]["source_bytes"] / 2**20
    print(f"{args.layers} layers x {args.kv_heads} kv heads x {args.tokens} tokens x {args.head_dim} bf16 "
          f"({src_mib:.0f} MiB), device {args.device}, NIXL buffers {args.wire}, "
          f"block tables {'shuffled' if args.scatter else 'contiguous'}, "
          f"codec threads per side {args.threads or os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'codec':>12} {'link':>8} {'total ms':>9} {'x raw':>6} {'first ms':>9} "
          f"{'enc GB/s':>9} {'wire Gb/s':>10} {'dec GB/s':>9} {'bytes':>6}")
    for r in rows:
        link = f"{r['rate_gbit']:g}G" if r["rate_gbit"] else "unpaced"
        print(f"{r['codec']:>12} {link:>8} {r['total_ms']:9.1f} {r['x_raw']:6.3f} {r['first_layer_ms']:9.2f} "
              f"{r['encode_gbps']:9.2f} {r['wire_gbit']:10.1f} {r['decode_gbps']:9.2f} {r['bytes_ratio']:6.3f}")
    print("first layer, ms: encode | to post | post to seen | seen to decode | decode; layer period ms")
    for r in rows:
        link = f"{r['rate_gbit']:g}G" if r["rate_gbit"] else "unpaced"
        f = r["first_stages_ms"]
        print(f"{r['codec']:>12} {link:>8} {f['encode']:.3f} | {f['to_post']:.3f} | {f['post_to_seen']:.3f} | "
              f"{f['seen_to_decode']:.3f} | {f['decode']:.3f}; {r['layer_period_ms']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "loadavg": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
