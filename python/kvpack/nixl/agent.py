"""NIXL agents with kvpack's notification bookkeeping, registered buffers, and the NIXL import."""

from __future__ import annotations

import atexit
import json
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ParameterError, UnsupportedError
from .spec import _ALIGN

_REQ = b"kvpack/req "
_LAYER = b"kvpack/layer "
_FAIL = b"kvpack/fail "
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
        # (peer, message, arrival time: perf_counter when the polling
        # thread collected it)
        self._notifs: List[Tuple[str, bytes, float]] = []
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
            now = time.perf_counter()
            with self._cond:
                if new:
                    for peer, msgs in new.items():
                        p = peer.decode() if isinstance(peer, bytes) else peer
                        self._notifs.extend((p, m, now) for m in msgs)
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
        """Pops the first notification with ``prefix`` whose JSON object
        body satisfies ``match``; the body gains ``"_t"``, its arrival time
        (``time.perf_counter()``). A message with the prefix whose body is
        not a JSON object is dropped."""
        with self._lock:
            i = 0
            while i < len(self._notifs):
                peer, msg, t = self._notifs[i]
                if msg.startswith(prefix):
                    try:
                        body = json.loads(msg[len(prefix) :])
                    except ValueError:
                        body = None
                    if not isinstance(body, dict):
                        del self._notifs[i]
                        continue
                    if match(body):
                        del self._notifs[i]
                        body["_t"] = t
                        return peer, body
                i += 1
        return None
