"""Optional KV transport over DLSlime's TCP endpoint (``pip install dlslime``, tested with
0.1.23; the parts of DLSlime's API this relies on: docs/transfer.md).

Reads are one-sided: the receiver pulls each layer out of the sender's memory. Sender: one
endpoint per process and IP (``DLBATCH_DLSLIME_IP``, default 127.0.0.1); each transfer
takes a pooled buffer laid out like ``payload.to_buffer``. ``send_layer`` copies a layer in
with its checksum fused, ready byte last; ``layer_buffer(i)`` lends layer i's place, so the
engine's export gather is the sender's only copy. The handle names the endpoint, the buffer
and a 32-byte control slot (``generation`` and ``aborted`` written by the sender, ``ack`` by
the receiver). Receiver: its own endpoint on 127.0.0.1, shut down once the last layer is
verified; it polls the slot and the layer table, reads layer i as soon as its ready byte is
set (into ``out(i)`` when that fits, else a pooled staging buffer), issues the read of
layer i+1 before verifying layer i, and yields a layer only if the slot's generation is
unchanged after its read.

Invariants: a buffer is reused only after the receiver's ack, ``abort()`` or the lease
(``DLBATCH_DLSLIME_LEASE_S``); its generation is cleared first, so a late receiver gets
"reused", never another payload. Every wait runs under the receive timeout; a dead sender is
``SenderDied`` at the next read. The sender must outlive the receive (``wait_received``).
Exposure: DLSlime's TCP server serves a READ or WRITE of any address of this process to
whoever connects; it has no handshake, no peer check and no bounds (``csrc/engine/tcp``).
So an endpoint is as open as the address it listens on, and nothing here can narrow that: a
secret checked by our receiver would not stop a peer that speaks the wire protocol directly,
and that peer could read the secret out of this process. What is enforced instead:

- an endpoint listens on a loopback address unless ``allow_network`` (the job's
  ``cluster.dlslime_allow_network``, which the driver hands its workers as
  ``DLBATCH_DLSLIME_ALLOW_NETWORK=1``); any other address (``DLBATCH_DLSLIME_IP``) is
  refused, naming that setting. Every local user of the node can still reach a loopback
  endpoint: docs/transfer.md says what that exposes.
- a receiver only follows a handle whose endpoint it can reach without the network: a
  loopback endpoint in its own loopback scope (same kernel boot and network namespace,
  ``loopback_scope()``), else a network endpoint only under ``allow_network``. A loopback
  handle from another node is refused before anything connects (the same port on this node
  may be another process's endpoint).

Limits: sender buffers are not registered (0.1.23 cannot unregister); bounded pools and
unacknowledged transfers (``DLBATCH_DLSLIME_*``); RDMA and NVLink endpoints are not wired.
"""

from __future__ import annotations

import ipaddress
import multiprocessing.util
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from dlbatch.transfer.base import Deadline, KVReceiver, KVSender, Transport
from dlbatch.transfer.buffer_pool import BufferPool, PerProcess, size_class
from dlbatch.transfer.errors import (
    CorruptPayload,
    FingerprintMismatch,
    LayoutMismatch,
    SenderDied,
    TransferError,
    TransportUnavailable,
)
from dlbatch.transfer.payload import (
    _ENTRY,
    ENTRY_SIZE,
    KVMeta,
    buffer_layout,
    check_layer,
    checksum,
    copy_checksum,
    layer_view,
    read_header,
    write_header,
)

SLOT_SIZE = 32  # u64 generation (sender), u64 aborted generation (sender), u64 ack (receiver), u64 pad
_MASK64 = (1 << 64) - 1
MAX_TRANSFERS = int(os.environ.get("DLBATCH_DLSLIME_MAX_TRANSFERS", "1024"))
LEASE_S = float(os.environ.get("DLBATCH_DLSLIME_LEASE_S", "600"))
POOL_MAX_BUFFERS = int(os.environ.get("DLBATCH_DLSLIME_POOL_BUFFERS", "8"))
POOL_MAX_BYTES = int(os.environ.get("DLBATCH_DLSLIME_POOL_BYTES", str(3 << 30)))
RX_POOL_MAX_BUFFERS = int(os.environ.get("DLBATCH_DLSLIME_RX_POOL_BUFFERS", "4"))
RX_POOL_MAX_BYTES = int(os.environ.get("DLBATCH_DLSLIME_RX_POOL_BYTES", str(2 << 30)))
DEFAULT_IP = os.environ.get("DLBATCH_DLSLIME_IP", "127.0.0.1")  # the sender endpoint's address
ALLOW_NETWORK_ENV = "DLBATCH_DLSLIME_ALLOW_NETWORK"  # "1": endpoints may listen off loopback (set by the driver)
ALLOW_NETWORK_SETTING = "cluster.dlslime_allow_network"  # the job's opt-in, named in every refusal
CONNECT_TIMEOUT_S = 10.0  # reachability check before dlslime's own (blocking, untimed) connect
ACK_TIMEOUT_S = 1.0  # how long release() waits for its ack write to leave
_PREFIX_OFF = 64  # where the receiver keeps its copy of the sender's header + table in its control buffer


