"""kvpack: compressed, checksummed LLM KV caches from Python.

kvpack stores KV caches in a versioned, self-describing file format (every
page checksummed, codec parameters in the file) with codecs from recent
papers (BDR, HQMQ, OCTOPUS, InnerQ, PolarQuant, KIVI, TurboQuant) at 2-8
bits per element. This package takes numpy arrays and torch tensors in and
gives them back without copying them (DLPack), decodes on all cores with
the GIL released, plugs into LMCache (:mod:`kvpack.lmcache`) and HF
transformers caches (:mod:`kvpack.hf`), and hands caches from prefill to
decode workers over NIXL (:mod:`kvpack.nixl`).

Tensors are ``[batch, kv_heads, tokens, head_dim]`` (HF's
``past_key_values`` order; 3-d ``[kv_heads, tokens, head_dim]`` means batch
1) in bfloat16, float16 or float32, in any strides whose head_dim axis is
contiguous. numpy has no bfloat16: pass a torch tensor, an ``ml_dtypes``
bfloat16 array, or uint16 bit patterns with ``dtype="bf16"``.

Example::

    import numpy as np, kvpack
    k = np.random.randn(1, 8, 1024, 128).astype(np.float16)
    v = np.random.randn(1, 8, 1024, 128).astype(np.float16)
    res = kvpack.compress([(k, v)], codec="bdr128")
    print(f"{res.bits_per_element:.3f} bits/element")
    ar = kvpack.open(res.data)
    k2 = ar.decode(kind="K")[(0, "K")]          # numpy, float16
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as _np

from . import _native
from .errors import (
    DeviceError,
    FormatError,
    KvpackError,
    KvpackIOError,
    LimitsError,
    ParameterError,
    UnsupportedError,
    _integers_in_range,
)

__version__: str = _native.__version__
#: Version ``(major, minor)`` of the file format this build writes.
FORMAT_VERSION: Tuple[int, int] = tuple(_native.FORMAT_VERSION)  # type: ignore[assignment]

__all__ = [
    "Archive",
    "CompressResult",
    "TensorInfo",
    "codecs",
    "compress",
    "open",
    "max_size",
    "chunk_max_size",
    "encode_chunk",
    "decode_chunk",
    "KvpackError",
    "FormatError",
    "ParameterError",
    "LimitsError",
    "KvpackIOError",
    "UnsupportedError",
    "DeviceError",
]

#: Metadata key naming the model a cache belongs to.
MODEL_KEY = "kvpack.model"

ArrayLike = Any  # numpy.ndarray | torch.Tensor | any object with __dlpack__
Key = Tuple[int, str]


class TensorInfo(NamedTuple):
    """One K, V or MLA latent tensor of a kvpack file (shape ``[batch,
    kv_heads, tokens, head_dim]``, a latent ``[batch, 1, tokens,
    latent_dim]``; ``tokens`` is the latest commit's count)."""

    name: str
    layer: int
    kind: str  #: "K", "V" or "L" (MLA latent, format 1.1)
    dtype: str  #: source element type: "bf16", "fp16", "fp32", "fp8_e4m3" or "fp8_e5m2"
    batch: int
    kv_heads: int
    tokens: int
    head_dim: int
    #: the per-tensor scale of an fp8 tensor (value = code * scale), else None
    scale: Optional[float] = None

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """``(batch, kv_heads, tokens, head_dim)``."""
        return (self.batch, self.kv_heads, self.tokens, self.head_dim)


@dataclass(frozen=True)
class CompressResult:
    """What :func:`compress` produced.

    Attributes:
        codec: canonical codec name.
        pages: pages written; ``raw_pages`` of them sink/recent (or
            fallback) pages at source precision.
        elements: elements compressed.
        source_bytes: bytes of the source tensors at source precision.
        output_bytes: bytes of the kvpack file.
        bits_per_element: output bits per source element, everything
            (headers, scales, side tables, index) included.
        ratio: ``source_bytes / output_bytes``.
        seconds: wall time.
        data: the file as ``bytes`` when neither ``path`` nor ``out`` was
            given, else ``None``.
        written: bytes written into ``out``, when given.
    """

    codec: str
    pages: int
    raw_pages: int
    elements: int
    source_bytes: int
    output_bytes: int
    bits_per_element: float
    ratio: float
    seconds: float
    data: Optional[bytes] = None
    written: Optional[int] = None


def _kind(kind: str) -> str:
    if kind in ("K", "V", "L"):
        return kind
    k = {"k": "K", "key": "K", "keys": "K", "v": "V", "value": "V", "values": "V", "l": "L", "latent": "L"}.get(
        kind.lower()
    )
    if k is None:
        raise ParameterError(f"kind {kind!r}: expected 'K', 'V' or 'L' (MLA latent)")
    return k


def _source(arr: ArrayLike, dtype: Optional[str]) -> Tuple[ArrayLike, Optional[str]]:
    """An array as DLPack can export it, with a dtype hint for bit patterns."""
    cls = type(arr)
    if cls is _np.ndarray:
        if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:
            # ml_dtypes.bfloat16 (numpy has no native bfloat16): the bits.
            return arr.view(_np.uint16), dtype or "bf16"
        return arr, dtype
    torch = sys.modules.get("torch")
    if torch is not None and cls is torch.Tensor and arr.device.type == "cpu":
        # torch's public C-level export: much cheaper per tensor than its
        # Python-level __dlpack__ (which checks streams first).
        return torch.utils.dlpack.to_dlpack(arr), dtype
    return arr, dtype


def _entries(layers: Union[Sequence[Tuple[ArrayLike, ArrayLike]], Mapping[Key, ArrayLike]]) -> List[Tuple[int, str, ArrayLike]]:
    if isinstance(layers, Mapping):
        return [(int(l), _kind(k), a) for (l, k), a in layers.items()]
    out = []
    for i, pair in enumerate(layers):
        if pair is None:
            continue
        k, v = pair
        if k is not None:
            out.append((i, "K", k))
        if v is not None:
            out.append((i, "V", v))
    return out


def _window_kwargs(sink, recent, page_tokens, zstd_level, align) -> Dict[str, Any]:
    if align not in (64, 4096) and (align & (align - 1) or align < 64 or align > 65536):
        raise ParameterError(f"align {align}: expected a power of two in 64..=65536 (64 or 4096)")
    for name, v, lo in (("sink", sink, 0), ("recent", recent, 0), ("page_tokens", page_tokens, 1)):
        if v is not None and not lo <= int(v) < 2**32:
            raise ParameterError(f"{name} {v}: expected an integer in {lo}..2**32")
    return dict(
        sink=sink,
        recent=recent,
        page_tokens=page_tokens,
        zstd_level=zstd_level,
        align_log2=int(align).bit_length() - 1,
    )


@_integers_in_range
def compress(
    layers: Union[str, "os.PathLike[str]", Sequence[Tuple[ArrayLike, ArrayLike]], Mapping[Key, ArrayLike]],
    codec: Optional[str] = None,
    *,
    bits: Optional[float] = None,
    key_codec: Optional[str] = None,
    path: Optional[Union[str, "os.PathLike[str]"]] = None,
    force: bool = False,
    out: Optional[ArrayLike] = None,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    page_tokens: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align: int = 64,
    raw_fallback: bool = False,
    model: Optional[str] = None,
    token_ids: Optional[Iterable[int]] = None,
    metadata: Optional[Mapping[str, str]] = None,
    dtype: Optional[str] = None,
    scales: Optional[Mapping[Key, float]] = None,
) -> CompressResult:
    """Compresses a KV cache into a kvpack file.

    Args:
        layers: per layer a ``(K, V)`` pair (either may be ``None``), or a
            mapping ``{(layer, "K"|"V"): array}``. Each array is
            ``[batch, kv_heads, tokens, head_dim]`` (or 3-d, batch 1) of
            bfloat16/float16/float32 in host memory; token counts may
            differ per layer (sliding-window layers). Arrays are read in
            place, never copied whole. Or the path of a safetensors KV
            cache as ``kvpack compress`` reads it (HF names
            ``past_key_values.{layer}.key/.value``; its metadata and token
            ids are kept).
        codec: codec name as for the CLI (``kvpack codecs``): ``raw``,
            ``int4``, ``bdr128`` (the default), ``hqmq:s96r4+med3``,
            ``polar:m4n4``, ...
        bits: instead of ``codec``, a budget in bits per element with
            everything counted (as ``kvpack compress --bits``): the planner
            chooses per layer and K/V the codec, its parameters and a sink
            window (so ``sink``/``recent`` must not be given), minimising
            the attention-output error it measures on the cache itself;
            the file never exceeds the budget.
        key_codec: a different codec for the keys (and MLA latents);
            ``codec`` then codes the values only (as ``kvpack compress
            --key-codec``), e.g. ``key_codec="hqmq:s48r4+ctr",
            codec="hqmq:s12r2", sink=1``; unset windows default to the
            larger of the two codecs' own. Not with ``bits``.
        path: write the file there atomically; an existing file is only
            replaced with ``force=True``.
        out: instead, write into this writable contiguous uint8 array
            (size it with :func:`max_size`); ``result.written`` says how
            many bytes.
        sink, recent: tokens kept at source precision at the start and end
            of every layer (default: the codec's own, e.g. InnerQ 32 + 96).
        page_tokens: tokens per page (default 256).
        zstd_level: also zstd-compress each page body when that helps.
        align: page alignment in bytes (64, or 4096 for O_DIRECT/GDS).
        raw_fallback: store a page raw when the codec would make it larger
            (then the size never exceeds :func:`max_size`).
        model: model identity, stored as metadata ``kvpack.model``.
        token_ids: token ids of the cached prefix (prompt-cache identity).
        metadata: extra string metadata.
        dtype: element type of uint16 bit-pattern inputs (``"bf16"`` or
            ``"fp16"``) or of uint8 fp8 codes (``"fp8_e4m3"``,
            ``"fp8_e5m2"``); torch ``float8_e4m3fn`` / ``float8_e5m2``
            tensors need no hint.
        scales: per-tensor scales of fp8 inputs, ``{(layer, "K"|"V"):
            scale}`` (dequantized value = code * scale, vLLM's
            ``k_scale``/``v_scale``); default 1. ``raw`` keeps fp8 codes
            bit-exact; other codecs code the dequantized values.

    Returns:
        A :class:`CompressResult`; ``.data`` holds the file unless ``path``
        or ``out`` was given.

    Raises:
        ParameterError: unknown codec, a shape the codec cannot take,
            non-finite values, an existing ``path`` without ``force``.
        KvpackIOError: the file could not be written.
        ValueError: arrays kvpack cannot read (GPU memory, wrong dtype,
            non-contiguous head_dim axis).
    """
    if bits is not None and codec is not None:
        raise ParameterError("give a codec or bits=, not both")
    if bits is not None and key_codec is not None:
        raise ParameterError("bits= plans every tensor's codec: do not give key_codec")
    codec = "bdr128" if codec is None else codec
    plan = {} if bits is None else {"bits": float(bits)}
    if key_codec is not None:
        plan["key_codec"] = str(key_codec)
    if isinstance(layers, (str, os.PathLike)):
        if model is not None or token_ids is not None or metadata or dtype is not None or scales:
            raise ParameterError(
                "a safetensors input carries its own metadata and token ids: "
                "model, token_ids, metadata and dtype apply to in-memory tensors"
            )
        report, data, written = _native.compress_file(
            os.fspath(layers),
            codec,
            path=None if path is None else os.fsdecode(path),
            force=force,
            out=out,
            raw_fallback=raw_fallback,
            **plan,
            **_window_kwargs(sink, recent, page_tokens, zstd_level, align),
        )
        return CompressResult(data=data, written=written, **report)
    tensors = []
    scales = {(int(l), _kind(k)): float(v) for (l, k), v in (scales or {}).items()}
    for layer, kind, arr in _entries(layers):
        a, hint = _source(arr, dtype)
        s = scales.pop((layer, kind), None)
        tensors.append((layer, kind, a, hint, s) if s is not None else ((layer, kind, a, hint) if hint else (layer, kind, a)))
    if scales:
        raise ParameterError(f"scales given for tensors that are not in the cache: {sorted(scales)}")
    meta = dict(metadata or {})
    bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ParameterError(f"metadata keys and values must be strings: {bad[0]!r} -> {meta[bad[0]]!r}")
    if model is not None:
        meta[MODEL_KEY] = model
    report, data, written = _native.compress(
        tensors,
        codec,
        path=None if path is None else os.fsdecode(path),
        force=force,
        out=out,
        raw_fallback=raw_fallback,
        metadata=meta,
        token_ids=None if token_ids is None else [int(t) for t in token_ids],
        **plan,
        **_window_kwargs(sink, recent, page_tokens, zstd_level, align),
    )
    return CompressResult(data=data, written=written, **report)


@_integers_in_range
def max_size(
    shapes: Mapping[Key, Tuple[int, int, int, int]],
    dtype: str,
    codec: str,
    *,
    sink: Optional[int] = None,
    recent: Optional[int] = None,
    page_tokens: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align: int = 64,
    metadata: Optional[Mapping[str, str]] = None,
    token_ids: int = 0,
) -> int:
    """Upper bound, in bytes, of ``compress(..., raw_fallback=True)`` output
    for tensors of these ``[batch, kv_heads, tokens, head_dim]`` shapes
    ``{(layer, "K"|"V"): shape}``, ``dtype`` and options, exact for the
    file's structure (header, index, every page at its raw size).

    Raises:
        ParameterError: unknown codec or a shape it cannot take.
    """
    tensors = [(int(l), _kind(k), list(map(int, s)), dtype) for (l, k), s in shapes.items()]
    return _native.max_size(
        tensors,
        codec,
        metadata=dict(metadata or {}),
        token_ids=token_ids,
        **_window_kwargs(sink, recent, page_tokens, zstd_level, align),
    )


def _to_output(a: "_native.OwnedArray", output: str) -> ArrayLike:
    if output == "dlpack":
        return a
    if output == "torch":
        import torch

        return torch.from_dlpack(a)
    if output == "numpy":
        if a.dtype == "bf16":
            bits = _np.from_dlpack(a.as_bits())
            bf16 = _ml_bfloat16()
            return bits if bf16 is None else bits.view(bf16)
        return _np.from_dlpack(a)
    raise ParameterError(f"output {output!r}: expected 'numpy', 'torch' or 'dlpack'")


@functools.lru_cache(maxsize=None)
def _ml_bfloat16() -> Any:
    """``ml_dtypes.bfloat16`` when installed, else None (looked up once)."""
    try:
        import ml_dtypes

        return ml_dtypes.bfloat16
    except ImportError:
        return None


def _range(r: Union[None, int, range, Tuple[int, int]], what: str) -> Optional[Tuple[int, int]]:
    if r is None:
        return None
    if isinstance(r, int):
        return (r, r + 1)
    if isinstance(r, range):
        if r.step != 1:
            raise ParameterError(f"{what}: only step-1 ranges")
        return (r.start, r.stop)
    a, b = r
    return (int(a), int(b))


class Archive:
    """An opened kvpack file: memory-mapped from a path, or held in memory
    from ``bytes``. Opening validates the header, index and their
    checksums; decoding validates each page it reads.

    Use :func:`kvpack.open` to create one.
    """

    def __init__(self, source: Union[str, "os.PathLike[str]", bytes]):
        self._a = _native.Archive(source)
        self._infos = [TensorInfo(*t) for t in self._a.tensors()]

    @property
    def tensors(self) -> List[TensorInfo]:
        """The tensor table (latest commit's token counts), layer-major."""
        return list(self._infos)

    @property
    def num_layers(self) -> int:
        """One more than the largest layer index."""
        return max((t.layer for t in self._infos), default=-1) + 1

    @property
    def metadata(self) -> Dict[str, str]:
        """Header metadata."""
        return dict(self._a.metadata())

    @property
    def model(self) -> Optional[str]:
        """The model identity (``kvpack.model`` metadata), if recorded."""
        return self._a.metadata().get(MODEL_KEY)

    @property
    def token_ids(self) -> List[int]:
        """Token ids of the cached prefix (empty when not recorded)."""
        return list(self._a.token_ids())

    @property
    def codecs(self) -> List[str]:
        """Canonical names of the file's codecs (e.g. ``["bdr128", "raw"]``)."""
        return list(self._a.codecs())

    @property
    def version(self) -> Tuple[int, int]:
        """Format version ``(major, minor)`` of the file."""
        return tuple(self._a.version())  # type: ignore[return-value]

    def index(self, layer: int, kind: str) -> int:
        """Position of ``(layer, kind)`` in :attr:`tensors`.

        Raises:
            ParameterError: the file has no such tensor.
        """
        kind = _kind(kind)
        for i, t in enumerate(self._infos):
            if t.layer == layer and t.kind == kind:
                return i
        raise ParameterError(f"the file has no tensor for layer {layer} {kind}")

    @_integers_in_range
    def decode(
        self,
        layers: Union[None, int, range, Tuple[int, int]] = None,
        kind: Optional[str] = None,
        tokens: Optional[Tuple[int, int]] = None,
        dtype: Optional[str] = None,
        output: str = "numpy",
    ) -> Dict[Key, ArrayLike]:
        """Decodes (part of) the cache into new arrays.

        Args:
            layers: a layer, a ``range`` or ``(start, stop)``; all if None.
            kind: ``"K"``, ``"V"``, ``"L"`` (MLA latents) or None for all.
            tokens: ``(start, stop)`` cache slots of each layer (clamped to
                the layer's token count); all if None.
            dtype: output element type ``"bf16"``, ``"fp16"``, ``"fp32"``,
                ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (default: the source's).
                fp8 outputs come back as uint8 codes quantized with the
                source tensor's scale (scale 1 for a non-fp8 source).
            output: ``"numpy"`` (bf16 as ``ml_dtypes.bfloat16`` when
                installed, else uint16 bit patterns), ``"torch"`` or
                ``"dlpack"``. The arrays own Rust memory: no copy.

        Returns:
            ``{(layer, "K"|"V"): array}`` of ``[batch, kv_heads, tokens,
            head_dim]``.

        Raises:
            FormatError: a selected page is corrupted (names the page).
        """
        got = self._a.decode(
            layers=_range(layers, "layers"),
            kind=None if kind is None else _kind(kind),
            tokens=_range(tokens, "tokens"),
            dtype=dtype,
        )
        return {(layer, k): _to_output(a, output) for layer, k, a in got}

    @_integers_in_range
    def decode_into(
        self,
        out: Mapping[Key, ArrayLike],
        tokens: Optional[Tuple[int, int]] = None,
        dtype: Optional[str] = None,
    ) -> None:
        """Decodes into caller-owned arrays, without copies.

        Args:
            out: ``{(layer, "K"|"V"): array}``; each array is a writable
                host tensor ``[batch, kv_heads, n, head_dim]`` (or 3-d) of
                bf16/fp16/fp32, any strides with a contiguous head_dim
                axis, receiving ``n`` tokens starting at ``tokens[0]``.
            tokens: ``(start, stop)``; only ``start`` is used (the arrays
                give the counts). Default 0.
            dtype: element type of uint16 bit-pattern outputs.

        Raises:
            ParameterError: an array's shape does not match the file.
            FormatError: a page is corrupted.
        """
        first = 0 if tokens is None else int(tokens[0])
        outs = []
        for (layer, kind), arr in out.items():
            a, hint = _source(arr, dtype)
            k = _kind(kind)
            outs.append((int(layer), k, first, a, hint) if hint else (int(layer), k, first, a))
        self._a.decode_into(outs)

    def __repr__(self) -> str:
        return f"<kvpack.Archive {len(self._infos)} tensors, codecs {self.codecs}, model {self.model!r}>"


def open(source: Union[str, "os.PathLike[str]", bytes]) -> Archive:  # noqa: A001 (mirrors io.open)
    """Opens a kvpack file (a path is memory-mapped) or ``bytes``.

    Raises:
        FormatError: not a valid kvpack file (names the structure at fault).
        KvpackIOError: the file cannot be read.
    """
    return Archive(source)


def codecs() -> List[Tuple[str, str, str]]:
    """The codec families: ``(name, syntax, summary)`` for each."""
    return [(name, syntax, summary) for _id, name, syntax, summary in _native.codec_families()]


# --- chunks: stores that key KV by chunk (LMCache, SGLang HiCache) --------

_LAYOUTS = ("lmcache",)


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ParameterError(f"layout {layout!r}: expected one of {_LAYOUTS}")


def _chunk_dims(shape: Sequence[int], head_dim: int) -> Tuple[int, int, int]:
    """(layers, tokens, kv_heads) of an LMCache chunk ``[2, L, T, H*D]``."""
    if len(shape) != 4 or shape[0] != 2:
        raise ParameterError(f"chunk shape {tuple(shape)}: expected [2, layers, tokens, kv_heads*head_dim]")
    _, layers, tokens, hidden = (int(x) for x in shape)
    if head_dim <= 0 or hidden % head_dim:
        raise ParameterError(f"chunk hidden size {hidden} is not a multiple of head_dim {head_dim}")
    return layers, tokens, hidden // head_dim


def _chunk_views(chunk: ArrayLike, head_dim: int) -> List[Tuple[int, str, ArrayLike]]:
    layers, tokens, heads = _chunk_dims(tuple(chunk.shape), head_dim)
    views = []
    for layer in range(layers):
        for kv, kind in ((0, "K"), (1, "V")):
            # [T, H*D] -> [H, T, D]: a strided view, no copy.
            views.append((layer, kind, chunk[kv][layer].reshape(tokens, heads, head_dim).swapaxes(0, 1)))
    return views


@functools.lru_cache(maxsize=256)
def _chunk_bound(shape, dtype, codec, head_dim, sink, recent, page_tokens, zstd_level, align, meta) -> int:
    layers, tokens, heads = _chunk_dims(shape, head_dim)
    shapes = {(l, k): (1, heads, tokens, head_dim) for l in range(layers) for k in ("K", "V")}
    return max_size(
        shapes,
        dtype,
        codec,
        sink=sink,
        recent=recent,
        page_tokens=page_tokens,
        zstd_level=zstd_level,
        align=align,
        metadata=dict(meta),
    )


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, _np.dtype) or (isinstance(dtype, type) and issubclass(dtype, _np.generic)):
        name = _np.dtype(dtype).name  # np.float16, np.dtype("float16")
    else:
        name = str(dtype).replace("torch.", "").replace("numpy.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(name, name)


@_integers_in_range
def chunk_max_size(
    shape: Sequence[int],
    dtype: Any,
    codec: str,
    *,
    head_dim: int,
    layout: str = "lmcache",
    sink: int = 0,
    recent: int = 0,
    page_tokens: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align: int = 64,
    metadata: Optional[Mapping[str, str]] = None,
) -> int:
    """Upper bound, in bytes, of :func:`encode_chunk`'s output for a chunk
    of ``shape`` (``[2, layers, tokens, kv_heads*head_dim]`` for
    ``layout="lmcache"``) and ``dtype`` (``"bf16"``, ``torch.bfloat16``,
    ``numpy.float16``, ...) with the same options. Guaranteed: a chunk
    never encodes larger. For codecs whose page size depends only on the
    shape (every codec but ``hqmq:...+med``) and no zstd, it is the exact
    size; otherwise pages count at their raw size. Cached per distinct
    arguments.

    Raises:
        ParameterError: bad shape, unknown codec or one that cannot take
            the shape.
    """
    _check_layout(layout)
    return _chunk_bound(
        tuple(int(x) for x in shape),
        _dtype_name(dtype),
        codec,
        int(head_dim),
        sink,
        recent,
        page_tokens,
        zstd_level,
        align,
        tuple(sorted((metadata or {}).items())),
    )


@_integers_in_range
def encode_chunk(
    chunk: ArrayLike,
    codec: str,
    *,
    head_dim: int,
    layout: str = "lmcache",
    out: Optional[ArrayLike] = None,
    sink: int = 0,
    recent: int = 0,
    page_tokens: Optional[int] = None,
    zstd_level: Optional[int] = None,
    align: int = 64,
    metadata: Optional[Mapping[str, str]] = None,
) -> Union[bytes, int]:
    """Encodes one chunk as a complete kvpack file (``kvpack inspect``
    opens it).

    Args:
        chunk: ``[2, layers, tokens, kv_heads*head_dim]`` (K then V) for
            ``layout="lmcache"``, bf16/fp16/fp32 host memory, read in place.
        codec: codec name.
        head_dim: elements per head vector (splits the hidden axis).
        out: a writable contiguous uint8 array of at least
            :func:`chunk_max_size` bytes to write into; then the byte
            count is returned instead of ``bytes``.
        sink, recent, page_tokens, zstd_level, align, metadata: as for
            :func:`compress`, and as given to :func:`chunk_max_size`.

    Raises:
        ParameterError: bad shape, codec, or ``out`` too small.
    """
    _check_layout(layout)
    res = compress(
        {(l, k): v for l, k, v in _chunk_views(chunk, int(head_dim))},
        codec,
        out=out,
        sink=sink,
        recent=recent,
        page_tokens=page_tokens,
        zstd_level=zstd_level,
        align=align,
        raw_fallback=True,
        metadata=metadata,
    )
    return res.written if out is not None else res.data  # type: ignore[return-value]


@_integers_in_range
def decode_chunk(data: Union[bytes, ArrayLike], out: ArrayLike, *, head_dim: Optional[int] = None, layout: str = "lmcache") -> None:
    """Decodes a chunk written by :func:`encode_chunk` into ``out``, a
    preallocated writable chunk of the same shape (any of bf16/fp16/fp32),
    without copies.

    Args:
        data: the encoded chunk: ``bytes`` or a contiguous uint8 array
            (read in place).
        out: ``[2, layers, tokens, kv_heads*head_dim]`` for ``"lmcache"``.
        head_dim: elements per head vector (default: read from the file).

    Raises:
        FormatError: corrupted or truncated data (names the page).
        ParameterError: ``out`` does not match the encoded chunk.
    """
    _check_layout(layout)
    table = _native.tensor_table(data)
    if not table:
        raise FormatError("the chunk holds no tensors")
    if head_dim is None:
        head_dim = table[0][7]
    layers, tokens, heads = _chunk_dims(tuple(out.shape), int(head_dim))
    # The whole chunk, no more and no less (decode_bytes_into would fill a
    # smaller output with the leading tokens or layers).
    stored = {(t[1], t[2]): (t[4], t[5], t[6], t[7]) for t in table}
    want = {(l, k): (1, heads, tokens, int(head_dim)) for l in range(layers) for k in ("K", "V")}
    if stored != want:
        got = sorted(stored.items())[:2]
        raise ParameterError(
            f"out {tuple(out.shape)} (layers {layers}, tokens {tokens}, kv heads {heads}, head_dim {head_dim}) "
            f"does not match the chunk's {len(stored)} tensors (first: {got})"
        )
    outs = [(l, k, 0, v) for l, k, v in _chunk_views(out, int(head_dim))]
    _native.decode_bytes_into(data, outs)
