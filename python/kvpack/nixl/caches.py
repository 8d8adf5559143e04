"""Paged KV caches in host memory as token-range views, and cache checks against a :class:`~kvpack.nixl.spec.HandoffSpec`."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ParameterError
from .spec import LAYOUTS, HandoffSpec

# --------------------------------------------------------------------------
# cache views (host caches: numpy arrays or CPU torch tensors)


def _is_cuda(cache: Any) -> bool:
    t = cache[0] if isinstance(cache, (tuple, list)) else cache
    dev = getattr(t, "__dlpack_device__", None)
    return dev is not None and dev()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged


def _runs(block_ids: Sequence[int], num_tokens: int, block_size: int) -> List[Tuple[int, int, int]]:
    """``(first_token, tokens, first_block)`` for each run of consecutive
    block ids covering tokens ``0..num_tokens``."""
    n = -(-num_tokens // block_size)
    ids = [int(b) for b in block_ids[:n]]
    if len(ids) < n:
        raise ParameterError(f"block table has {len(ids)} blocks; {num_tokens} tokens need {n}")
    runs: List[Tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][2] + runs[-1][1] // block_size == b and runs[-1][1] % block_size == 0:
            f, t, b0 = runs[-1]
            runs[-1] = (f, t + block_size, b0)
        else:
            runs.append((i * block_size, block_size, b))
    f, t, b0 = runs[-1]
    runs[-1] = (f, num_tokens - f, b0)
    return runs


def _heads_first(x: Any) -> Any:
    """``[tokens, kv_heads, head_dim]`` as a ``[1, kv_heads, tokens,
    head_dim]`` view (numpy or torch)."""
    t = x.transpose(0, 1) if hasattr(x, "dim") else x.transpose(1, 0, 2)
    return t[None]


def _host_views(cache: Any, layout: str, runs: List[Tuple[int, int, int]]) -> List[Tuple[int, Any, Any]]:
    """``(first_token, k_view, v_view)`` per run, each view ``[1, kv_heads,
    tokens, head_dim]`` into the cache (no copy). flashinfer and hnd blocks
    are not token-contiguous across blocks: one view per block."""
    out = []
    if layout == "flash_attn":
        for f, t, b in runs:
            nb = -(-t // cache.shape[2])
            k = cache[0, b : b + nb].reshape(-1, cache.shape[3], cache.shape[4])[:t]
            v = cache[1, b : b + nb].reshape(-1, cache.shape[3], cache.shape[4])[:t]
            out.append((f, _heads_first(k), _heads_first(v)))
        return out
    bs = cache[0].shape[2] if layout == "hnd" else cache.shape[2]
    for f, t, b in runs:
        for j in range(-(-t // bs)):
            n = min(bs, t - j * bs)
            if layout == "flashinfer":
                k, v = _heads_first(cache[b + j, 0, :n]), _heads_first(cache[b + j, 1, :n])
            else:
                k, v = cache[0][b + j][None, :, :n], cache[1][b + j][None, :, :n]
            out.append((f + j * bs, k, v))
    return out


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ParameterError(f"unknown cache layout {layout!r}: expected one of {LAYOUTS}")


def _check_cache(cache: Any, layout: str, spec: HandoffSpec) -> None:
    """The cache's block size, KV heads and head_dim against the spec."""
    _check_layout(layout)
    if layout == "hnd":
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise ParameterError("the hnd layout takes a (k_cache, v_cache) pair")
        shape = tuple(cache[0].shape)
        got = (shape[2], shape[1], shape[3]) if len(shape) == 4 else None
    else:
        if isinstance(cache, (tuple, list)):
            raise ParameterError(f"the {layout} layout takes one tensor holding K and V")
        shape = tuple(cache.shape)
        ok = len(shape) == 5 and shape[0 if layout == "flash_attn" else 1] == 2
        got = (shape[2], shape[3], shape[4]) if ok else None
    want = (spec.block_size, spec.kv_heads, spec.head_dim)
    if got != want:
        raise ParameterError(
            f"{layout} cache of shape {shape}: expected block_size, kv_heads, head_dim {want} (see kvpack.nixl.LAYOUTS)"
        )


def _hint(arr: Any, dtype: str) -> Optional[str]:
    """The bit-pattern dtype hint for uint16 numpy arrays holding bf16/fp16."""
    if isinstance(arr, np.ndarray) and arr.dtype == np.uint16:
        return dtype
    return None
