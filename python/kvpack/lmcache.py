"""kvpack as an LMCache serde: LMCache KV chunks stored as kvpack files.

LMCache (v1 distributed storage, tested with ``lmcache==0.5.6``) moves KV
chunks between its CPU memory tier (L1) and its storage back ends (L2: local
disk, S3, Redis, ...) through *serde processors* selected per back end in
JSON config. This module is such a serde. Register it once per process,
before LMCache builds its storage manager::

    import kvpack.lmcache
    kvpack.lmcache.register()          # name "kvpack"; idempotent

then select it in an L2 adapter's config::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "kvpack", "codec": "bdr128", "head_dim": 128}}

Every stored object is one complete kvpack file (``kvpack inspect`` opens
it), holding one chunk. Chunks are LMCache's "MP layout" memory objects:

- shape ``[2, num_layers, tokens, kv_heads * head_dim]`` (index 0 of the
  first axis is K, 1 is V; LMCache's chunks hold 256 tokens, the last chunk
  of a prompt may hold fewer),
- dtype ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``,
- in CPU memory (LMCache's L1 tier).

``head_dim`` cannot be read off that shape (LMCache merges heads into one
axis), so the config must give it; ``kv_heads`` is then
``shape[3] // head_dim``.

Config keys (everything beside ``"type"`` in the ``"serde"`` object):

==============  =========  ===================================================
key             default    meaning
==============  =========  ===================================================
``codec``       "bdr128"   kvpack codec name, as listed by ``kvpack codecs``
``head_dim``    (required) per-head width of the model's K/V vectors
``sink``        0          leading tokens of each chunk kept exact (raw)
``recent``      0          trailing tokens of each chunk kept exact (raw)
``pad``         true       zero-fill each object up to its layout's size
``max_workers`` 1          threads of LMCache's async serde processor
==============  =========  ===================================================

Sizes. LMCache 0.5.6 gives every object of one chunk layout (shape and
dtype) the same size, ``estimate_serialized_size``, and reads back exactly
that many bytes (its local-disk back end counts a shorter file as a miss),
although the serde contract lets ``serialize`` return fewer. So the size of
a layout is what every stored object of it occupies:
:func:`kvpack.chunk_max_size`, computed from the shape alone. For every
codec whose output size depends only on the shape (raw, int, bdr, hqmq
without ``+med``, octopus, turbo, polar, innerq, kivi) that is the exact
encoded size, so objects are stored without padding; for ``+med`` outlier
tables it is a guaranteed bound (pages count at their raw size).

With ``pad`` the serializer zero-fills the object after the kvpack file up
to the layout's size and reports that size; the deserializer finds the
file's end (a kvpack file ends with its 8-byte magic) and ignores the zeros,
and ``kvpack inspect`` reads such an object as the file followed by an
ignored zero tail. Set ``"pad": false`` only for a store that keeps each
object's true length (LMCache 0.5.6's do not).

The method signatures accept both LMCache interface generations:
``serialize(src, dst, key)`` / ``deserialize(src, dst, key)`` (0.5.x) and
the same calls without ``key`` (other releases and third-party callers).

This module imports neither ``lmcache`` nor ``torch`` at import time;
:func:`register` and :func:`create_serde_processor` import ``lmcache``.
All encoding and decoding is done by :func:`kvpack.encode_chunk` and
:func:`kvpack.decode_chunk`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvpack

__all__ = [
    "SERDE_NAME",
    "KvpackDeserializer",
    "KvpackSerdeConfig",
    "KvpackSerializer",
    "LayoutSizes",
    "create_serde_processor",
    "file_length",
    "register",
]

#: The serde type name registered with LMCache by :func:`register`.
SERDE_NAME = "kvpack"

# Every complete kvpack file ends with these 8 bytes (its trailer's magic).
_MAGIC = b"\x89KVP\r\n\x1a\n"
# Block size of the backward scan over zero padding, bytes.
_SCAN_BLOCK = 1 << 16
# LMCache "MP layout" chunk axis 0: K and V.
_LAYOUT = "lmcache"

_DTYPE_NAMES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
}


def _param_error(message: str) -> Exception:
    return kvpack.ParameterError(message)


def _int_field(values: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int:
    value = values.get(name, default)
    if value is None:
        raise _param_error(f"kvpack serde config: {name!r} is required (an integer >= {minimum})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _param_error(
            f"kvpack serde config: {name!r} must be an integer, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise _param_error(f"kvpack serde config: {name!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class KvpackSerdeConfig:
    """The ``"serde"`` JSON object of an LMCache L2 adapter, validated.

    Attributes:
        codec: kvpack codec name (``"raw"``, ``"int4"``, ``"bdr128"``, ...).
        head_dim: per-head width of K and V vectors (elements); the chunk's
            last axis must be a multiple of it.
        sink: leading tokens of every chunk stored exactly (>= 0).
        recent: trailing tokens of every chunk stored exactly (>= 0).
        pad: zero-fill every serialized object up to its layout's size.
        max_workers: thread-pool size of LMCache's ``AsyncSerdeProcessor``
            (>= 1; kvpack releases the GIL while it encodes and decodes).
    """

    codec: str = "bdr128"
    head_dim: int = 0
    sink: int = 0
    recent: int = 0
    pad: bool = True
    max_workers: int = 1

    _KEYS = ("codec", "head_dim", "sink", "recent", "pad", "max_workers")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KvpackSerdeConfig:
        """Validate the type-specific keys LMCache forwards to the factory.

        Args:
            values: the ``"serde"`` object without its ``"type"`` key
                (``"type"`` itself is tolerated and ignored).

        Returns:
            The validated config. The codec name is checked against this
            kvpack build by sizing a one-token chunk.

        Raises:
            kvpack.ParameterError: (a ``ValueError``) for an unknown key, a
                missing ``head_dim``, a value of the wrong type or range, or
                a codec this build does not know.
        """
        unknown = sorted(set(values) - set(cls._KEYS) - {"type"})
        if unknown:
            raise _param_error(
                f"kvpack serde config: unknown key(s) {unknown}; known keys: {list(cls._KEYS)}"
            )
        codec = values.get("codec", "bdr128")
        if not isinstance(codec, str) or not codec:
            raise _param_error(f"kvpack serde config: 'codec' must be a codec name, got {codec!r}")
        pad = values.get("pad", True)
        if not isinstance(pad, bool):
            raise _param_error(f"kvpack serde config: 'pad' must be true or false, got {pad!r}")
        config = cls(
            codec=codec,
            head_dim=_int_field(values, "head_dim", None, 1),
            sink=_int_field(values, "sink", 0, 0),
            recent=_int_field(values, "recent", 0, 0),
            pad=pad,
            max_workers=_int_field(values, "max_workers", 1, 1),
        )
        # Fail at config time, not at the first store: an unknown codec or a
        # head_dim the codec cannot take raises kvpack.ParameterError here.
        config.max_size((2, 1, 1, config.head_dim), "bf16")
        return config

    def encode(self, chunk: Any, out: np.ndarray) -> int:
        """:func:`kvpack.encode_chunk` of ``chunk`` into ``out`` with this
        config; returns the byte count."""
        return kvpack.encode_chunk(
            chunk,
            self.codec,
            head_dim=self.head_dim,
            layout=_LAYOUT,
            out=out,
            sink=self.sink,
            recent=self.recent,
        )

    def max_size(self, shape: tuple[int, ...], dtype: str) -> int:
        """Upper bound of the serialized size of one chunk, bytes.

        Args:
            shape: chunk shape ``(2, num_layers, tokens, kv_heads * head_dim)``.
            dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

        Raises:
            kvpack.ParameterError: bad shape, dtype or codec.
        """
        return kvpack.chunk_max_size(
            shape,
            dtype,
            self.codec,
            head_dim=self.head_dim,
            layout=_LAYOUT,
            sink=self.sink,
            recent=self.recent,
        )


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(str(dtype))
    if name is None:
        raise _param_error(
            f"kvpack serde: LMCache chunk dtype {dtype} is not supported "
            "(expected torch.bfloat16, torch.float16 or torch.float32)"
        )
    return name


def _single_layout(layout_desc: Any) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of a one-group ``MemoryLayoutDesc``."""
    shapes = list(layout_desc.shapes)
    dtypes = list(layout_desc.dtypes)
    if len(shapes) != 1 or len(dtypes) != 1:
        raise _param_error(
            f"kvpack serde: a memory layout with {len(shapes)} shape groups is not "
            "supported (expected one [2, num_layers, tokens, kv_heads*head_dim] group)"
        )
    return tuple(int(d) for d in shapes[0]), _dtype_name(dtypes[0])


