"""Prefill-to-decode KV handoff over NIXL, compressed in flight.

Disaggregated serving computes a request's KV cache on a prefill worker and
moves it to a decode worker. This module moves it as kvpack page frames
(each page with its header and CRCs, in the codec you choose) through
`NIXL <https://github.com/ai-dynamo/nixl>`_, the transfer library behind
vLLM's ``NixlConnector``, Dynamo and SGLang: NIXL agents, NIXL's metadata
exchange and NIXL notifications; kvpack adds only the encoding, the
validation and the decoding. Install NIXL with ``pip install nixl`` (or
``nixl-cu13`` / ``nixl-cu12``); without it every call raises
:class:`~kvpack.UnsupportedError`.

Per request, one layer at a time::

    prefill worker                           decode worker
    --------------                           -------------
    tx = Sender("prefill-0", port=5600)      rx = Receiver("decode-0", port=5601)
                                             rx.connect("prefill-0", host, 5600)
                                             inc = rx.expect(spec, block_ids,
                                                             peer="prefill-0")
    out = tx.accept()          <-- ticket (NIXL notification) ---
    for layer in range(L):                   for layer in range(L):
        (layer's attention done)                 inc.decode_layer(layer, cache[layer])
        out.send_layer(layer, cache[layer], block_ids)
    out.finish()                             inc.close()

* **Metadata.** :class:`HandoffSpec` carries the model identity, codec,
  token count, layer count, KV shape, dtype and block size. The decode side
  sends it, with its block table, the place of its landing buffer and
  NIXL's partial agent metadata for that buffer, in a *ticket*, a NIXL
  notification (``kvpack/req``) to the prefill agent, which checks the model
  and shape against its own before it writes anything. Agents first learn each other through NIXL's
  listener (:meth:`Receiver.connect`: ``fetch_remote_metadata`` +
  ``send_local_metadata``) or by handing ``metadata()`` blobs to
  ``add_peer`` through any channel the engine already has.
* **Per layer, prefill side** (:meth:`Outgoing.send_layer`): encodes the
  layer's K and V (tokens ``0..num_tokens`` of the block table) into a
  complete one-layer kvpack file in a registered staging slot (on the GPU
  with :func:`kvpack.cuda.encode_paged` for CUDA caches, with the CPU codecs
  for host caches), then posts one NIXL WRITE of exactly those bytes into
  the decode side's landing slot for that layer, carrying the notification
  ``kvpack/layer``. The call returns once the write is posted; encoding the
  next layer overlaps the wire.
* **Per layer, decode side** (:meth:`Incoming.decode_layer`): waits for the
  layer's notification (NIXL delivers it after the data has landed),
  validates every page (header CRC, body CRC, index) and decodes straight
  into the layer's paged cache (:func:`kvpack.cuda.decode_paged` for CUDA
  caches, the CPU decoders into host arrays).
* **Errors.** A write that NIXL reports failed, a prefill side that gives up
  (it sends ``kvpack/fail``), a timeout, or a frame that fails validation
  raises :class:`TransferError` naming the request, the layer, the damaged
  token ranges and the decode side's **blocks to recompute**. Pages that
  validated are still decoded, so only those blocks hold no valid KV for
  that layer (for CUDA caches the layer decodes all or nothing: every block
  of the layer is named). Wrong KV is never left silently in the cache.

Buffers: the decode side registers a landing buffer per request with one
slot per layer, each of :meth:`HandoffSpec.slot_bytes` (the kvpack bound of
one layer's file: about the compressed size for fixed-rate codecs). The
prefill side registers a staging buffer of the same size. Closed requests'
buffers stay registered for the next request (two per agent). Both are host DRAM
by default; ``memory="VRAM"`` puts them in GPU memory so that NIXL moves
GPU to GPU (GPUDirect RDMA where the NIC supports it). kvpack's CUDA
encoder and decoder stage page frames through host memory today (CRCs are
checked on the CPU), so with VRAM buffers each side adds one PCIe copy of
the compressed frames.

Threads: each agent has a polling thread (NIXL notifications; every
0.2 ms while a request is open, about 5% of a core, else every 5 ms) and
each outgoing request a thread that posts its writes (when due, with
``link_gbit`` pacing) and polls them to completion. NIXL's own progress
thread is off by default (``progress_thread=True`` turns it on).

Timing (``stats``) uses ``time.perf_counter()`` which on Linux is the
system-wide monotonic clock, so both sides' stamps on one machine compare.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from . import max_size as _max_size
from .errors import FormatError, KvpackError, ParameterError, UnsupportedError

__all__ = [
    "HandoffSpec",
    "Sender",
    "Receiver",
    "Outgoing",
    "Incoming",
    "TransferError",
    "LayerStats",
    "available",
    "LAYOUTS",
]

#: Cache layouts (as for :mod:`kvpack.cuda`): ``"flash_attn"`` one tensor
#: ``[2, num_blocks, block_size, kv_heads, head_dim]``; ``"flashinfer"``
#: ``[num_blocks, 2, block_size, kv_heads, head_dim]``; ``"hnd"`` a pair
#: ``(k, v)`` each ``[num_blocks, kv_heads, block_size, head_dim]``.
LAYOUTS = ("flash_attn", "flashinfer", "hnd")

_REQ = b"kvpack/req "
_LAYER = b"kvpack/layer "
_FAIL = b"kvpack/fail "
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


# --------------------------------------------------------------------------
# NIXL access


def _nixl_api() -> Any:
    """NIXL's Python API module (``nixl._api``, ``nixl_cu13._api`` or
    ``nixl_cu12._api``)."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise UnsupportedError("NIXL is not installed: pip install nixl (or nixl-cu13 / nixl-cu12)")