def unavailable_reason() -> str | None:
    """Why the dlslime transport cannot run here, or None. Never raises."""
    try:
        import dlslime
    except ImportError as e:
        hint = " (dlslime needs the libibverbs1 system package, e.g. apt-get install libibverbs1)" \
            if "ibverbs" in str(e) else "; pip install dlslime"
        return f"the 'dlslime' package cannot be imported ({e}){hint}"
    except Exception as e:  # a broken install (bad .so, ...)
        return f"importing the 'dlslime' package failed: {type(e).__name__}: {e}"
    missing = [n for n in ("TcpEndpoint",) if not hasattr(dlslime, n)]
    if missing:
        return f"this dlslime build has no {', '.join(missing)} (built without TCP support)"
    return None


def is_available() -> bool:
    return unavailable_reason() is None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def network_allowed() -> bool:
    """This process's opt-in to endpoints off loopback (``DLBATCH_DLSLIME_ALLOW_NETWORK=1``)."""
    return os.environ.get(ALLOW_NETWORK_ENV, "").strip().lower() in ("1", "true", "yes")


def is_loopback(host: str) -> bool:
    """True for a loopback address, or a name whose every address is loopback."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def loopback_scope() -> str:
    """Who shares this process's loopback interface: one kernel boot and one network namespace
    (containers on one host share the boot, not the namespace). The hostname where /proc
    cannot tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return f"host:{socket.gethostname()}"


def check_listen_address(ip: str, allow_network: bool) -> None:
    """Refuse an endpoint address off loopback unless the job opted in (ValueError naming the setting)."""
    if allow_network or is_loopback(ip):
        return
    raise ValueError(
        f"the dlslime sender endpoint would listen on {ip!r} (DLBATCH_DLSLIME_IP), which is not a loopback "
        f"address: DLSlime's TCP endpoint lets anyone who connects read and write this worker's memory "
        f"(prompts, KV, and with that a way to run code as the job's user), with no authentication. "
        f"Leave DLBATCH_DLSLIME_IP unset (127.0.0.1, prefill and decode on one node), or set "
        f"{ALLOW_NETWORK_SETTING}: true to accept that exposure on a private network (docs/transfer.md)"
    )


def _check_bindable(ip: str) -> None:
    """dlslime only logs a failed bind, and its listen() then binds every interface: check first."""
    if ip in ("", "0.0.0.0", "::"):
        raise ValueError(
            f"the dlslime sender endpoint must bind one address (127.0.0.1, or this node's private-network "
            f"address), not {ip!r}: its TCP server reads and writes the memory its peers name"
        )
    try:
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
    except OSError as e:
        raise TransportUnavailable(f"dlslime cannot bind a TCP endpoint on {ip!r}: {e}") from None


def _size_class(nbytes: int) -> int:
    return size_class(nbytes)  # the classes of shm's segments


@dataclass(frozen=True)
class DLSlimeHandle:
    """What a receiver needs (small, picklable): the sender's endpoint, its buffer, its slot."""

    meta: KVMeta
    host: str
    port: int
    pid: int
    node: str
    addr: int  # the sender's buffer (payload.to_buffer layout)
    size: int  # bytes of that layout
    slot_addr: int  # this transfer's control slot (SLOT_SIZE bytes)
    generation: int
    scope: str = ""  # the sender's loopback_scope(): who can reach a loopback endpoint

    @property
    def where(self) -> str:
        return f"dlslime sender {self.host}:{self.port} (pid {self.pid} on {self.node})"


# ---------------------------------------------------------------- sender side: endpoint, control area, pool
class _Buf:
    __slots__ = ("arr", "size", "slot", "gen", "busy", "live", "closed_at")

    def __init__(self, arr: np.ndarray):
        self.arr = arr
        self.size = arr.nbytes
        self.slot = -1
        self.gen = 0
        self.busy = True  # held by an open sender
        self.live = False  # carries transfer ``gen`` (in ``out``)
        self.closed_at = 0.0


_RESULTS = {  # why a buffer went back to the pool
    "received": "the receiver read every layer and acknowledged",
    "abandoned": "the receiver gave up (error, timeout or released early) and said so",
    "lease": f"no acknowledgement within the lease (DLBATCH_DLSLIME_LEASE_S={LEASE_S:g}s)",
    "aborted": "the sender aborted it (or its endpoint was shut down)",
}
_KEEP_RESULTS = 4096


