"""CUDA paged I/O: kvpack files into and out of a serving engine's paged KV
cache, on the caller's CUDA stream.

The cache is one layer of a vLLM-style paged KV cache, a CUDA tensor (torch,
cupy: anything with ``__dlpack__``) of bfloat16 or float16, C-contiguous,
in one of three layouts:

* ``"flash_attn"``: one tensor ``[2, num_blocks, block_size, kv_heads,
  head_dim]``, K at index 0 of the first axis, V at 1 (vLLM's
  FlashAttention back end);
* ``"flashinfer"``: one tensor ``[num_blocks, 2, block_size, kv_heads,
  head_dim]`` (FlashInfer);
* ``"hnd"``: two tensors ``(k, v)``, each ``[num_blocks, kv_heads,
  block_size, head_dim]``.

Token ``t`` of the sequence lives in row ``t % block_size`` of block
``block_ids[t // block_size]`` (vLLM's block table; extra ids are ignored).

Streams: work is enqueued on ``stream`` (a ``torch.cuda.Stream``, a cupy
stream, or a raw ``CUstream`` integer), by default the current stream of
the cache's device (``torch.cuda.current_stream(dev).cuda_stream``). kvpack
never synchronizes the device or the context: :func:`decode_paged` waits,
when ``wait=True``, only on an event recorded after its own work on that
stream; :func:`encode_paged` waits for its work on that stream because it
returns the file's bytes.

Results are bit-exact with the CPU decoder (every codec the GPU decodes:
raw, int, bdr, hqmq, octopus, turbo, polar, innerq, kivi), and encoded
files are byte-identical to :func:`kvpack.compress` of the same tensors.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Union

import numpy as np

from . import _native
from .errors import ParameterError, _integers_in_range

__all__ = ["decode_paged", "encode_paged", "CudaJob", "available", "LAYOUTS"]

#: The paged layouts, by their names here.
LAYOUTS = ("flash_attn", "flashinfer", "hnd")

CudaJob = _native.CudaJob


def available() -> bool:
    """True when this build has CUDA support (the ``cuda`` cargo feature).
    A GPU and driver are still needed at run time."""
    return bool(_native.cuda_built())


def _tensors(kv_cache: Any, layout: str) -> list:
    if layout not in LAYOUTS:
        raise ParameterError(f"unknown paged layout {layout!r}: expected one of {LAYOUTS}")
    if layout == "hnd":
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
            raise ParameterError("the hnd layout takes a (k_cache, v_cache) pair")
        return list(kv_cache)
    if isinstance(kv_cache, (tuple, list)):
        raise ParameterError(f"the {layout} layout takes one tensor holding K and V")
    return [kv_cache]


def _stream(stream: Any, tensor: Any) -> int:
    """The raw CUstream: given, or the current stream of the tensor's device."""
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            return int(torch.cuda.current_stream(tensor.device).cuda_stream)
        cupy = sys.modules.get("cupy")
        if cupy is not None and isinstance(tensor, cupy.ndarray):
            return int(cupy.cuda.get_current_stream().ptr)
        return 0  # the legacy default stream
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)


def _block_ids(block_ids: Any) -> Any:
    """A list of ints or a 1-d int32/int64 host array, as the native call
    reads it without converting element by element."""
    if isinstance(block_ids, list) or hasattr(block_ids, "__dlpack__"):
        if getattr(block_ids, "is_cuda", False):
            return block_ids.cpu()  # waits for the producer, as documented
        return block_ids
    try:
        return [int(b) for b in block_ids]
    except TypeError as e:
        raise ParameterError(f"block_ids must be a sequence of ints: {e}") from None