def available() -> bool:
    """True when NIXL's Python API can be imported."""
    try:
        _nixl_api()
        return True
    except UnsupportedError:
        return False


class _Buffer:
    """A registered buffer: host DRAM (numpy, 4 KiB aligned) or VRAM
    (a torch uint8 CUDA tensor)."""

    def __init__(self, agent: Any, nbytes: int, memory: str, device: int):
        self.memory = memory
        self.nbytes = nbytes
        if memory == "DRAM":
            raw = np.empty(nbytes + _ALIGN, np.uint8)
            off = (-raw.ctypes.data) % _ALIGN
            self.host = raw[off : off + nbytes]
            self.tensor = None
            self.addr = int(self.host.ctypes.data)
            self.device = 0
        elif memory == "VRAM":
            import torch

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
            self.host = None
            self.addr = int(self.tensor.data_ptr())
            self.device = device
        else:
            raise ParameterError(f"memory {memory!r}: expected 'DRAM' or 'VRAM'")
        self._agent = agent
        self.reg = agent.register_memory([(self.addr, nbytes, self.device, "")], memory)

    def close(self) -> None:
        if self.reg is not None:
            self._agent.deregister_memory(self.reg)
            self.reg = None


_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _stop_threads() -> None:
    """Stops every request and agent thread before the interpreter (and
    with it NIXL's agents) goes away: a thread inside NIXL while its agent
    is destroyed aborts the process."""
    for obj in list(_LIVE):
        obj._halt()