class _SenderState(BufferPool[_Buf]):
    """Per process: the endpoint(s), the control area (never freed), the buffer pool
    (dlbatch/transfer/buffer_pool.py): a buffer is back once its receiver acknowledged,
    said it gave up, or its lease ran out."""

    def __init__(self):
        super().__init__(POOL_MAX_BUFFERS, POOL_MAX_BYTES)
        self.endpoints: dict[str, object] = {}
        self.ctrl = np.zeros(MAX_TRANSFERS * SLOT_SIZE, dtype=np.uint8)
        self.slots = self.ctrl.view("<u8").reshape(MAX_TRANSFERS, SLOT_SIZE // 8)
        self.free_slots = list(range(MAX_TRANSFERS - 1, -1, -1))
        self.results: dict[int, str] = {}  # generation -> how its buffer came back (the last _KEEP_RESULTS)
        self.returns = {"received": 0, "abandoned": 0, "lease": 0, "aborted": 0}
        self.node = socket.gethostname()
        self.scope = loopback_scope()
        multiprocessing.util.Finalize(self, _SenderState.shutdown, args=(self,), exitpriority=10)

    def endpoint(self, ip: str, allow_network: bool = False):
        check_listen_address(ip, allow_network)  # first, also for a cached endpoint: the caller's opt-in decides
        import dlslime

        with self.lock:
            ep = self.endpoints.get(ip)
            if ep is None:
                _check_bindable(ip)
                ep = dlslime.TcpEndpoint(ip, 0)
                port = int(ep.endpoint_info()["port"])
                if port == 0:
                    ep.shutdown()
                    raise TransportUnavailable(f"dlslime could not bind a TCP endpoint on {ip} (port 0 came back)")
                self.endpoints[ip] = ep
            return ep

    # -- with self.lock held
    def _release_slot(self, buf: _Buf, aborted: bool) -> None:
        s = buf.slot
        if s < 0:
            return
        if aborted:
            self.slots[s, 1] = buf.gen
        self.slots[s, 0] = 0  # before the buffer is reused or freed: a late reader sees "reused"
        self.free_slots.append(s)
        buf.slot = -1

    def _finish(self, buf: _Buf, result: str) -> None:
        self._release_slot(buf, aborted=result == "aborted")
        buf.busy = buf.live = False
        self.returns[result] += 1
        self.results[buf.gen] = result
        while len(self.results) > _KEEP_RESULTS:
            del self.results[next(iter(self.results))]

    def _to_idle(self, buf: _Buf, result: str, pool: bool = True) -> None:
        self._finish(buf, result)
        if buf in self.out:
            self.out.remove(buf)
        if pool:
            self.idle.append(buf)

    def _ack_state(self, buf: _Buf) -> str | None:
        ack = int(self.slots[buf.slot, 2])
        if ack == buf.gen:
            return "received"
        if ack == buf.gen ^ _MASK64:
            return "abandoned"
        return None

    # -- pool hooks (buffer_pool.py)
    def _returned(self, buf: _Buf) -> str | None:
        state = self._ack_state(buf)
        if state is None and time.monotonic() - buf.closed_at > LEASE_S:
            state = "lease"
        if state is None:
            return None
        self._finish(buf, state)
        return "idle"

    def _dispose(self, buf: _Buf) -> None:
        buf.arr = None  # freed; its slot was cleared when it came back

    def _create(self, size: int) -> _Buf:
        return _Buf(np.empty(size, dtype=np.uint8))

    def acquire(self, nbytes: int) -> _Buf:
        cls = _size_class(nbytes)
        with self.lock:
            self.reclaim_locked()
            if not self.free_slots:
                raise TransferError(
                    f"this process has {MAX_TRANSFERS} dlslime KV transfers that no receiver acknowledged "
                    f"(limit DLBATCH_DLSLIME_MAX_TRANSFERS; unacknowledged buffers are reclaimed after "
                    f"DLBATCH_DLSLIME_LEASE_S={LEASE_S:g}s)"
                )
            slot = self.free_slots.pop()
            buf = self.take_idle_locked(cls)
        if buf is None:
            try:
                buf = self._create(cls)
            except BaseException:
                with self.lock:
                    self.free_slots.append(slot)
                raise
            with self.lock:
                self.created += 1
                self.out.append(buf)
        with self.lock:
            buf.slot = slot
            buf.gen = secrets.randbits(63) | 1  # odd, never 0; ~gen (the "abandoned" ack) is even
            buf.busy = buf.live = True
            self.slots[buf.slot, 2] = 0
            self.slots[buf.slot, 1] = 0
            self.slots[buf.slot, 0] = buf.gen
        return buf

    def owns(self, buf: _Buf, gen: int) -> bool:
        return buf.live and buf.gen == gen  # not a later transfer that reuses the buffer

    def closed(self, buf: _Buf, gen: int) -> None:
        with self.lock:
            if self.owns(buf, gen):
                buf.busy = False
                buf.closed_at = time.monotonic()

    def abort(self, buf: _Buf, gen: int) -> None:
        with self.lock:
            if self.owns(buf, gen):
                self._to_idle(buf, "aborted")

    def poll(self, buf: _Buf, gen: int) -> str | None:
        """A key of _RESULTS once transfer ``gen``'s buffer is back in the pool, else None."""
        with self.lock:
            if not self.owns(buf, gen):
                return self.results.get(gen, "reclaimed")
            state = self._ack_state(buf)
            if state is not None and not buf.busy:
                self._to_idle(buf, state)
            return state

    def slot_addr(self, buf: _Buf) -> int:
        return self.ctrl.ctypes.data + buf.slot * SLOT_SIZE

    def shutdown(self) -> None:
        """Stop the endpoint(s) (joins their I/O threads); outstanding transfers become unreadable."""
        if os.getpid() != self.pid:
            return
        with self.lock:
            eps, self.endpoints = list(self.endpoints.values()), {}
        for ep in eps:
            ep.shutdown()
        with self.lock:
            for buf in list(self.out):
                # an open sender's buffer is dropped, not pooled: views it lent may still be written
                self._to_idle(buf, "aborted", pool=not buf.busy)
            self.trim_locked(0, 0)


_STATE = PerProcess(_SenderState)
_FORK_INHERITED: list = []  # a forked child must never run the parent's endpoint destructors (no I/O thread here)


def _after_fork_in_child() -> None:
    """The parent's endpoints are unusable here (their I/O threads did not fork) and their C++
    destructors would join a thread that does not exist: keep them alive for good."""
    st = _STATE.obj
    if st is not None:
        import ctypes

        for ep in st.endpoints.values():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(ep))
        _FORK_INHERITED.append(st)
        _STATE.obj = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _state() -> _SenderState:
    return _STATE.get()


