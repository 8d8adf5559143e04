"""Cache checks against a :class:`~kvpack.nixl.spec.HandoffSpec` (host and CUDA paged caches)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import ParameterError
from .spec import LAYOUTS, HandoffSpec

# --------------------------------------------------------------------------
# cache kinds and checks (host caches: numpy arrays or CPU torch tensors)


def _is_cuda(cache: Any) -> bool:
    t = cache[0] if isinstance(cache, (tuple, list)) else cache
    dev = getattr(t, "__dlpack_device__", None)
    return dev is not None and dev()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged


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
    """The bit-pattern dtype hint for uint16 numpy arrays holding bf16/fp16
    (``arr`` a cache tensor, or the ``(k, v)`` pair of ``hnd``)."""
    a = arr[0] if isinstance(arr, (tuple, list)) else arr
    if isinstance(a, np.ndarray) and a.dtype == np.uint16:
        return dtype
    return None
