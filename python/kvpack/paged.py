"""Host paged I/O: kvpack files into and out of a serving engine's paged KV
cache held in host memory (a CPU-offloaded cache, a NIXL host buffer), the
host mirror of :mod:`kvpack.cuda`.

The cache is one layer of a vLLM-style paged KV cache in host memory:
numpy arrays (uint16 bit patterns of bfloat16/float16 with ``dtype=``, or
float32) or CPU torch tensors (bfloat16, float16, float32), C-contiguous,
in one of the layouts of :mod:`kvpack.cuda`:

* ``"flash_attn"``: one tensor ``[2, num_blocks, block_size, kv_heads,
  head_dim]``, K at index 0 of the first axis, V at 1;
* ``"flashinfer"``: one tensor ``[num_blocks, 2, block_size, kv_heads,
  head_dim]``;
* ``"hnd"``: two tensors ``(k, v)``, each ``[num_blocks, kv_heads,
  block_size, head_dim]``.

Token ``t`` of the sequence lives in row ``t % block_size`` of block
``block_ids[t // block_size]`` (vLLM's block table; extra ids are ignored).

The blocks are read and written in place: ``int`` and ``bdr`` codecs code
each row straight from and into its block, other codecs gather or scatter
one page (256 tokens by default) at a time; no layer-sized copy is made.
Encoded files are byte-identical to :func:`kvpack.compress` of the
gathered ``[1, kv_heads, num_tokens, head_dim]`` K and V of layer
``layer``. Both calls release the GIL and run on kvpack's threads.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from . import _native
from .errors import _integers_in_range
from .cuda import LAYOUTS, _block_ids, _tensors

__all__ = ["decode_paged", "encode_paged", "LAYOUTS"]


@_integers_in_range
def encode_paged(
    kv_cache: Any,
    block_ids: Any,
    num_tokens: int,
    codec: str,
    *,
    layout: str = "flash_attn",
    layer: int = 0,
    dtype: Optional[str] = None,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    raw_fallback: bool = False,
    out: Any = None,
) -> Union[bytes, int]:
    """Encodes tokens ``0..num_tokens`` of one layer of a host paged KV
    cache into a complete kvpack file (``kvpack.open`` reads it).

    Args:
        kv_cache: the layer's cache (module docs; ``(k, v)`` for ``"hnd"``).
        block_ids: the sequence's block table (list, or 1-d int32/int64
            numpy array or CPU tensor), at least ``ceil(num_tokens /
            block_size)`` distinct ids below ``num_blocks``.
        num_tokens: tokens to encode (at least 1).
        codec: codec name (``kvpack.codecs()``).
        layout: ``"flash_attn"``, ``"flashinfer"`` or ``"hnd"``.
        layer: layer index recorded in the file.
        dtype: ``"bf16"`` or ``"fp16"`` for uint16 bit-pattern arrays.
        page_tokens, sink, recent, zstd_level, raw_fallback: as for
            :func:`kvpack.compress` (windows default to the codec's own).
        out: a writable contiguous uint8 host array to write the file into
            (size it with :func:`kvpack.max_size` and ``raw_fallback=True``).

    Returns:
        The file as ``bytes``, or with ``out`` the number of bytes written.

    Raises:
        ParameterError: a bad block table (short, out of range, repeated
            id), codec or shape; NaN/inf rows (the row is named); ``out``
            too small.
        ValueError: a cache that is not a C-contiguous host array of a
            type kvpack reads.
    """
    tensors = _tensors(kv_cache, layout)
    _, data, written = _native.encode_paged_host(
        tensors,
        _block_ids(block_ids),
        int(num_tokens),
        codec,
        layout=layout,
        layer=int(layer),
        dtype=dtype,
        out=out,
        page_tokens=page_tokens,
        sink=sink,
        recent=recent,
        zstd_level=zstd_level,
        raw_fallback=raw_fallback,
    )
    return data if out is None else int(written)


@_integers_in_range
def decode_paged(
    data_or_archive: Any,
    kv_cache: Any,
    block_ids: Any,
    *,
    layer: int,
    layout: str = "flash_attn",
    dtype: Optional[str] = None,
    tokens: Optional[Tuple[int, int]] = None,
) -> None:
    """Decodes layer ``layer`` (its K and V, batch 1) of a kvpack file into
    the blocks ``block_ids`` of a host paged KV cache, in the cache's
    element type.

    Every page is checked (CRC, section table) before it is decoded. Rows
    of tokens outside ``tokens`` and blocks not named are not touched.

    Args:
        data_or_archive: the file: :class:`kvpack.Archive`, ``bytes``, or
            a contiguous uint8 host array (read in place, e.g. a NIXL
            landing buffer).
        kv_cache: the layer's cache (module docs), writable.
        block_ids: the block table, as for :func:`encode_paged`: token
            ``t`` goes to row ``t % block_size`` of block ``block_ids[t //
            block_size]``.
        layer: layer index in the file.
        layout: ``"flash_attn"``, ``"flashinfer"`` or ``"hnd"``.
        dtype: ``"bf16"`` or ``"fp16"`` for uint16 bit-pattern arrays.
        tokens: decode only stored tokens ``[start, end)`` (e.g. the intact
            pages of a damaged transfer); default all.

    Raises:
        ParameterError: the file lacks the layer, its K/V do not fit the
            cache (kv_heads, head_dim, batch 1), a bad block table or
            token range.
        FormatError: corrupted data (names the page); pages decoded before
            it stay written.
        ValueError: a cache that is not a writable C-contiguous host array
            of a type kvpack reads.
    """
    _native.decode_paged_host(
        getattr(data_or_archive, "_a", data_or_archive),
        _tensors(kv_cache, layout),
        _block_ids(block_ids),
        layer=int(layer),
        layout=layout,
        dtype=dtype,
        tokens=None if tokens is None else (int(tokens[0]), int(tokens[1])),
    )
