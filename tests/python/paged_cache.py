"""Test data shared by the paged-cache tests (``test_paged.py``,
``test_nixl.py``): the committed real fixture's KV cache, tiled to more
tokens, laid out in host paged caches of vLLM's layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import kvpack

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gemma3-270m-gpl3-520.safetensors"
BLOCK = 16
TOKENS = 1000  # 4 pages of 256 per tensor, the last one partial


def fixture() -> kvpack.Archive:
    """The committed real KV cache (safetensors), as a raw kvpack archive."""
    return kvpack.open(kvpack.compress(str(FIXTURE), "raw").data)


def fixture_layers(n_layers: int):
    """The fixture's K/V (bf16 bit patterns) for ``n_layers`` layers, each
    [kv_heads, TOKENS, head_dim], the 520 real tokens tiled."""
    ar = fixture()
    got = ar.decode(layers=(0, n_layers), dtype="bf16")
    out = []
    for layer in range(n_layers):
        kv = []
        for kind in ("K", "V"):
            a = np.asarray(got[(layer, kind)])[0].view(np.uint16)
            reps = -(-TOKENS // a.shape[1])
            kv.append(np.ascontiguousarray(np.tile(a, (1, reps, 1))[:, :TOKENS]))
        out.append(tuple(kv))
    return out


def paged(layers, block_ids, num_blocks, layout="flash_attn"):
    """Host caches per layer in ``layout`` (flash_attn ``[2, num_blocks,
    BLOCK, heads, dim]``, flashinfer ``[num_blocks, 2, BLOCK, heads, dim]``,
    hnd a pair of ``[num_blocks, heads, BLOCK, dim]``) holding ``layers`` at
    ``block_ids``."""
    caches = []
    for k, v in layers:
        h, t, d = k.shape
        fa = np.zeros((2, num_blocks, BLOCK, h, d), np.uint16)
        for i, b in enumerate(block_ids):
            lo, hi = i * BLOCK, min(t, (i + 1) * BLOCK)
            fa[0, b, : hi - lo] = k[:, lo:hi].transpose(1, 0, 2)
            fa[1, b, : hi - lo] = v[:, lo:hi].transpose(1, 0, 2)
        caches.append(relayout(fa, layout))
    return caches


def relayout(fa, layout):
    """A flash_attn cache in another layout (contiguous copies)."""
    if layout == "flash_attn":
        return fa
    if layout == "flashinfer":
        return np.ascontiguousarray(fa.transpose(1, 0, 2, 3, 4))
    return tuple(np.ascontiguousarray(fa[i].transpose(0, 2, 1, 3)) for i in range(2))


def as_flash_attn(cache, layout):
    """Inverse of :func:`relayout` (host numpy)."""
    if layout == "hnd":
        return np.stack([c.transpose(0, 2, 1, 3) for c in cache])
    if layout == "flashinfer":
        return cache.transpose(1, 0, 2, 3, 4)
    return cache


def unpaged(cache, blocks, tokens):
    """K and V ``[heads, tokens, dim]`` gathered out of a flash_attn cache."""
    k = np.concatenate([cache[0, b] for b in blocks])[:tokens].transpose(1, 0, 2)
    v = np.concatenate([cache[1, b] for b in blocks])[:tokens].transpose(1, 0, 2)
    return k, v
