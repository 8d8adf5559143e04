#!/usr/bin/env python3
"""Key offset and partial-gain study (issue 15): what centring the keys per channel, and dividing
them by a power of their channel range, does to a plain codec's quality, before such a treatment
is built into a codec.

For the keys of one exported protocol cache (DIR/cache.safetensors from `plan_study.py export`,
tensors [batch, kv_heads, tokens, head_dim], bf16), per kv head and channel c, over tokens 1..
(token 0, the attention sink, is kept raw by `--sink 1`):
  m_c = mean of k_c (with --center, else 0), rounded to fp16 as a codec would store it
  s_c = max |k_c - m_c|;  g_c = s_c^alpha / geometric mean over c of s^alpha (fp16)
  k' = (k - m) / g  ->  kvpack compress --codec C --sink 1 --recent 0, kvpack decompress (fp32)
  ->  k^ = k'^ * g + m  (values as decoded, untouched)
With --page P the statistics are taken per chunk of P tokens instead of per tensor. The plain codec
(alpha 0) and its `+chan` variant are compressed from the source itself, for comparison.

The side rows (m and g) are NOT in the files' bits/element: a codec storing one fp16 row of each per
256-token page adds 0.0625 bits/element per row. Reconstructions go to OUT/rec/NAME.safetensors;
the NAME=FILE lines (OUT/variants[_TAG].txt) are what `plan_study.py eval DIR --model M --text T`
takes to score them (perplexity and KL against the bf16 cache). --seeds/--jit add runs whose gains
are multiplied by exp(jit * N(0, 1)), to see the spread of nearby treatments.

usage: key_offset_study.py DIR OUT [--center] [--alphas 0.5,1] [--codecs hqmq:s24r3,hqmq:s48r4]
                               [--page 256] [--seeds 1,2,3] [--jit 0.05] [--no-base] [--tag T]
"""
import argparse
import json
import os
import subprocess
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import save_file

KVPACK = os.environ.get("KVPACK_BIN", str(Path(__file__).resolve().parent.parent / "target/release/kvpack"))


def load(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def gains(k, alpha, jit=0.0, gen=None):
    s = k[:, :, 1:, :].float().abs().amax(dim=2)  # [b, h, c]
    s = torch.where(s > 0, s, torch.ones_like(s))
    la = alpha * s.log()
    if jit:  # a nearby realization: every gain times exp(jit * N(0, 1))
        la = la + jit * torch.randn(la.shape, generator=gen)
    la = la - la.mean(dim=-1, keepdim=True)  # divide by the geometric mean over channels
    return la.exp()  # [b, h, c]


def sh(cmd):
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return r.stdout


def compress(src, codec, out):
    j = json.loads(sh([KVPACK, "compress", str(src), "--codec", codec, "--sink", "1", "--recent", "0",
                       "-o", str(out), "--force", "--json", "--threads", "1", "-q"]))
    return j["bits_per_element"]


def decompress(kv, out):
    sh([KVPACK, "decompress", str(kv), "--dtype", "fp32", "-o", str(out), "--force", "-q", "--threads", "1"])
    return load(out)[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--alphas", default="0.25,0.5,0.75,1")
    p.add_argument("--codecs", default="hqmq:s24r3,hqmq:s48r4")
    p.add_argument("--seeds", default="", help="comma list: one jittered realization per seed and alpha")
    p.add_argument("--jit", type=float, default=0.05, help="log-std of the gain jitter")
    p.add_argument("--center", action="store_true",
                   help="also subtract each key channel's mean over tokens 1.. (per kv head) before the gains; added back after decode")
    p.add_argument("--page", type=int, default=0, help="means/gains per chunk of this many tokens (from token 1); 0: one per tensor")
    p.add_argument("--no-base", action="store_true", help="skip the plain and +chan files")
    p.add_argument("--tag", default="", help="write variants_TAG.txt instead of variants.txt")
    a = p.parse_args()
    alphas = [float(x) for x in a.alphas.split(",")]
    codecs = a.codecs.split(",")
    rec = a.out / "rec"
    tmp = a.out / "tmp"
    rec.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    src, meta = load(a.src / "cache.safetensors")
    bitsf = a.out / "bits.json"
    bits = json.loads(bitsf.read_text()) if bitsf.exists() else {}
    variants = []
    for codec in codecs:
        tag = codec.replace(":", "_")
        # plain and +chan from the source cache
        for name, c in (() if a.no_base else ((f"{tag}_a0", codec), (f"{tag}_chan", codec + "+chan"))):
            kv = tmp / f"{name}.kvpack"
            bits[name] = compress(a.src / "cache.safetensors", c, kv)
            d = decompress(kv, tmp / "dec.safetensors")
            save_file(d, str(rec / f"{name}.safetensors"))
            variants.append(f"{name}={rec / f'{name}.safetensors'}")
        runs = [(alpha, None) for alpha in alphas] if not a.seeds else \
            [(alpha, int(sd)) for alpha in alphas for sd in a.seeds.split(",")]
        for alpha, seed in runs:
            name = f"{tag}_{'c_' if a.center else ''}{f'p{a.page}_' if a.page else ''}a{alpha:g}" + (f"_j{seed}" if seed is not None else "")
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            mu, g = {}, {}
            for kn, t in src.items():
                if not kn.endswith(".key"):
                    continue
                T = t.shape[2]
                m_full = torch.zeros(t.shape, dtype=torch.float32)
                g_full = torch.ones(t.shape, dtype=torch.float32)
                step = a.page if a.page else T
                for lo in range(1, T, step):  # token 0 (sink) excluded; stored raw
                    hi = min(T, lo + step)
                    x = t[:, :, lo:hi, :].float()
                    m = x.mean(dim=2) if a.center else torch.zeros(x.shape[0], x.shape[1], x.shape[3])
                    m = m.half().float()  # stored as fp16 by a real codec
                    # gains of the centred chunk (the sink is outside every chunk)
                    gg = gains(torch.cat([torch.zeros_like(x[:, :, :1]), x - m[:, :, None, :]], 2), alpha,
                               a.jit if seed is not None else 0.0, gen).half().float()
                    m_full[:, :, lo:hi, :] = m[:, :, None, :]
                    g_full[:, :, lo:hi, :] = gg[:, :, None, :]
                mu[kn], g[kn] = m_full, g_full
            scaled = {}
            for kn, t in src.items():
                if kn in g:
                    scaled[kn] = ((t.float() - mu[kn]) / g[kn]).to(torch.bfloat16).contiguous()
                else:
                    scaled[kn] = t.contiguous()
            sp = tmp / "scaled.safetensors"
            save_file(scaled, str(sp), metadata=meta)
            kv = tmp / f"{name}.kvpack"
            bits[name] = compress(sp, codec, kv)
            d = decompress(kv, tmp / "dec.safetensors")
            out = {}
            for kn, t in d.items():
                if kn in g:
                    x = t.float() * g[kn] + mu[kn]
                    x[:, :, 0, :] = src[kn][:, :, 0, :].float()
                    out[kn] = x.contiguous()
                else:
                    out[kn] = t.contiguous()
            save_file(out, str(rec / f"{name}.safetensors"))
            variants.append(f"{name}={rec / f'{name}.safetensors'}")
        print(codec, {k: round(v, 4) for k, v in bits.items() if k.startswith(tag)}, flush=True)
    bitsf.write_text(json.dumps(bits, indent=1))
    (a.out / (f"variants_{a.tag}.txt" if a.tag else "variants.txt")).write_text("\n".join(variants) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