def _tensor(obj: Any, role: str) -> Any:
    tensor = obj.tensor
    if tensor is None:
        raise _param_error(f"kvpack serde: the {role} memory object has no tensor (invalidated?)")
    return tensor


def _byte_array(obj: Any, role: str, used: bool) -> np.ndarray:
    """Flat uint8 numpy view (no copy) of a CPU byte-buffer MemoryObj.

    ``used`` limits the view to ``obj.get_size()`` bytes, the logical size.
    """
    tensor = _tensor(obj, role)
    if tensor.device.type != "cpu":
        raise kvpack.UnsupportedError(
            f"kvpack serde: the {role} byte buffer is on {tensor.device}; "
            "LMCache serde buffers are expected in CPU memory"
        )
    if str(tensor.dtype) != "torch.uint8" or not tensor.is_contiguous():
        raise _param_error(
            f"kvpack serde: the {role} byte buffer must be a contiguous torch.uint8 "
            f"tensor, got {tensor.dtype} with strides {tuple(tensor.stride())}"
        )
    array = tensor.reshape(-1).numpy()
    return array[: obj.get_size()] if used else array


def file_length(buffer: np.ndarray) -> int:
    """Length of the kvpack file at the start of ``buffer``, bytes.

    ``buffer`` holds one kvpack file, optionally followed by zero bytes (the
    padding :class:`KvpackSerializer` writes with ``pad``). A kvpack file
    ends with its 8-byte magic, so the file ends at the last non-zero byte.

    Args:
        buffer: 1-d ``uint8`` array.

    Returns:
        The file length ``n``; ``buffer[:n]`` is the file.

    Raises:
        kvpack.FormatError: the bytes before the zero tail do not end with
            the kvpack magic (not a kvpack file, or a truncated one).
    """
    end = int(buffer.size)
    while end > 0:
        start = max(0, end - _SCAN_BLOCK)
        nonzero = np.flatnonzero(buffer[start:end])
        if nonzero.size:
            end = start + int(nonzero[-1]) + 1
            break
        end = start
    if end < len(_MAGIC) or bytes(buffer[end - len(_MAGIC) : end]) != _MAGIC:
        raise kvpack.FormatError(
            f"kvpack serde: the stored object ({buffer.size} bytes, {buffer.size - end} "
            "trailing zero bytes) does not end with a kvpack file: no end magic",
            f"stored object, bytes {max(0, end - len(_MAGIC))}..{end}",
        )
    return end


