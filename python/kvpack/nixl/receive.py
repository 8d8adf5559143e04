"""The decode side: :class:`Receiver` (agent) and :class:`Incoming` (one request)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _native
from ..errors import FormatError, ParameterError
from .agent import _FAIL, _LAYER, _REQ, _Endpoint
from .caches import _check_cache, _hint, _is_cuda
from .spec import HandoffSpec, LayerStats, TransferError

# --------------------------------------------------------------------------
# decode side


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
        landed so far (in arrival order of the check). A notification of
        this request whose fields are not what the prefill side sends (a
        layer outside the spec, a missing or non-numeric field) is ignored:
        its layer then times out, naming its blocks."""
        while True:
            got = self.rx._take(_LAYER, lambda b: b.get("r") == self.request)
            if got is None:
                break
            body = got[1]
            try:
                layer = int(body["l"])
                fields = int(body["n"]), float(body["e"]), float(body["p"])
            except (KeyError, TypeError, ValueError):
                continue
            if not 0 <= layer < self.spec.num_layers:
                continue
            self._landed[layer] = body
            st = self.stats.setdefault(layer, LayerStats(layer))
            # When the agent's polling thread collected the notification.
            st.landed = float(body["_t"])
            st.frame_bytes, st.encode_start, st.posted = fields
        while True:
            got = self.rx._take(_FAIL, lambda b: b.get("r") == self.request)
            if got is None:
                break
            try:
                self._failed[int(got[1]["l"])] = str(got[1].get("why"))
            except (KeyError, TypeError, ValueError):
                continue
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
                says, or CPU torch tensors; decoded straight into the
                blocks by :func:`kvpack.paged.decode_paged`).
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
        if _is_cuda(kv_cache):
            from .. import cuda

            # A VRAM landing buffer is checked and decoded on the GPU in
            # place (only headers are read back); a DRAM one is uploaded.
            try:
                cuda.decode_paged(frame, kv_cache, self._ids, layer=layer, layout=layout, stream=stream)
            except FormatError as e:
                raise self._faults(self._host_frame(frame), layer, e, whole=True) from e
        else:
            self._decode_host(self._host_frame(frame), layer, kv_cache, layout)
        st.decode_end = time.perf_counter()
        return st

    def _decode_host(self, data: np.ndarray, layer: int, kv_cache: Any, layout: str) -> None:
        """Decodes into a host cache, straight into its blocks
        (:func:`kvpack.paged.decode_paged`). Intact pages of a damaged
        frame are still decoded."""
        from .. import paged

        h = _hint(kv_cache, self.spec.dtype)
        decode = lambda tokens=None: paged.decode_paged(  # noqa: E731
            data, kv_cache, self._ids, layer=layer, layout=layout, dtype=h, tokens=tokens
        )
        try:
            decode()
        except FormatError as e:
            err = self._faults(data, layer, e, whole=False)
            if err.tokens == [(0, self.spec.num_tokens)]:
                raise err from e
            cuts = sorted({0, self.spec.num_tokens} | {x for r in err.tokens for x in r})
            for lo, hi in zip(cuts, cuts[1:]):
                if not any(lo < b and hi > a for a, b in err.tokens):
                    decode((lo, hi))
            raise err from e

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
