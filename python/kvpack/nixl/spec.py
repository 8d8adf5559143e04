"""What a handoff moves (:class:`HandoffSpec`), how it fails (:class:`TransferError`) and its per-layer timings (:class:`LayerStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence, Tuple


from .. import max_size as _max_size
from ..errors import KvpackError, ParameterError

#: Cache layouts (as for :mod:`kvpack.cuda`): ``"flash_attn"`` one tensor
#: ``[2, num_blocks, block_size, kv_heads, head_dim]``; ``"flashinfer"``
#: ``[num_blocks, 2, block_size, kv_heads, head_dim]``; ``"hnd"`` a pair
#: ``(k, v)`` each ``[num_blocks, kv_heads, block_size, head_dim]``.
LAYOUTS = ("flash_attn", "flashinfer", "hnd")

_ALIGN = 4096


class TransferError(KvpackError):
    """A layer of a handoff did not arrive intact.

    Attributes:
        request: the request id.
        layer: the layer index.
        blocks: the decode side's block ids (from its block table) that hold
            no valid KV for this layer and must be recomputed (on the
            prefill side: every block of the decode side's table, from the
            ticket).
        tokens: the damaged token ranges ``[(start, stop), ...]``.
        cause: ``"corrupt"`` (a frame failed validation), ``"transfer"``
            (NIXL reported the write failed), ``"timeout"`` or ``"peer"``
            (the other side reported a failure).
    """

    def __init__(
        self,
        message: str,
        *,
        request: str,
        layer: int,
        blocks: Sequence[int] = (),
        tokens: Sequence[Tuple[int, int]] = (),
        cause: str,
    ):
        super().__init__(f"request {request} layer {layer}: {message}")
        self.request = request
        self.layer = layer
        self.blocks = list(blocks)
        self.tokens = list(tokens)
        self.cause = cause


@dataclass(frozen=True)
class HandoffSpec:
    """What one request hands off: the same on both sides.

    Attributes:
        model: model identity (both sides must agree; checked on accept).
        codec: kvpack codec name (``kvpack.codecs()``), e.g. ``"bdr128"``.
        num_layers: layers (0..num_layers are sent).
        kv_heads: KV heads per layer.
        head_dim: elements per head vector.
        num_tokens: tokens of the prefix (at least 1).
        block_size: tokens per cache block (the paged cache's).
        dtype: element type of the caches: ``"bf16"``, ``"fp16"`` or
            ``"fp32"`` (CUDA caches: bf16/fp16).
        page_tokens, sink, recent: kvpack layout options (None: kvpack's
            defaults, 256 tokens per page and the codec's own windows).
    """

    model: str
    codec: str
    num_layers: int
    kv_heads: int
    head_dim: int
    num_tokens: int
    block_size: int
    dtype: str = "bf16"
    page_tokens: Optional[int] = None
    sink: Optional[int] = None
    recent: Optional[int] = None

    def __post_init__(self) -> None:
        for f in ("num_layers", "kv_heads", "head_dim", "num_tokens", "block_size"):
            if int(getattr(self, f)) < 1:
                raise ParameterError(f"HandoffSpec.{f} = {getattr(self, f)}: must be at least 1")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ParameterError(f"HandoffSpec.dtype {self.dtype!r}: expected 'bf16', 'fp16' or 'fp32'")

    def num_blocks(self) -> int:
        """Blocks holding ``num_tokens``: ``ceil(num_tokens / block_size)``."""
        return -(-self.num_tokens // self.block_size)

    def slot_bytes(self) -> int:
        """Bytes reserved per layer: the kvpack bound of one layer's file
        (``kvpack.max_size`` with ``raw_fallback=True``), rounded up to 4 KiB.

        Raises:
            ParameterError: a codec that cannot take the shape.
        """
        shape = (1, self.kv_heads, self.num_tokens, self.head_dim)
        n = _max_size(
            {(0, "K"): shape, (0, "V"): shape},
            self.dtype,
            self.codec,
            sink=self.sink,
            recent=self.recent,
            page_tokens=self.page_tokens,
        )
        return -(-n // _ALIGN) * _ALIGN

    def to_json(self) -> Dict[str, Any]:
        """The spec as a JSON-able dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "HandoffSpec":
        """Inverse of :meth:`to_json`.

        Raises:
            ParameterError: missing or unknown fields.
        """
        try:
            return cls(**d)
        except TypeError as e:
            raise ParameterError(f"bad handoff spec {d!r}: {e}") from None


@dataclass
class LayerStats:
    """Per-layer timestamps (``time.perf_counter()`` seconds) and sizes."""

    layer: int
    frame_bytes: int = 0
    encode_start: float = 0.0  #: prefill side (on the decode side: from the notification)
    encode_end: float = 0.0  #: prefill side only
    posted: float = 0.0  #: prefill side: the WRITE was posted
    landed: float = 0.0  #: decode side: the notification arrived (collected by the agent's polling thread)
    decode_start: float = 0.0
    decode_end: float = 0.0
    done: float = 0.0  #: prefill side: NIXL reported the write complete