class _Endpoint:
    """A NIXL agent with kvpack's notification bookkeeping."""

    def __init__(self, name: str, *, port: Optional[int], backends: Sequence[str], progress_thread: bool):
        api = _nixl_api()
        cfg = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=port is not None,
            listen_port=port or 0,
            backends=list(backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.port = port
        #: registered buffers kept for reuse between requests
        self.pool_size = 2
        self.agent = api.nixl_agent(name, cfg)
        if not self.agent.backends:
            raise UnsupportedError(f"NIXL agent {name}: none of the backends {list(backends)} could start")
        self._notifs: List[Tuple[str, bytes]] = []
        self._pool: List[_Buffer] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0  # open requests: poll fast while > 0
        self._busy_until = 0.0  # ... or until a sent notification has surely left
        self._stop = False
        self._poller = threading.Thread(target=self._poll_loop, name=f"kvpack-nixl-{name}", daemon=True)
        self._poller.start()
        _LIVE.add(self)

    def _halt(self) -> None:
        with self._cond:
            self._stop = True
        if self._poller is not threading.current_thread():
            self._poller.join()

    def metadata(self) -> bytes:
        """This agent's NIXL metadata blob (``get_agent_metadata``), for a
        peer's :meth:`add_peer` when agents are introduced out of band."""
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Loads a peer's :meth:`metadata` blob; returns its agent name."""
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def connect(self, peer: str, host: str, port: int, *, timeout: float = 30.0) -> None:
        """Introduces this agent and ``peer`` (an agent listening on
        ``host:port``) through NIXL's listener: fetches the peer's metadata
        and sends ours, then waits until the peer's metadata has arrived.
        Both agents need a listener (``port=``): NIXL's listener thread is
        what carries the exchange.

        Raises:
            ParameterError: this agent was created without ``port``.
            TimeoutError: the peer's metadata did not arrive in ``timeout`` s.
        """
        if self.port is None:
            raise ParameterError(f"agent {self.name} has no NIXL listener: create it with port=... to connect()")
        self.agent.fetch_remote_metadata(peer, host, port)
        self.agent.send_local_metadata(host, port)
        end = time.monotonic() + timeout
        while not self.agent.check_remote_metadata(peer):
            if time.monotonic() > end:
                raise TimeoutError(f"NIXL metadata of {peer} at {host}:{port} did not arrive in {timeout} s")
            time.sleep(0.001)

    def _buffer(self, nbytes: int, memory: str, device: int) -> _Buffer:
        """A registered buffer of at least ``nbytes``: a released one of the
        same kind if any is big enough (registration pins memory and first
        touches fault pages: both cost more than a layer), else a new one."""
        fits = [b for b in self._pool if b.memory == memory and b.device == device and b.nbytes >= nbytes]
        if fits:
            b = min(fits, key=lambda b: b.nbytes)
            self._pool.remove(b)
            return b
        return _Buffer(self.agent, nbytes, memory, device)

    def _release(self, buf: _Buffer) -> None:
        """Keeps ``buf`` registered for the next request (at most
        ``pool_size`` buffers, the largest kept)."""
        self._pool.append(buf)
        self._pool.sort(key=lambda b: -b.nbytes)
        while len(self._pool) > self.pool_size:
            self._pool.pop().close()

    def close(self) -> None:
        """Stops the agent's polling thread and deregisters the pooled
        buffers."""
        self._halt()
        while self._pool:
            self._pool.pop().close()

    def _poll_loop(self) -> None:
        """The agent's polling thread: collects notifications (which also
        progresses the backend: outgoing notifications leave, incoming data
        lands) every 0.2 ms while a request is open or a notification was
        just sent, every 5 ms otherwise."""
        while not self._stop:
            new = self.agent.get_new_notifs()
            with self._cond:
                if new:
                    for peer, msgs in new.items():
                        p = peer.decode() if isinstance(peer, bytes) else peer
                        self._notifs.extend((p, m) for m in msgs)
                    self._cond.notify_all()
                fast = self._active > 0 or time.monotonic() < self._busy_until
            time.sleep(0.0002 if fast else 0.005)

    def _notify(self, peer: str, msg: bytes) -> None:
        """Sends a NIXL notification; polls fast for a second so it leaves."""
        with self._cond:
            self._busy_until = time.monotonic() + 1.0
        self.agent.send_notif(peer, msg)

    def _wait(self, end: float) -> bool:
        """Waits (at most until ``end``, monotonic) for new notifications;
        False once ``end`` has passed."""
        left = end - time.monotonic()
        if left <= 0:
            return False
        with self._cond:
            self._cond.wait(min(left, 0.002))
        return True

    def _take(self, prefix: bytes, match: Any) -> Optional[Tuple[str, Dict[str, Any]]]:
        """Pops the first notification with ``prefix`` whose JSON body
        satisfies ``match``."""
        with self._lock:
            for i, (peer, msg) in enumerate(self._notifs):
                if msg.startswith(prefix):
                    body = json.loads(msg[len(prefix) :])
                    if match(body):
                        del self._notifs[i]
                        return peer, body
        return None


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


# --------------------------------------------------------------------------
# decode side


@dataclass
class LayerStats:
    """Per-layer timestamps (``time.perf_counter()`` seconds) and sizes."""

    layer: int
    frame_bytes: int = 0
    encode_start: float = 0.0  #: prefill side (on the decode side: from the notification)
    encode_end: float = 0.0  #: prefill side only
    posted: float = 0.0  #: prefill side: the WRITE was posted
    landed: float = 0.0  #: decode side: the notification was seen
    decode_start: float = 0.0
    decode_end: float = 0.0
    done: float = 0.0  #: prefill side: NIXL reported the write complete


class Incoming:
    """The decode side of one request: a registered landing buffer with one
    slot per layer. Created by :meth:`Receiver.expect`."""

    def __init__(self, rx: "Receiver", spec: HandoffSpec, block_ids: Sequence[int], request: str, peer: str, memory: str, device: int):
        self.rx = rx
        self.spec = spec
        self.request = request
        self.peer = peer
        self.block_ids = [int(b) for b in list(block_ids)[: spec.num_blocks()]]
        if len(self.block_ids) < spec.num_blocks():
            raise ParameterError(f"block table has {len(self.block_ids)} blocks; {spec.num_tokens} tokens need {spec.num_blocks()}")
        self._ids = np.asarray(self.block_ids, dtype=np.int64)  # read through DLPack, no per-id conversion
        self.slot = spec.slot_bytes()
        self.buffer = rx._buffer(self.slot * spec.num_layers, memory, device)
        with rx._cond:
            rx._active += 1
        self._landed: Dict[int, Dict[str, Any]] = {}
        self._failed: Dict[int, str] = {}
        self.stats: Dict[int, LayerStats] = {}
        self._host_stage: Optional[Any] = None

    def ticket(self) -> bytes:
        """The request ticket the prefill side needs (sent by
        :meth:`Receiver.expect` as a NIXL notification): the spec, the
        decode side's block table, the landing buffer's address, slot size
        and memory kind, and NIXL's partial metadata for that buffer (JSON;
        about 5 bytes per block plus 1 KB)."""
        md = self.rx.agent.get_partial_agent_metadata(self.buffer.reg, True)
        return json.dumps(
            {
                "request": self.request,
                "spec": self.spec.to_json(),
                "memory": self.buffer.memory,
                "addr": self.buffer.addr,
                "device": self.buffer.device,
                "slot": self.slot,
                "blocks": self.block_ids,
                "md": md.hex(),
            }
        ).encode()

    def _blocks_of(self, ranges: Sequence[Tuple[int, int]]) -> List[int]:
        bs = self.spec.block_size
        idx = sorted({i for a, b in ranges for i in range(a // bs, -(-b // bs))})
        return [self.block_ids[i] for i in idx]

    def _error(self, layer: int, msg: str, cause: str, ranges: Optional[List[Tuple[int, int]]] = None) -> TransferError:
        ranges = ranges if ranges is not None else [(0, self.spec.num_tokens)]
        return TransferError(msg, request=self.request, layer=layer, blocks=self._blocks_of(ranges), tokens=ranges, cause=cause)

    def poll(self) -> List[int]:
        """Checks for notifications without blocking; returns the layers
        landed so far (in arrival order of the check)."""
        while True:
            got = self.rx._take(_LAYER, lambda b: b.get("r") == self.request)
            if got is None:
                break
            body = got[1]
            self._landed[int(body["l"])] = body
            st = self.stats.setdefault(int(body["l"]), LayerStats(int(body["l"])))
            st.landed = time.perf_counter()
            st.frame_bytes, st.encode_start, st.posted = int(body["n"]), float(body["e"]), float(body["p"])
        while True:
            got = self.rx._take(_FAIL, lambda b: b.get("r") == self.request)
            if got is None:
                break
            self._failed[int(got[1]["l"])] = str(got[1]["why"])
        return list(self._landed)

    def wait_layer(self, layer: int, *, timeout: float = 60.0) -> Any:
        """Waits until layer ``layer`` has landed and returns its frame bytes
        in the landing buffer (a uint8 numpy view for DRAM, a uint8 CUDA
        tensor slice for VRAM), not yet validated.

        Raises:
            TransferError: the prefill side reported a failure for this
                layer (``cause="peer"``), or ``timeout`` seconds passed
                (``cause="timeout"``); ``blocks`` names every block.
            ParameterError: a layer outside ``0..num_layers``.
        """
        if not 0 <= layer < self.spec.num_layers:
            raise ParameterError(f"layer {layer} outside 0..{self.spec.num_layers}")
        end = time.monotonic() + timeout
        while True:
            self.poll()
            if layer in self._landed:
                break
            if layer in self._failed:
                raise self._error(layer, f"the prefill side failed: {self._failed[layer]}", "peer")
            if not self.rx._wait(end):
                raise self._error(layer, f"no data within {timeout} s", "timeout")
        n = int(self._landed[layer]["n"])
        if not 0 < n <= self.slot:
            raise self._error(layer, f"frame of {n} bytes does not fit a {self.slot}-byte slot", "corrupt")
        lo = layer * self.slot
        return self.buffer.host[lo : lo + n] if self.buffer.host is not None else self.buffer.tensor[lo : lo + n]

    def _host_frame(self, frame: Any) -> np.ndarray:
        """The frame in host memory (VRAM frames are copied to a pinned
        staging buffer first)."""
        if isinstance(frame, np.ndarray):
            return frame
        import torch

        if self._host_stage is None:
            self._host_stage = torch.empty(self.slot, dtype=torch.uint8, pin_memory=True)
        dst = self._host_stage[: frame.numel()]
        dst.copy_(frame)
        return dst.numpy()

    def _faults(self, data: np.ndarray, layer: int, err: Exception, whole: bool) -> TransferError:
        """The TransferError for a frame that failed to decode: the damaged
        pages' token ranges, and their blocks (every block when ``whole``:
        the layer was not decoded at all)."""
        try:
            faults = _native.page_faults(data)
        except FormatError as e:
            return self._error(layer, f"frame structure damaged ({e}); the whole layer is lost", "corrupt")
        bad = sorted({(a, b) for (_, _, a, b, _) in faults}) or [(0, self.spec.num_tokens)]
        why = "; ".join(m for *_, m in faults) or str(err)
        e = self._error(layer, f"{len(faults)} damaged page(s): {why}", "corrupt", bad)
        if whole:
            e.blocks = list(self.block_ids)
        return e

    def decode_layer(
        self,
        layer: int,
        kv_cache: Any,
        *,
        layout: str = "flash_attn",
        timeout: float = 60.0,
        stream: Any = None,
    ) -> LayerStats:
        """Waits for layer ``layer``, validates it and decodes it into the
        decode side's cache for this layer at this request's block table.

        Args:
            layer: layer index.
            kv_cache: this layer's paged cache (see :data:`LAYOUTS`): CUDA
                tensors (decoded on the GPU by
                :func:`kvpack.cuda.decode_paged`, bf16/fp16) or host arrays
                (numpy, uint16 bit patterns for bf16/fp16 as ``spec.dtype``
                says, or CPU torch tensors; decoded by the CPU decoders).
            layout: cache layout.
            timeout: seconds to wait for the layer.
            stream: CUDA stream for CUDA caches (default: current).

        Returns:
            The layer's :class:`LayerStats`.

        Raises:
            TransferError: the layer failed, timed out, or is damaged
                (``cause="corrupt"``, ``tokens`` the damaged pages' token
                ranges, ``blocks`` the blocks to recompute). Intact pages of
                a host cache are still decoded; a CUDA cache's layer is left
                untouched and every block is named.
            ParameterError: a cache that does not match the spec.
        """
        _check_cache(kv_cache, layout, self.spec)
        frame = self.wait_layer(layer, timeout=timeout)
        st = self.stats.setdefault(layer, LayerStats(layer))
        st.decode_start = time.perf_counter()
        data = self._host_frame(frame)
        if _is_cuda(kv_cache):
            from . import cuda

            try:
                cuda.decode_paged(data, kv_cache, self._ids, layer=layer, layout=layout, stream=stream)
            except FormatError as e:
                raise self._faults(data, layer, e, whole=True) from e
        else:
            self._decode_host(data, layer, kv_cache, layout)
        st.decode_end = time.perf_counter()
        return st

    def _decode_host(self, data: np.ndarray, layer: int, kv_cache: Any, layout: str) -> None:
        """Decodes into a host cache: straight into it when the block table
        is one token-contiguous run (flash_attn, consecutive blocks), else
        into a contiguous scratch layer scattered into the blocks after (one
        decode per page, one copy). Intact pages of a damaged frame are
        still decoded and scattered."""
        views = _host_views(kv_cache, layout, _runs(self.block_ids, self.spec.num_tokens, self.spec.block_size))
        if len(views) == 1:
            targets = views
        else:
            k0 = views[0][1]
            shape = (1, k0.shape[1], self.spec.num_tokens, k0.shape[3])
            if isinstance(k0, np.ndarray):
                targets = [(0, np.empty(shape, k0.dtype), np.empty(shape, k0.dtype))]
            else:
                torch = sys.modules["torch"]
                targets = [(0, torch.empty(shape, dtype=k0.dtype), torch.empty(shape, dtype=k0.dtype))]
        outs = []
        for first, k, v in targets:
            for kind, a in (("K", k), ("V", v)):
                h = _hint(a, self.spec.dtype)
                outs.append((layer, kind, first, a, h) if h else (layer, kind, first, a))
        bad: List[Tuple[int, int]] = []
        try:
            _native.decode_bytes_into(data, outs)
        except FormatError as e:
            err = self._faults(data, layer, e, whole=False)
            if err.tokens == [(0, self.spec.num_tokens)]:
                raise err from e
            self._decode_intact(data, outs, err.tokens)
            bad, failure = err.tokens, err
        if targets is not views:
            _, tk, tv = targets[0]
            for first, k, v in views:
                n = k.shape[2]
                if not any(first < b and first + n > a for a, b in bad):
                    k[...] = tk[:, :, first : first + n]
                    v[...] = tv[:, :, first : first + n]
        if bad:
            raise failure

    def _decode_intact(self, data: np.ndarray, outs: List[Tuple], bad: List[Tuple[int, int]]) -> None:
        """Decodes the outputs' token ranges that avoid every damaged range
        (host caches), each output split at the damaged ranges."""
        for o in outs:
            layer, kind, first, a = o[:4]
            n = a.shape[2]
            cuts = sorted({first, first + n} | {x for r in bad for x in r if first < x < first + n})
            for lo, hi in zip(cuts, cuts[1:]):
                if any(lo < b and hi > a_ for a_, b in bad):
                    continue
                part = (layer, kind, lo, a[:, :, lo - first : hi - first]) + tuple(o[4:])
                _native.decode_bytes_into(data, [part])

    def close(self) -> None:
        """Gives the landing buffer back to the receiver (kept registered
        for the next request)."""
        if self.buffer is not None:
            self.rx._release(self.buffer)
            self.buffer = None
            with self.rx._cond:
                self.rx._active -= 1


class Receiver(_Endpoint):
    """The decode worker's NIXL agent.

    Args:
        name: this agent's name (unique among the agents it talks to).
        port: listen for NIXL metadata on this TCP port (NIXL's listener
            thread), or None for no listener (then introduce agents with
            :meth:`metadata` / :meth:`add_peer` or :meth:`connect`).
        backends: NIXL backends (default UCX: RDMA, TCP, shared memory,
            CUDA IPC, whatever UCX finds).
        progress_thread: also run NIXL's own progress thread. Off by
            default: it polls the backend continuously (a third of a core
            when idle, measured), and kvpack progresses its transfers itself
            (the sender's request thread polls its writes, the receiver
            polls while it waits for a layer).

    Raises:
        UnsupportedError: NIXL is not installed or no backend starts.
    """

    def __init__(
        self, name: str, *, port: Optional[int] = None, backends: Sequence[str] = ("UCX",), progress_thread: bool = False
    ):
        super().__init__(name, port=port, backends=backends, progress_thread=progress_thread)

    def expect(
        self,
        spec: HandoffSpec,
        block_ids: Sequence[int],
        *,
        peer: str,
        request: Optional[str] = None,
        memory: str = "DRAM",
        device: int = 0,
    ) -> Incoming:
        """Registers a landing buffer for one request and sends its ticket to
        the prefill agent ``peer`` (a NIXL notification; ``peer``'s metadata
        must be loaded: :meth:`connect` or :meth:`add_peer`).

        Args:
            spec: what is handed off.
            block_ids: the decode side's block table for the request (the
                blocks :meth:`Incoming.decode_layer` writes and
                :class:`TransferError` names).
            peer: the prefill agent's name.
            request: request id (default: a fresh uuid).
            memory: ``"DRAM"`` or ``"VRAM"`` landing buffer.
            device: CUDA device of a VRAM buffer.

        Raises:
            ParameterError: a short block table or a codec that cannot take
                the shape.
        """
        inc = Incoming(self, spec, block_ids, request or uuid.uuid4().hex, peer, memory, device)
        self._notify(peer, _REQ + inc.ticket())
        return inc


# --------------------------------------------------------------------------
# prefill side


class Outgoing:
    """The prefill side of one request. Created by :meth:`Sender.accept`.

    Attributes:
        spec: the decode side's :class:`HandoffSpec`.
        request: the request id.
        peer: the decode agent's name.
        remote_blocks: the decode side's block table.
        stats: per layer :class:`LayerStats` (encode and post times, sizes).
    """

    def __init__(self, tx: "Sender", peer: str, ticket: Dict[str, Any], memory: str, device: int, link_gbit: Optional[float]):
        self.tx = tx
        self.peer = peer
        self.request = str(ticket["request"])
        self.spec = HandoffSpec.from_json(ticket["spec"])
        self.slot = int(ticket["slot"])
        if self.slot != self.spec.slot_bytes():
            raise ParameterError(
                f"request {self.request}: the decode side reserves {self.slot} bytes per layer, "
                f"this build bounds a layer at {self.spec.slot_bytes()} (different kvpack versions?)"
            )
        self.remote = (int(ticket["addr"]), int(ticket["device"]), str(ticket["memory"]))
        #: the decode side's block table for the request (from the ticket)
        self.remote_blocks: List[int] = [int(b) for b in ticket.get("blocks", [])]
        self.buffer = tx._buffer(self.slot * self.spec.num_layers, memory, device)
        with tx._cond:
            tx._active += 1
        self.stats: Dict[int, LayerStats] = {}
        self._xfers: Dict[int, Any] = {}
        self._rate = None if link_gbit is None else float(link_gbit) * 1e9 / 8
        self._link_free = 0.0
        self._stage: Optional[Any] = None
        self._queue: List[Tuple[float, int, int]] = []
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._progress_loop, name=f"kvpack-nixl-{self.request}", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _halt(self) -> None:
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._error = self._error or TransferError("closed", request=self.request, layer=-1, cause="peer")
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _fail(self, layer: int, why: str, cause: str) -> TransferError:
        try:
            self.tx._notify(self.peer, _FAIL + json.dumps({"r": self.request, "l": layer, "why": why}).encode())
        except Exception:  # the peer may be gone; the local error still says what happened
            pass
        return TransferError(
            why, request=self.request, layer=layer, blocks=self.remote_blocks, tokens=[(0, self.spec.num_tokens)], cause=cause
        )

    def _encode(self, layer: int, kv_cache: Any, block_ids: Sequence[int], layout: str, stream: Any) -> int:
        """Encodes the layer into its staging slot; returns the byte count."""
        s = self.spec
        lo = layer * self.slot
        if self.buffer.host is not None:
            dst = self.buffer.host[lo : lo + self.slot]
        else:
            import torch

            if self._stage is None:
                self._stage = torch.empty(self.slot, dtype=torch.uint8, pin_memory=True)
            dst = self._stage.numpy()
        if _is_cuda(kv_cache):
            from . import cuda

            kw = dict(layout=layout, layer=layer, stream=stream, page_tokens=s.page_tokens, sink=s.sink, recent=s.recent, out=dst)
            try:
                # raw_fallback sends encode_paged to the CPU codecs: first try
                # without; a page the codec would make larger than raw (then
                # the slot bound counts it raw) overflows and we retry.
                n = cuda.encode_paged(kv_cache, block_ids, s.num_tokens, s.codec, **kw)
            except ParameterError:
                n = cuda.encode_paged(kv_cache, block_ids, s.num_tokens, s.codec, raw_fallback=True, **kw)
        else:
            from . import compress

            views = _host_views(kv_cache, layout, _runs(block_ids, s.num_tokens, s.block_size))
            if len(views) == 1:
                k, v = views[0][1], views[0][2]
            else:  # blocks not token-contiguous: gather (one copy of the layer)
                cat = np.concatenate if isinstance(views[0][1], np.ndarray) else sys.modules["torch"].cat
                k, v = cat([x[1] for x in views], 2), cat([x[2] for x in views], 2)
            h = _hint(k, s.dtype)
            n = compress(
                {(layer, "K"): k, (layer, "V"): v}, s.codec, out=dst, raw_fallback=True,
                page_tokens=s.page_tokens, sink=s.sink, recent=s.recent, dtype=h,
            ).written
        if self.buffer.host is None:
            self.buffer.tensor[lo : lo + n].copy_(self._stage[:n])
        return int(n)

    def _post(self, layer: int, n: int) -> None:
        st = self.stats[layer]
        st.posted = time.perf_counter()
        a = self.tx.agent
        lo = layer * self.slot
        local = a.get_xfer_descs([(self.buffer.addr + lo, n, self.buffer.device)], self.buffer.memory)
        raddr, rdev, rmem = self.remote
        remote = a.get_xfer_descs([(raddr + lo, n, rdev)], rmem)
        msg = _LAYER + json.dumps({"r": self.request, "l": layer, "n": n, "e": st.encode_start, "p": st.posted}).encode()
        h = a.initialize_xfer("WRITE", local, remote, self.peer, msg)
        if a.transfer(h) == "ERR":
            raise self._fail(layer, "NIXL refused to post the write", "transfer")
        self._xfers[layer] = h

    def _progress_loop(self) -> None:
        """The request's NIXL thread: posts queued writes when they are due
        and polls posted ones until NIXL reports them done (UCX moves data
        only while someone progresses it), recording the first failure."""
        a = self.tx.agent
        while True:
            now = time.perf_counter()
            with self._cv:
                if self._error is not None or (self._closed and not self._queue and not self._xfers):
                    self._cv.notify_all()
                    return
                due = [q for q in self._queue if q[0] <= now]
                self._queue = [q for q in self._queue if q[0] > now]
                if not due and not self._xfers:
                    wait = min((q[0] for q in self._queue), default=now + 1.0) - now
                    self._cv.wait(max(wait, 0.0))
                    continue
            try:
                for _, layer, n in due:
                    self._post(layer, n)
                for layer, h in list(self._xfers.items()):
                    state = a.check_xfer_state(h)
                    if state == "DONE":
                        self.stats[layer].done = time.perf_counter()
                        h.release()
                        del self._xfers[layer]
                    elif state == "ERR":
                        raise self._fail(layer, "NIXL reported the write failed", "transfer")
            except BaseException as e:  # reported by finish()
                with self._cv:
                    self._error = e
                continue
            if self._xfers and not due:
                time.sleep(0.0001)

    def send_layer(
        self,
        layer: int,
        kv_cache: Any,
        block_ids: Sequence[int],
        *,
        layout: str = "flash_attn",
        stream: Any = None,
    ) -> LayerStats:
        """Encodes layer ``layer`` of the request (tokens ``0..num_tokens``
        at ``block_ids`` of this layer's paged cache) and posts its NIXL
        write; returns without waiting for the wire.

        Args:
            layer: layer index.
            kv_cache: this layer's paged cache (:data:`LAYOUTS`), CUDA
                tensors (encoded by :func:`kvpack.cuda.encode_paged`) or
                host arrays (numpy uint16 bit patterns of ``spec.dtype``, or
                CPU torch tensors; encoded by the CPU codecs; blocks that
                are not token-contiguous are gathered first).
            block_ids: the prefill side's block table for the request.
            layout: cache layout.
            stream: CUDA stream for CUDA caches (default: current).

        Returns:
            The layer's :class:`LayerStats` (post time set once posted).

        Raises:
            TransferError: NIXL refused the write (the decode side is told).
            ParameterError: a cache or block table that does not match the
                spec, NaN/inf values (the row is named).
        """
        _check_cache(kv_cache, layout, self.spec)
        if not 0 <= layer < self.spec.num_layers:
            raise ParameterError(f"layer {layer} outside 0..{self.spec.num_layers}")
        if layer in self.stats:
            raise ParameterError(f"layer {layer} was already sent")
        st = self.stats[layer] = LayerStats(layer, encode_start=time.perf_counter())
        try:
            n = self._encode(layer, kv_cache, block_ids, layout, stream)
        except KvpackError as e:
            self._fail(layer, f"encode failed: {e}", "peer")
            raise
        st.frame_bytes = n
        st.encode_end = time.perf_counter()
        due = st.encode_end
        if self._rate is not None:
            # Link pacing (benchmarks): the layer's last byte would arrive
            # n / rate after the link is free and the layer is ready.
            due = max(self._link_free, st.encode_end) + n / self._rate
            self._link_free = due
        with self._cv:
            if self._error is not None:
                raise self._error
            self._queue.append((due, layer, n))
            self._cv.notify()
        return st

    def finish(self, *, timeout: float = 60.0) -> Dict[int, LayerStats]:
        """Waits until every queued write has been posted and completed.

        Raises:
            TransferError: a write failed (``cause="transfer"``; the decode
                side is told) or did not complete in ``timeout`` seconds.
        """
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        if self._thread.is_alive():
            layer = min(list(self._xfers) + [q[1] for q in self._queue], default=0)
            raise self._fail(layer, f"writes not complete within {timeout} s", "timeout")
        return self.stats

    def close(self) -> None:
        """Stops the request's thread, releases pending transfers and gives
        the staging buffer back to the sender (kept registered for the next
        request)."""
        self._halt()
        for h in self._xfers.values():
            h.release()
        self._xfers.clear()
        if self.buffer is not None:
            self.tx._release(self.buffer)
            self.buffer = None
            with self.tx._cond:
                self.tx._active -= 1


class Sender(_Endpoint):
    """The prefill worker's NIXL agent.

    Args:
        name: this agent's name.
        port: NIXL listener port (see :class:`Receiver`), or None.
        backends: NIXL backends (default UCX).
        progress_thread: as for :class:`Receiver`.

    Raises:
        UnsupportedError: NIXL is not installed or no backend starts.
    """

    def __init__(
        self, name: str, *, port: Optional[int] = None, backends: Sequence[str] = ("UCX",), progress_thread: bool = False
    ):
        super().__init__(name, port=port, backends=backends, progress_thread=progress_thread)

    def accept(
        self,
        *,
        request: Optional[str] = None,
        model: Optional[str] = None,
        expect: Optional[HandoffSpec] = None,
        memory: str = "DRAM",
        device: int = 0,
        timeout: float = 60.0,
        link_gbit: Optional[float] = None,
    ) -> Outgoing:
        """Waits for a decode side's ticket and prepares the request.

        Args:
            request: accept only this request id (default: the first).
            model: refuse a ticket for another model.
            expect: refuse a ticket whose spec differs from this one.
            memory: ``"DRAM"`` or ``"VRAM"`` staging buffer.
            device: CUDA device of a VRAM buffer.
            timeout: seconds to wait for the ticket.
            link_gbit: benchmark aid: emulate a link of this rate by
                posting each layer's write when its last byte would have
                arrived, ``max(link free, layer encoded) + bytes / rate``
                (the real transfer then adds its own time).

        Raises:
            TimeoutError: no ticket in ``timeout`` seconds.
            ParameterError: the ticket's model or spec does not match (the
                decode side is told through a ``kvpack/fail`` for layer 0).
        """
        end = time.monotonic() + timeout
        while True:
            got = self._take(_REQ, lambda b: request is None or b.get("request") == request)
            if got is not None:
                break
            if not self._wait(end):
                raise TimeoutError(f"no kvpack ticket within {timeout} s")
        peer, ticket = got
        self.add_peer(bytes.fromhex(ticket["md"]))
        spec = HandoffSpec.from_json(ticket["spec"])
        why = None
        if model is not None and spec.model != model:
            why = f"ticket for model {spec.model!r}, this worker serves {model!r}"
        elif expect is not None and spec != expect:
            why = f"ticket spec {spec} differs from {expect}"
        if why is not None:
            self._notify(peer, _FAIL + json.dumps({"r": ticket["request"], "l": 0, "why": why}).encode())
            raise ParameterError(why)
        return Outgoing(self, peer, ticket, memory, device, link_gbit)