class LayoutSizes:
    """Stored size of every chunk of a layout: :func:`kvpack.chunk_max_size`
    (exact where the codec's output size depends only on the shape), cached
    per layout. Thread safe.

    Args:
        config: the validated serde config (codec, windows).
    """

    def __init__(self, config: KvpackSerdeConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._sizes: dict[tuple[tuple[int, ...], str], int] = {}

    def get(self, shape: tuple[int, ...], dtype: str) -> int:
        """Bytes every serialized chunk shaped ``shape`` in ``dtype`` occupies.

        Raises:
            kvpack.ParameterError: bad shape, dtype or codec.
        """
        layout = (shape, dtype)
        with self._lock:
            size = self._sizes.get(layout)
            if size is None:
                size = self._sizes[layout] = self.config.max_size(shape, dtype)
            return size


class KvpackSerializer:
    """LMCache ``Serializer``: one KV chunk in, one kvpack file out.

    Args:
        config: the validated serde config.
    """

    def __init__(self, config: KvpackSerdeConfig) -> None:
        self.config = config
        self.sizes = LayoutSizes(config)

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        """Bytes LMCache allocates, stores and loads for one chunk.

        Args:
            layout_desc: LMCache ``MemoryLayoutDesc`` of the source chunk:
                one shape ``[2, num_layers, tokens, kv_heads * head_dim]``
                and one dtype (bf16, fp16 or fp32).

        Returns:
            The layout's size, :func:`kvpack.chunk_max_size`: the exact
            encoded size where the codec's output size depends on the shape
            only, else a guaranteed upper bound.

        Raises:
            kvpack.ParameterError: more than one shape group, an unsupported
                dtype, a first axis other than 2, or a last axis that is not
                a multiple of ``head_dim``.
        """
        shape, dtype = _single_layout(layout_desc)
        return self.sizes.get(shape, dtype)

    def serialize(self, src: Any, dst: Any, key: Any = None) -> int:
        """Encode ``src``'s chunk as a kvpack file into ``dst``'s bytes.

        Args:
            src: LMCache ``MemoryObj`` holding the chunk tensor
                ``[2, num_layers, tokens, kv_heads * head_dim]`` (bf16, fp16
                or fp32, CPU). Read only.
            dst: LMCache ``MemoryObj`` byte buffer (uint8, CPU) of at least
                ``estimate_serialized_size`` bytes.
            key: LMCache ``ObjectKey`` of the chunk, or absent. Unused: the
                encoding depends on the data and the config only.

        Returns:
            Bytes of ``dst`` that hold the object: with ``pad`` the layout's
            size (the kvpack file, then zeros), else the file's length.

        Raises:
            kvpack.ParameterError: bad shape or dtype, or ``dst`` smaller
                than the layout's size.
            kvpack.UnsupportedError: ``dst`` is not in CPU memory.
            kvpack.KvpackError: any other encoder error.
        """
        del key
        chunk = _tensor(src, "source")
        size = self.sizes.get(tuple(int(d) for d in chunk.shape), _dtype_name(chunk.dtype))
        out = _byte_array(dst, "destination", used=False)
        if out.size < size:
            raise _param_error(
                f"kvpack serde: destination buffer holds {out.size} bytes, the chunk needs {size}"
            )
        written = self.config.encode(chunk, out[:size])
        if not self.config.pad:
            return int(written)
        out[written:size] = 0
        return size


class KvpackDeserializer:
    """LMCache ``Deserializer``: one stored kvpack file in, one KV chunk out.

    Args:
        config: the validated serde config (the codec is read from the file,
            so the deserializer decodes what any kvpack config stored).
    """

    def __init__(self, config: KvpackSerdeConfig) -> None:
        self.config = config

    def deserialize(self, src: Any, dst: Any, key: Any = None) -> None:
        """Decode the kvpack file in ``src`` into ``dst``'s chunk tensor.

        Args:
            src: LMCache ``MemoryObj`` byte buffer (uint8, CPU) holding one
                kvpack file, optionally followed by zero padding; its logical
                size (``get_size()``) bounds what is read.
            dst: LMCache ``MemoryObj`` whose tensor receives the chunk:
                ``[2, num_layers, tokens, kv_heads * head_dim]``, the shape
                that was stored, any of bf16, fp16, fp32. Written in place.
            key: LMCache ``ObjectKey``, or absent. Unused.

        Raises:
            kvpack.FormatError: ``src`` does not hold a valid kvpack file
                (bad magic, CRC mismatch, truncation).
            kvpack.ParameterError: ``dst`` has another shape than the stored
                chunk.
            kvpack.UnsupportedError: ``src`` is not in CPU memory.
        """
        del key
        data = _byte_array(src, "source", used=True)
        kvpack.decode_chunk(data[: file_length(data)], _tensor(dst, "destination"), layout=_LAYOUT)


_register_lock = threading.Lock()
_registered: set[str] = set()


def create_serde_processor(kwargs: Mapping[str, Any]) -> Any:
    """LMCache serde factory: config dict in, ``AsyncSerdeProcessor`` out.

    Args:
        kwargs: the ``"serde"`` JSON object without ``"type"`` (see the
            module docstring for its keys).

    Returns:
        ``lmcache.v1.distributed.serde.AsyncSerdeProcessor`` wrapping a
        :class:`KvpackSerializer` and a :class:`KvpackDeserializer`.

    Raises:
        kvpack.ParameterError: invalid config.
        ImportError: ``lmcache`` is not installed.
    """
    from lmcache.v1.distributed.serde import AsyncSerdeProcessor

    _declare_interfaces()
    config = KvpackSerdeConfig.from_dict(kwargs)
    return AsyncSerdeProcessor(
        KvpackSerializer(config),
        KvpackDeserializer(config),
        max_workers=config.max_workers,
    )


def _declare_interfaces() -> None:
    """Make the classes virtual subclasses of LMCache's serde ABCs."""
    from lmcache.v1.distributed.serde import Deserializer, Serializer

    Serializer.register(KvpackSerializer)
    Deserializer.register(KvpackDeserializer)


def register(name: str = SERDE_NAME) -> None:
    """Register the kvpack serde with LMCache's serde factory.

    Call once in every process that builds an LMCache storage manager,
    before it reads its L2 adapter config. Calling again with the same name
    does nothing.

    Args:
        name: the ``"type"`` value that selects this serde in JSON config.

    Raises:
        ImportError: ``lmcache`` is not installed (its message says so).
        ValueError: ``name`` is already registered by another serde.
    """
    try:
        from lmcache.v1.distributed.serde import (
            get_registered_serde_types,
            register_serde_factory,
        )
    except ImportError as err:
        raise ImportError(
            "kvpack.lmcache.register() needs the lmcache package (tested: pip install lmcache==0.5.6)"
        ) from err
    with _register_lock:
        if name in _registered:
            return
        if name in get_registered_serde_types():
            raise ValueError(f"LMCache serde type {name!r} is already registered by another serde")
        _declare_interfaces()
        register_serde_factory(name, create_serde_processor)
        _registered.add(name)