def pool_stats() -> dict:
    """Sender pool of this process: idle / outstanding buffers, and counts of how buffers came back."""
    st = _state()
    with st.lock:
        st.reclaim_locked()
        return {**st.stats_locked(), "endpoints": len(st.endpoints), **st.returns}


def drain_pool() -> int:
    """Free this process's idle sender buffers; returns how many."""
    return len(_state().drain())


def shutdown() -> None:
    """Shut this process's sender endpoint(s) down and free the pool. Receivers of transfers not
    yet read get SenderDied. The next ``open_sender`` starts a new endpoint (new port)."""
    st = _STATE.peek()
    if st is not None:
        st.shutdown()


class DLSlimeSender(KVSender):
    """``allow_network``: may the endpoint listen off loopback (None: ``network_allowed()``)."""

    def __init__(self, meta: KVMeta, verify: bool = True, ip: str | None = None, allow_network: bool | None = None):
        ip = ip or DEFAULT_IP
        self.meta = meta.without_checksums()
        self.verify = verify
        self._layout = buffer_layout(self.meta)
        st = _state()
        ep = st.endpoint(ip, network_allowed() if allow_network is None else allow_network)
        info = ep.endpoint_info()
        self._buf = st.acquire(self._layout.total_size)
        try:
            self._mem = self._buf.arr[: self._layout.total_size]
            write_header(self._mem, self.meta)
        except BaseException:
            st.abort(self._buf, self._buf.gen)
            raise
        self._handle = DLSlimeHandle(
            self.meta, str(info["host"]), int(info["port"]), os.getpid(), st.node, self._mem.ctypes.data,
            self._layout.total_size, st.slot_addr(self._buf), self._buf.gen, st.scope,
        )
        self._sent: set[int] = set()
        self._open = True
        self._aborted = False

    @property
    def handle(self) -> DLSlimeHandle:
        return self._handle

    def _check_open(self, what: str) -> None:
        if not self._open:
            state = "aborted" if self._aborted else "closed"
            raise TransferError(f"dlslime sender of transfer {self._handle.generation:#x} is {state}; cannot {what}")
        if not _state().owns(self._buf, self._handle.generation):
            self._open, self._aborted = False, True
            raise TransferError(
                f"dlslime transfer {self._handle.generation:#x} was aborted (its endpoint was shut down); cannot {what}"
            )

    def layer_buffer(self, i: int) -> np.ndarray:
        """Layer ``i``'s place in the registered buffer (writable, ``meta.layer_shape``): a producer that
        writes the layer there and then calls ``send_layer(i, that_view)`` saves the copy."""
        self._check_open(f"lend layer {i}'s buffer")
        if not 0 <= i < self.meta.num_layers:
            raise ValueError(f"layer {i} out of range [0, {self.meta.num_layers})")
        return layer_view(self._mem, self._layout, self.meta, i)

    def send_layer(self, i: int, array: np.ndarray) -> None:
        self._check_open(f"send layer {i}")
        if i in self._sent:
            raise ValueError(f"layer {i} was already sent in dlslime transfer {self._handle.generation:#x}")
        array = check_layer(self.meta, i, array)
        off = self._layout.layer_offsets[i]
        dst = self._mem[off : off + self.meta.layer_nbytes]
        algo = self.meta.checksum_algo if self.verify else None
        if array.ctypes.data == dst.ctypes.data:  # written in place through layer_buffer(i)
            csum = checksum(dst, algo) if algo else None
        else:  # the one copy, checksummed on the way
            csum = copy_checksum(dst, array, algo)
        entry = self._layout.table_offset + i * ENTRY_SIZE
        _ENTRY.pack_into(self._mem, entry, csum or 0, 0, csum is not None)
        self._mem[entry + 8] = 1  # ready flag written last
        self._sent.add(i)

    def close(self, timeout: float = 60.0) -> DLSlimeHandle:
        """All layers are in the buffer; it stays readable until the receiver acknowledges (or the lease)."""
        if self._open:
            missing = sorted(set(range(self.meta.num_layers)) - self._sent)
            if missing:
                raise TransferError(
                    f"dlslime sender closed with layers {missing} never sent (transfer {self._handle.generation:#x})"
                )
            self._open = False
            _state().closed(self._buf, self._handle.generation)
        return self._handle

    def wait_received(self, timeout: float = 60.0) -> None:
        """Block until the receiver has read everything and acknowledged (the buffer is then back in
        the pool). Raises TransferError if it gave up, TransferTimeout past ``timeout``."""
        h = self._handle
        deadline = Deadline(timeout, f"the receiver of dlslime transfer {h.generation:#x} from {h.where} to acknowledge")
        st = _state()
        sleep = 1e-4
        while True:
            state = st.poll(self._buf, h.generation)
            if state == "received" and not self._open:
                return
            if state is not None and state != "received":
                why = _RESULTS.get(state, "its buffer was already reclaimed")
                raise TransferError(f"dlslime transfer {h.generation:#x} from {h.where} was not fully received: {why}")
            if deadline.expired():
                raise deadline.error("no acknowledgement" + (" (the sender is not closed yet)" if self._open else ""))
            time.sleep(min(sleep, deadline.remaining()))
            sleep = min(2 * sleep, 0.005)

    def abort(self) -> None:
        """Give up: receivers see "aborted"; the buffer goes back to the pool."""
        self._open, self._aborted = False, True
        _state().abort(self._buf, self._handle.generation)


