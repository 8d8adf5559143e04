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
  with :func:`kvpack.cuda.encode_paged` for CUDA caches, straight from the
  blocks with :func:`kvpack.paged.encode_paged` for host caches), then posts one NIXL WRITE of exactly those bytes into
  the decode side's landing slot for that layer, carrying the notification
  ``kvpack/layer``. The call returns once the write is posted; encoding the
  next layer overlaps the wire.
* **Per layer, decode side** (:meth:`Incoming.decode_layer`): waits for the
  layer's notification (NIXL delivers it after the data has landed),
  validates every page (header CRC, body CRC, index) and decodes straight
  into the layer's paged cache (:func:`kvpack.cuda.decode_paged` for CUDA
  caches, :func:`kvpack.paged.decode_paged` into host arrays).
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
GPU to GPU (GPUDirect RDMA where the NIC supports it). With VRAM buffers
and CUDA caches no frame byte passes through the host: the encoder builds
and checksums the page frames on the GPU straight into the staging slot,
and the decoder reads back only the file's header, index and page headers,
checks every body's CRC and padding on the GPU and decodes in place. A
request's layers share one page structure, so from the second layer on the
decoder reuses the first layer's plan (only the CRCs differ, and are
checked) instead of staging every page again.

Threads: each agent has a polling thread (NIXL notifications; every
0.2 ms while a request is open, about 5% of a core, else every 5 ms) and
each outgoing request a thread that polls its writes to completion
(and, with ``link_gbit`` pacing, posts each when it is due; unpaced
writes are posted by :meth:`Outgoing.send_layer` itself). NIXL's own progress
thread is off by default (``progress_thread=True`` turns it on).

Timing (``stats``) uses ``time.perf_counter()`` which on Linux is the
system-wide monotonic clock, so both sides' stamps on one machine compare.
"""

from __future__ import annotations

from .agent import available
from .receive import Incoming, Receiver
from .send import Outgoing, Sender
from .spec import LAYOUTS, HandoffSpec, LayerStats, TransferError

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
