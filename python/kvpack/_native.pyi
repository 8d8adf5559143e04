"""Type stubs of the compiled extension ``kvpack._native`` (Rust, PyO3).

Most users call the wrappers in :mod:`kvpack`; these are the primitives
they are built on. Arrays cross the boundary through DLPack without
copies: ``Array`` below is any object with ``__dlpack__`` (numpy >= 1.22,
torch, cupy) or an unused DLPack capsule. Tensors are ``[batch, kv_heads,
tokens, head_dim]`` (3-d ``[kv_heads, tokens, head_dim]`` = batch 1),
bfloat16 / float16 / float32, head_dim axis contiguous; a trailing
``dtype`` hint (``"bf16"``/``"fp16"``) reads uint16 arrays as bit patterns.
Errors are the exceptions of :mod:`kvpack.errors`.
"""

from os import PathLike
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

Array = Any

__version__: str
FORMAT_VERSION: Tuple[int, int]

#: ``(name, layer, kind, dtype, batch, kv_heads, tokens, head_dim, fp8 scale)``
InfoTuple = Tuple[str, int, str, str, int, int, int, int, Optional[float]]

class OwnedArray:
    """Decoded elements owned by Rust (row-major, host memory); wrap with
    ``numpy.from_dlpack`` / ``torch.from_dlpack`` (no copy)."""

    @property
    def shape(self) -> List[int]: ...
    @property
    def dtype(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``."""
    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def as_bits(self) -> "OwnedArray":
        """The same memory, 16-bit floats exported as uint16."""

class OwnedBytes:
    """Bytes owned by Rust (an encoded file); ``numpy.from_dlpack`` gives
    a 1-d uint8 array without a copy."""

    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __len__(self) -> int: ...

class Archive:
    """An opened kvpack file (a path is memory-mapped; ``bytes`` and uint8
    arrays are copied once)."""

    def __init__(self, source: Union[str, "PathLike[str]", bytes, Array]) -> None: ...
    def tensors(self) -> List[InfoTuple]: ...
    def metadata(self) -> Dict[str, str]: ...
    def token_ids(self) -> List[int]: ...
    def codecs(self) -> List[str]: ...
    def version(self) -> Tuple[int, int]: ...
    def decode(
        self,
        layers: Optional[Tuple[int, int]] = None,
        kind: Optional[str] = None,
        tokens: Optional[Tuple[int, int]] = None,
        dtype: Optional[str] = None,
    ) -> List[Tuple[int, str, OwnedArray]]: ...
    def decode_into(
        self,
        outputs: Sequence[Union[Tuple[int, str, int, Array], Tuple[int, str, int, Array, str]]],
    ) -> None:
        """``outputs``: ``(layer, kind, first_token, array[, dtype])``."""

def compress(
    tensors: Sequence[Union[Tuple[int, str, Array], Tuple[int, str, Array, str]]],
    codec: str,
    *,
    path: Optional[Union[str, "PathLike[str]"]] = None,
    force: bool = False,
    out: Optional[Array] = None,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align_log2: int = 6,
    raw_fallback: bool = False,
    metadata: Optional[Dict[str, str]] = None,
    token_ids: Optional[List[int]] = None,
    bits: Optional[float] = None,
    key_codec: Optional[str] = None,
) -> Tuple[Dict[str, Any], Optional[bytes], Optional[int]]:
    """``tensors``: ``(layer, kind, array[, dtype[, fp8 scale]])``. Returns ``(report,
    file bytes or None, bytes written into out or None)``."""

def compress_file(
    source: Union[str, "PathLike[str]"],
    codec: str,
    *,
    path: Optional[Union[str, "PathLike[str]"]] = None,
    force: bool = False,
    out: Optional[Array] = None,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align_log2: int = 6,
    raw_fallback: bool = False,
    bits: Optional[float] = None,
    key_codec: Optional[str] = None,
) -> Tuple[Dict[str, Any], Optional[bytes], Optional[int]]:
    """Like :func:`compress` from a safetensors KV cache file (mmap)."""

def max_size(
    tensors: Sequence[Tuple[int, str, Sequence[int], str]],
    codec: str,
    *,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align_log2: int = 6,
    metadata: Optional[Dict[str, str]] = None,
    token_ids: int = 0,
) -> int:
    """``tensors``: ``(layer, kind, [batch, kv_heads, tokens, head_dim], dtype)``."""

def decode_bytes_into(
    data: Union[bytes, Array],
    outputs: Sequence[Union[Tuple[int, str, int, Array], Tuple[int, str, int, Array, str]]],
) -> None: ...
def tensor_table(data: Union[bytes, Array]) -> List[InfoTuple]: ...
def bench_decode_into(data: bytes, runs: int, dtype: Optional[str] = None) -> List[float]: ...
def codec_families() -> List[Tuple[int, str, str, str]]: ...
def canonical_codec(name: str) -> str: ...
def page_faults(data: Union[bytes, Array]) -> List[Tuple[int, str, int, int, str]]:
    """Every damaged page of a kvpack file, each checked on its own:
    ``(layer, kind, token_start, token_end, message)``; raises FormatError
    when the header, index or trailer itself is damaged."""

def encode_paged_host(
    kv_cache: Sequence[Array],
    block_ids: Union[Sequence[int], Array],
    num_tokens: int,
    codec: str,
    *,
    layout: str,
    layer: int,
    dtype: Optional[str] = None,
    out: Optional[Array] = None,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align_log2: int = 6,
    raw_fallback: bool = False,
) -> Tuple[Dict[str, Any], Optional[bytes], Optional[int]]:
    """Encodes tokens ``0..num_tokens`` of a host paged cache (one layer:
    one tensor for ``flash_attn``/``flashinfer``, ``(k, v)`` for ``hnd``;
    C-contiguous host arrays, ``dtype`` naming uint16 bit patterns) at
    ``block_ids`` into a kvpack file: ``(report, bytes | None, bytes
    written into out | None)``. See :func:`kvpack.paged.encode_paged`."""

def decode_paged_host(
    data: Union[Archive, bytes, Array],
    kv_cache: Sequence[Array],
    block_ids: Union[Sequence[int], Array],
    *,
    layer: int,
    layout: str,
    dtype: Optional[str] = None,
    tokens: Optional[Tuple[int, int]] = None,
) -> None:
    """Decodes layer ``layer`` of a kvpack file (all stored tokens, or
    stored tokens ``tokens = (start, end)``) into the blocks ``block_ids``
    of a host paged cache. See :func:`kvpack.paged.decode_paged`."""

class CudaJob:
    """Paged decode work enqueued on a CUDA stream (see
    :func:`kvpack.cuda.decode_paged`); holds the cache tensors and the
    pinned staging until the work is done. Dropping it waits for the work
    (an event wait, never the device)."""

    def wait(self) -> Optional[Dict[str, int]]:
        """Waits (GIL released) and checks the kernels' status; returns
        ``{pages, file_bytes, uploaded_bytes, output_bytes}``, or ``None``
        when already waited for."""
    def done(self) -> bool:
        """True when the work has finished (does not block)."""

def cuda_decode_paged(
    data: Union[Archive, bytes, Array],
    kv_cache: Sequence[Array],
    block_ids: Sequence[int],
    *,
    layer: int,
    layout: str,
    stream: int,
    device_copy: Optional[Array] = None,
) -> CudaJob: ...
def cuda_encode_paged(
    kv_cache: Sequence[Array],
    block_ids: Sequence[int],
    num_tokens: int,
    codec: str,
    *,
    layout: str,
    layer: int,
    stream: int,
    out: Optional[Array] = None,
    page_tokens: Optional[int] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align_log2: int = 6,
    raw_fallback: bool = False,
) -> Tuple[Dict[str, Any], Optional[OwnedBytes], Optional[int]]: ...
def cuda_bench_decode_paged(
    data: bytes,
    kv_cache: Sequence[Array],
    block_ids: Sequence[int],
    *,
    layer: int,
    layout: str,
    stream: int,
    runs: int,
) -> List[float]: ...
def cuda_bench_encode_paged(
    kv_cache: Sequence[Array],
    block_ids: Sequence[int],
    num_tokens: int,
    codec: str,
    *,
    layout: str,
    stream: int,
    runs: int,
) -> List[float]: ...
def cuda_built() -> bool: ...