# ---------------------------------------------------------------- receiver side
class _RxPool:
    """Per process: staging buffers of receivers (kept warm across transfers)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.idle: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        cls = _size_class(nbytes)
        with self.lock:
            for k, arr in enumerate(self.idle):
                if arr.nbytes == cls:
                    return self.idle.pop(k)
        return np.empty(cls, dtype=np.uint8)

    def give(self, arr: np.ndarray) -> None:
        with self.lock:
            self.idle.append(arr)
            while self.idle and (len(self.idle) > RX_POOL_MAX_BUFFERS or sum(a.nbytes for a in self.idle) > RX_POOL_MAX_BYTES):
                self.idle.pop(0)

    def clear(self) -> None:
        with self.lock:
            self.idle = []


_RX_POOL = _RxPool()


def drop_receiver_buffers() -> None:
    """Free this process's idle receiver staging buffers."""
    _RX_POOL.clear()


class _Read:
    """One layer's read: ``fut`` None until issued (deferred when its destination overlaps the
    layer still being handed out)."""

    __slots__ = ("i", "fut", "dst", "direct", "nbytes")

    def __init__(self, i, dst, direct, nbytes):
        self.i, self.fut, self.dst, self.direct, self.nbytes = i, None, dst, direct, nbytes


def check_reachable(handle: DLSlimeHandle, allow_network: bool) -> None:
    """Refuse (TransportUnavailable) a handle whose endpoint this process must not connect to:
    a loopback endpoint of another loopback scope (another node: the same port here may be
    another process's endpoint), or a network endpoint without the job's opt-in."""
    if is_loopback(handle.host):
        if handle.scope and handle.scope != loopback_scope():
            raise TransportUnavailable(
                f"{handle.where} listens on loopback of another node (or network namespace) than this receiver "
                f"on {socket.gethostname()}: loopback does not cross nodes. Place the prefill and decode pools on "
                f"one node, or set {ALLOW_NETWORK_SETTING}: true and DLBATCH_DLSLIME_IP to each node's "
                f"private address (docs/transfer.md says what that exposes)"
            )
        return
    if not allow_network:
        raise TransportUnavailable(
            f"{handle.where} listens on a network address; this receiver connects to loopback endpoints only "
            f"unless the job sets {ALLOW_NETWORK_SETTING}: true (docs/transfer.md says what that exposes)"
        )


