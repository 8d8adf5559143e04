"""The prefill side: :class:`Sender` (agent) and :class:`Outgoing` (one request)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import KvpackError, ParameterError
from .agent import _FAIL, _LAYER, _LIVE, _REQ, _Endpoint
from .caches import _check_cache, _hint, _is_cuda
from .spec import HandoffSpec, LayerStats, TransferError

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
        elif _is_cuda(kv_cache):
            # VRAM to VRAM: the GPU writes the frames straight into the
            # registered buffer (built and checksummed on the device).
            dst = self.buffer.tensor[lo : lo + self.slot]
        else:
            import torch

            if self._stage is None:
                self._stage = torch.empty(self.slot, dtype=torch.uint8, pin_memory=True)
            dst = self._stage.numpy()
        if _is_cuda(kv_cache):
            from .. import cuda

            kw = dict(layout=layout, layer=layer, stream=stream, page_tokens=s.page_tokens, sink=s.sink, recent=s.recent, out=dst)
            try:
                # raw_fallback sends encode_paged to the CPU codecs: first try
                # without; a page the codec would make larger than raw (then
                # the slot bound counts it raw) overflows and we retry.
                n = cuda.encode_paged(kv_cache, block_ids, s.num_tokens, s.codec, **kw)
            except ParameterError:
                n = cuda.encode_paged(kv_cache, block_ids, s.num_tokens, s.codec, raw_fallback=True, **kw)
        else:
            # Straight from the blocks (kvpack.paged.encode_paged): rows of
            # int/bdr are coded in place, other codecs gather a page at a time.
            from .. import paged

            n = paged.encode_paged(
                kv_cache, block_ids, s.num_tokens, s.codec, layout=layout, layer=layer, dtype=_hint(kv_cache, s.dtype),
                page_tokens=s.page_tokens, sink=s.sink, recent=s.recent, raw_fallback=True, out=dst,
            )
        if self.buffer.host is None and not _is_cuda(kv_cache):
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
                CPU torch tensors; encoded straight from the blocks by
                :func:`kvpack.paged.encode_paged`).
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
        if self._rate is None:
            # Posted from this thread (no hand-off to the request thread,
            # which only polls the write to completion).
            with self._cv:
                if self._error is not None:
                    raise self._error
                try:
                    self._post(layer, n)
                except BaseException as e:
                    self._error = e
                    raise
                self._cv.notify()
            return st
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
                decode side is told through a ``kvpack/fail`` for layer 0),
                or the ticket is malformed.
        """
        end = time.monotonic() + timeout
        while True:
            got = self._take(_REQ, lambda b: request is None or b.get("request") == request)
            if got is not None:
                break
            if not self._wait(end):
                raise TimeoutError(f"no kvpack ticket within {timeout} s")
        peer, ticket = got
        try:
            md = bytes.fromhex(ticket["md"])
            spec = HandoffSpec.from_json(ticket["spec"])
            for field in ("request", "slot", "addr", "device", "memory"):
                ticket[field]
        except (KeyError, TypeError, ValueError, KvpackError) as e:
            raise ParameterError(f"malformed kvpack ticket from {peer!r}: {type(e).__name__}: {e}") from None
        self.add_peer(md)
        why = None
        if model is not None and spec.model != model:
            why = f"ticket for model {spec.model!r}, this worker serves {model!r}"
        elif expect is not None and spec != expect:
            why = f"ticket spec {spec} differs from {expect}"
        if why is not None:
            self._notify(peer, _FAIL + json.dumps({"r": ticket["request"], "l": 0, "why": why}).encode())
            raise ParameterError(why)
        return Outgoing(self, peer, ticket, memory, device, link_gbit)