@_integers_in_range
def decode_paged(
    data_or_archive: Any,
    kv_cache: Any,
    block_ids: Any,
    *,
    layer: int,
    layout: str = "flash_attn",
    stream: Any = None,
    wait: bool = True,
    device_copy: Any = None,
) -> Union[Dict[str, int], "CudaJob"]:
    """Decodes layer ``layer`` (its K and V, batch 1, all stored tokens) of a
    kvpack file into a paged KV cache on the GPU.

    The pages are checked (CRC) and staged on the CPU with the GIL
    released, copied to the GPU once, and decoded by the codec's kernels
    straight into the blocks ``block_ids`` of ``kv_cache``, in the cache's
    dtype. Blocks not named are not touched.

    Args:
        data_or_archive: the file: :class:`kvpack.Archive`, ``bytes``, a
            contiguous uint8 host array (read in place), or a contiguous
            uint8 CUDA tensor on the cache's device (e.g. a NIXL landing
            buffer; unchanged until the work is done): then the host reads
            back only the file's header, index and page headers, the GPU
            checks every page body's CRC and padding and decodes it in
            place; pages of codecs that check section content on the host
            (kivi, innerq, octopus, turbo, hqmq), zstd pages and files
            found at fault are read back whole and checked on the host,
            whose error names the page.
        kv_cache: the layer's cache (see the module docs for the layouts;
            ``(k, v)`` for ``"hnd"``), bfloat16/float16 CUDA tensor(s).
        block_ids: the sequence's block table (list, numpy array or tensor
            of ints; a CUDA tensor is read back to the host first, which
            waits for it), at least ``ceil(tokens / block_size)`` distinct
            ids below ``num_blocks``.
        layer: layer index in the file.
        layout: ``"flash_attn"``, ``"flashinfer"`` or ``"hnd"``.
        stream: CUDA stream to enqueue on (default: the current stream).
        wait: wait for the work (an event wait) and check its status, then
            return counters ``{pages, file_bytes, uploaded_bytes,
            output_bytes}``; with ``False`` return the :class:`CudaJob` at
            once (keep it alive while the work runs; ``job.wait()`` checks
            the status; dropping it waits).
        device_copy: the same file bytes in CUDA memory of the cache's
            device (a contiguous uint8 tensor, e.g. a NIXL landing buffer
            the host copy ``data_or_archive`` was read back from). The
            pages are still validated on the host from ``data_or_archive``,
            but the kernels read the bodies of uncompressed pages from
            ``device_copy``, so nothing is uploaded but descriptors. Its
            bytes must equal the host copy's and stay unchanged until the
            work is done (a differing body would be decoded unchecked).

    Raises:
        ParameterError: shapes that do not match the file (kv_heads,
            head_dim, batch 1), a short, out-of-range or repeating block
            table, an unknown layout; ``ValueError`` for a cache that is not
            a contiguous bf16/fp16 CUDA tensor.
        FormatError: corrupted data (names the page).
        UnsupportedError: no CUDA in this build or on this machine.
    """
    tensors = _tensors(kv_cache, layout)
    data = getattr(data_or_archive, "_a", data_or_archive)
    job = _native.cuda_decode_paged(
        data,
        tensors,
        _block_ids(block_ids),
        layer=int(layer),
        layout=layout,
        stream=_stream(stream, tensors[0]),
        device_copy=device_copy,
    )
    if not wait:
        return job
    return job.wait()


@_integers_in_range
def encode_paged(
    kv_cache: Any,
    block_ids: Any,
    num_tokens: int,
    codec: str,
    *,
    layout: str = "flash_attn",
    layer: int = 0,
    stream: Any = None,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    raw_fallback: bool = False,
    out: Any = None,
) -> Union["np.ndarray", int]:
    """Encodes tokens ``0..num_tokens`` of a paged KV cache (one layer) into
    a complete kvpack file (``kvpack.open`` / ``kvpack inspect`` read it).

    The rows are gathered on the GPU into contiguous ``[kv_heads,
    num_tokens, head_dim]`` buffers; every codec (``raw``, ``int{b}``,
    ``bdr{h}``, ``hqmq`` with or without ``+med``, ``kivi``, ``innerq``,
    ``polar``, ``turbo``, ``octopus``) then encodes on the GPU (sink/recent
    window pages and InnerQ's key normalization statistics too) and only the
    pages come back. Codecs without a GPU encoder for the shape (and
    ``raw_fallback``) copy the gathered rows to the host on the same
    stream and encode them with the CPU codec. Either way the bytes equal
    :func:`kvpack.compress` of the same tensors (names
    ``past_key_values.{layer}.key/value``).

    Args:
        kv_cache: the layer's cache, as for :func:`decode_paged`.
        block_ids: the block table (see :func:`decode_paged`).
        num_tokens: tokens to encode (at least 1).
        codec: codec name (``kvpack.codecs()``).
        layout: ``"flash_attn"``, ``"flashinfer"`` or ``"hnd"``.
        layer: layer index recorded in the file.
        stream: CUDA stream (default: the current stream).
        page_tokens, sink, recent, zstd_level, raw_fallback: as for
            :func:`kvpack.compress` (windows default to the codec's own).
        out: a writable contiguous uint8 array to write the file into
            (size it with :func:`kvpack.max_size` and ``raw_fallback=True``):
            host memory (e.g. pinned), or CUDA memory of the cache's device
            (e.g. a NIXL send buffer), where codecs with fixed page layouts
            (all but ``hqmq...+med``, zstd and the CPU fallback) build and
            checksum the page frames on the GPU, so no byte of the file
            passes through the host.

    Returns:
        The file as a 1-d uint8 numpy array that owns the encoder's memory
        (no copy; ``kvpack.open`` reads it, ``bytes(a)`` copies it), or
        with ``out`` the number of bytes written. The call waits for its
        own work on ``stream``.

    Raises:
        ParameterError: a bad block table, codec or shape; NaN/inf rows
            (the row is named).
        UnsupportedError: no CUDA in this build or on this machine.
    """
    tensors = _tensors(kv_cache, layout)
    _, data, written = _native.cuda_encode_paged(
        tensors,
        _block_ids(block_ids),
        int(num_tokens),
        codec,
        layout=layout,
        layer=int(layer),
        stream=_stream(stream, tensors[0]),
        page_tokens=page_tokens,
        sink=sink,
        recent=recent,
        zstd_level=zstd_level,
        raw_fallback=raw_fallback,
        out=out,
    )
    return np.from_dlpack(data) if out is None else written