class DLSlimeReceiver(KVReceiver):
    """Reads a sender's buffer layer by layer. Views yielded without ``out`` live in a pooled
    staging buffer: valid until ``release``. ``allow_network``: may it connect to an endpoint
    off loopback (None: ``network_allowed()``)."""

    def __init__(self, handle: DLSlimeHandle, verify: bool = True, allow_network: bool | None = None):
        import dlslime

        if not isinstance(handle, DLSlimeHandle):
            raise TypeError(f"DLSlimeReceiver needs a DLSlimeHandle, got {type(handle).__name__}")
        self._ep = None
        self._released = False
        self._stage: np.ndarray | None = None
        self._pending: _Read | None = None
        check_reachable(handle, network_allowed() if allow_network is None else allow_network)
        self.handle = handle
        self.meta = handle.meta
        self.verify = verify
        self._layout = buffer_layout(self.meta)
        if self._layout.total_size != handle.size:
            raise LayoutMismatch(f"{handle.where}: buffer of {handle.size} bytes, its meta needs {self._layout.total_size}")
        self._done = 0
        self._ok = False
        self._checked = False  # the slot's generation was seen to be ours
        self._may_ack = True  # False once the slot is known not to be ours, or the sender is gone
        self._nreg = 0
        n = self.meta.num_layers
        self._table_end = self._layout.table_offset + n * ENTRY_SIZE
        # [0, 32) copy of the slot, [32, 40) the ack word we write, [64, ...) copy of header..table
        self._ctl = np.zeros(_PREFIX_OFF + self._table_end, dtype=np.uint8)
        try:
            socket.create_connection((handle.host, handle.port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise self._gone(f"connecting ({e})", 0) from None
        # the constructor always listens; nobody needs to reach the receiver: loopback only
        self._ep = dlslime.TcpEndpoint("127.0.0.1", 0)
        try:
            ep = self._ep
            self._lctl = ep.register_memory_region("ctl", self._ctl.ctypes.data, 0, self._ctl.nbytes)
            self._rslot = ep.register_remote_memory_region("slot", {"addr": handle.slot_addr, "length": SLOT_SIZE})
            self._rbuf = ep.register_remote_memory_region("kv", {"addr": handle.addr, "length": handle.size})
            self._lstage = -1
            ep.connect({"host": handle.host, "port": handle.port})
            if not ep.is_connected():
                raise self._gone("connecting", 0)
        except BaseException:
            self._may_ack = False
            self.release()
            raise

    # -- helpers
    def _gone(self, what: str, i: int, status: int | None = None) -> SenderDied:
        self._may_ack = False
        h = self.handle
        why = ""
        if h.node == socket.gethostname():
            why = "; the process no longer exists" if not _pid_alive(h.pid) else "; its endpoint is shut down"
        st = f" (dlslime status {status})" if status is not None else ""
        return SenderDied(f"{h.where} is gone: {what} failed{st} after {i} of {self.meta.num_layers} layers{why}")

    def _wait(self, fut, deadline: Deadline, what: str, i: int, cap: float = 5e-4) -> None:
        sleep = 2e-5
        while True:
            st = fut.wait_for(0)  # never spins: wait() would burn a core, wait_for(s) holds the GIL
            if st is not None:
                break
            if deadline.expired():
                raise deadline.error(f"{what} did not complete; {i} of {self.meta.num_layers} layers arrived")
            time.sleep(min(sleep, deadline.remaining()))
            sleep = min(2 * sleep, cap)
        if st != 0:
            raise self._gone(what, i, st)

    def _poll(self, deadline: Deadline, what: str, i: int, whole_prefix: bool = False) -> None:
        """Read the slot and the layer table (plus header and meta the first time) into ``_ctl``."""
        start = 0 if whole_prefix else self._layout.table_offset
        fut = self._ep.read([
            (self._lctl, self._rslot, 0, 0, SLOT_SIZE),
            (self._lctl, self._rbuf, start, _PREFIX_OFF + start, self._table_end - start),
        ])
        self._wait(fut, deadline, what, i, cap=2e-3)
        gen, aborted = (int(x) for x in self._ctl[:16].view("<u8"))
        h = self.handle
        if gen != h.generation:
            self._may_ack = False
            if aborted == h.generation:
                raise TransferError(f"{h.where} aborted transfer {h.generation:#x} after {i} of {self.meta.num_layers} layers")
            raise TransferError(
                f"{h.where}: transfer {h.generation:#x} was already received and its buffer reused (or its "
                f"{LEASE_S:g}s lease expired); slot generation is now {gen:#x}"
            )
        self._checked = True

    def _entry(self, i: int) -> tuple[bool, int | None]:
        csum, ready, has = _ENTRY.unpack_from(self._ctl, _PREFIX_OFF + self._layout.table_offset + i * ENTRY_SIZE)
        return bool(ready), (csum if has else None)

    def _open_check(self, deadline: Deadline) -> None:
        self._poll(deadline, "reading the sender's header", 0, whole_prefix=True)
        meta, _ = read_header(memoryview(self._ctl)[_PREFIX_OFF:])
        if meta.fingerprint != self.meta.fingerprint:
            raise FingerprintMismatch(self.meta.fingerprint, meta.fingerprint)
        if meta.without_checksums() != self.meta.without_checksums():
            raise LayoutMismatch(f"{self.handle.where}: buffer holds {meta}, handle says {self.meta}")

    def _wait_ready(self, i: int, deadline: Deadline) -> None:
        sleep = 5e-5
        while not self._entry(i)[0]:
            if deadline.remaining() < 0.01:  # no time left for another look
                time.sleep(deadline.remaining())
                raise deadline.error(f"layer {i} not ready; {i} of {self.meta.num_layers} layers arrived")
            time.sleep(min(sleep, deadline.remaining() - 0.01))
            sleep = min(2 * sleep, 2e-3)
            self._poll(deadline, f"reading layer {i}'s ready flag", i)

    def _plan(self, i: int, out) -> _Read:
        """Where layer i goes: straight into ``out(i)`` when it is a C-contiguous writable array of
        the layer's size (registered in this receiver's endpoint), else the staging buffer."""
        nbytes = self.meta.layer_nbytes
        dst = out(i) if out is not None else None
        direct = (isinstance(dst, np.ndarray) and dst.flags.c_contiguous and dst.flags.writeable
                  and dst.nbytes == nbytes)
        return _Read(i, dst, direct, nbytes)

    def _issue(self, op: _Read) -> None:
        i, nbytes = op.i, op.nbytes
        if op.direct:
            self._nreg += 1
            lh = self._ep.register_memory_region(f"dst{self._nreg}", op.dst.ctypes.data, 0, nbytes)
            if lh < 0:
                raise TransferError(f"dlslime could not register layer {i}'s destination ({nbytes} bytes)")
            op.fut = self._ep.read([(lh, self._rbuf, self._layout.layer_offsets[i], 0, nbytes)])
            return
        if self._stage is None:
            self._stage = _RX_POOL.take(self._layout.total_size)
            self._lstage = self._ep.register_memory_region("stage", self._stage.ctypes.data, 0, self._stage.nbytes)
        off = self._layout.layer_offsets[i]  # the staging buffer mirrors the sender's layout
        op.fut = self._ep.read([(self._lstage, self._rbuf, off, off, nbytes)])

    @staticmethod
    def _overlap(a: _Read, b: _Read) -> bool:
        if not (a.direct and b.direct):
            return False  # staging regions of different layers never overlap
        pa, pb = a.dst.ctypes.data, b.dst.ctypes.data
        return pa < pb + b.nbytes and pb < pa + a.nbytes

    def _finish(self, op: _Read, csum: int | None) -> np.ndarray:
        i = op.i
        if op.direct:
            if self.verify and csum is not None:
                got = checksum(op.dst, self.meta.checksum_algo)
                if got != csum:
                    raise CorruptPayload(i, csum, got, self.meta.checksum_algo)
            return op.dst
        src = layer_view(self._stage, self._layout, self.meta, i)
        return self._take_layer(i, src, csum, None if op.dst is None else (lambda _i: op.dst))

    # -- interface
    def receive_layers(self, timeout: float, out=None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(i, layer)`` in order as each layer is ready in the sender's buffer.

        ``out``: optional ``out(i) -> ndarray`` destination of layer i (``meta.layer_nbytes`` bytes).
        A C-contiguous writable one is read into directly (then verified: one pass over it);
        otherwise the layer lands in a staging buffer and is copied with the checksum computed on
        the way. The destination is yielded. Without ``out`` a verified view of the staging
        buffer is yielded (valid until ``release``). Once the last layer is verified the sender
        is acknowledged and this receiver's endpoint shut down, before it is yielded.
        """
        h = self.handle
        deadline = Deadline(timeout, f"KV layers from {h.where}")
        if self._released:
            raise TransferError(f"dlslime receiver of {h.where} was released")
        n = self.meta.num_layers
        try:
            if self._done < n and not self._checked:
                self._open_check(deadline)
            while self._done < n:
                i = self._done
                if self._pending is None:
                    self._wait_ready(i, deadline)
                    self._pending = self._plan(i, out)
                op = self._pending
                if op.fut is None:
                    self._issue(op)
                self._wait(op.fut, deadline, f"reading layer {i} ({op.nbytes} bytes)", i)
                self._pending = None
                # the slot again: layer i was read before any reuse; its checksum from this later read
                self._poll(deadline, f"reading the sender's table after layer {i}", i + 1)
                csum = self._entry(i)[1]
                if i + 1 < n and self._entry(i + 1)[0]:
                    nxt = self._plan(i + 1, out)
                    if not self._overlap(nxt, op):
                        self._issue(nxt)  # in flight while layer i is verified / copied / consumed
                    self._pending = nxt
                arr = self._finish(op, csum)
                self._done = i + 1
                if self._done == n:
                    self._ok = True
                    self._close_endpoint()  # everything is here: ack, and drop the endpoint's thread now
                yield i, arr
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Acknowledge to the sender if not done yet (``~generation``: gave up), shut this receiver's
        endpoint down, and give the staging buffer back (views of it become invalid)."""
        self._released = True
        try:
            self._close_endpoint()
        finally:
            stage, self._stage = self._stage, None
            if stage is not None:
                _RX_POOL.give(stage)

    def _close_endpoint(self) -> None:
        ep, self._ep = self._ep, None
        if ep is None:
            return
        try:
            if self._may_ack:
                self._ack(ep)
        finally:
            ep.shutdown()  # joins the endpoint's I/O thread: nothing writes into our buffers after this
            self._pending = None

    def _ack(self, ep) -> None:
        """Write ``generation`` (full receive) or ``~generation`` (gave up) into the sender's slot, then
        read the slot back until it shows it (the write and the read travel on different connections),
        so that once this returns the sender sees the ack. Bounded by ACK_TIMEOUT_S; if it does not
        land, the sender's lease reclaims the buffer."""
        end = time.monotonic() + ACK_TIMEOUT_S

        def settle(fut) -> int | None:
            while True:
                st = fut.wait_for(0)
                if st is not None or time.monotonic() >= end:
                    return st
                time.sleep(5e-5)

        if self._pending is not None and self._pending.fut is not None and settle(self._pending.fut) is None:
            return  # a read still in flight: the sender must not reuse the buffer under it
        g = self.handle.generation
        word = g if self._ok else g ^ _MASK64
        self._ctl[32:40].view("<u8")[0] = word
        if settle(ep.write([(self._lctl, self._rslot, 16, 32, 8)])) != 0:  # -> the slot's ack word
            return
        while time.monotonic() < end:
            if settle(ep.read([(self._lctl, self._rslot, 0, 0, SLOT_SIZE)])) != 0:
                return
            if int(self._ctl[16:24].view("<u8")[0]) == word or int(self._ctl[:8].view("<u8")[0]) != g:
                return

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class DLSlimeTransport(Transport):
    """``ip``: the address the sender endpoint binds and puts in its handles (default
    ``$DLBATCH_DLSLIME_IP`` or 127.0.0.1; across nodes, this node's private-network address).
    ``allow_network``: the job's opt-in to an endpoint off loopback (None:
    ``$DLBATCH_DLSLIME_ALLOW_NETWORK``); without it a non-loopback ``ip`` is refused here."""

    name = "dlslime"

    def __init__(self, ip: str | None = None, allow_network: bool | None = None):
        ip = ip or DEFAULT_IP
        self.allow_network = network_allowed() if allow_network is None else bool(allow_network)
        check_listen_address(ip, self.allow_network)
        reason = unavailable_reason()
        if reason:
            raise TransportUnavailable(f"the 'dlslime' KV transport is unavailable: {reason}")
        self.ip = ip

    def open_sender(self, meta: KVMeta, *, verify: bool | None = None) -> DLSlimeSender:
        return DLSlimeSender(meta, True if verify is None else verify, self.ip, self.allow_network)

    def open_receiver(self, handle: DLSlimeHandle, *, verify: bool | None = None) -> DLSlimeReceiver:
        return DLSlimeReceiver(handle, True if verify is None else verify, self.allow_network)
