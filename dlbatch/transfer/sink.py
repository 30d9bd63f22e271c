"""The engine's layer-wise KV stream (``dlbatch.engine.pd.KVSink``) onto a transport sender.

The prefill engine calls ``send_layer(i, kv)`` from inside its forward, right after layer
``i`` stored its KV. ``TransportSink`` hands each layer to a background thread (in order)
that passes it to the transport's sender -- the object store's checksum and ``ray.put``,
the shm segment's checksum and ready flag -- so the engine goes on with layer ``i+1``
while layer ``i`` travels. When the sender can lend its own memory (``layer_buffer``:
shm), the engine gathers the layer straight into it and the copy into the segment
disappears.

A layer on a CUDA device is staged: a copy into a pinned host buffer is queued on a
side stream (after the gather that made the layer, on the engine's stream) and an event
recorded; the background thread waits for that event, then hands the host copy (or, for
a sender that lends memory, copies it into that memory) to the sender. The forward never
waits for a device-to-host copy. The engine does not gather a CUDA layer into lent host
memory (``index_select`` cannot write across devices). A CPU layer takes neither step.

``finish(timeout)`` waits for the stream and returns the sender's handle (what the
receiver needs); ``abort()`` drops everything. The engine imports nothing of this module.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from dlbatch.transfer.base import Deadline, KVSender
from dlbatch.transfer.payload import KVMeta, tensor_to_numpy, torch_dtype


class TransportSink:
    """``TransportSink(sender)``, or ``TransportSink(open=lambda: transport.open_sender(meta))``
    to open the sender only when the first layer comes (a prefill worker queues many
    requests; their shm segments / buffers are taken when each one's prefill runs)."""

    def __init__(self, sender: KVSender | None = None, background: bool = True, *, open=None):
        if (sender is None) == (open is None):
            raise ValueError("TransportSink needs a sender or an open() that makes one, not both")
        self._sender = sender
        self._open = open
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-stream") if background else None
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    @property
    def sender(self) -> KVSender:
        if self._sender is None:
            self._sender = self._open()
        return self._sender

    @property
    def meta(self) -> KVMeta:
        return self.sender.meta

    @property
    def _lends(self) -> bool:
        return hasattr(self.sender, "layer_buffer")

    def layer_buffer(self, i: int):
        """The sender's own memory for layer i as a torch tensor in the KV dtype, or None."""
        if not self._lends:
            return None
        import torch

        arr = self.sender.layer_buffer(i)
        t = torch.from_numpy(arr)
        want = torch_dtype(self.meta.dtype)
        return t.view(want) if t.dtype != want else t

    def send_layer(self, i: int, kv) -> None:
        if getattr(kv, "is_cuda", False):
            host, event = stage_to_host(kv)
            with self._lock:
                job = (lambda: self._send_staged(i, host, event))
                if self._pool is None:
                    job()
                    fut: Future = Future()
                    fut.set_result(None)
                else:
                    fut = self._pool.submit(job)
                self._futures.append(fut)
            return
        arr = tensor_to_numpy(kv)  # a view of kv (kept alive by the array) unless it must move to CPU
        with self._lock:
            if self._pool is None:
                fut: Future = Future()
                self.sender.send_layer(i, arr)
                fut.set_result(None)
            else:
                fut = self._pool.submit(self.sender.send_layer, i, arr)
            self._futures.append(fut)

    def _send_staged(self, i: int, host, event) -> None:
        event.synchronize()  # the side stream's copy of layer i has landed in `host`
        dst = self.layer_buffer(i)
        if dst is not None:  # the sender's own memory (shm, dlslime): one host copy into it
            dst.copy_(host)
            host = dst
        self.sender.send_layer(i, tensor_to_numpy(host))

    def finish(self, timeout: float = 60.0):
        """Wait until every layer was handed over; close the sender; return its handle."""
        if self._sender is None:
            from dlbatch.transfer.errors import TruncatedPayload

            self.abort()
            raise TruncatedPayload("the KV stream was finished before any layer was sent")
        deadline = Deadline(timeout, f"streaming {self.meta.num_layers} KV layers into the transport")
        try:
            for k, fut in enumerate(self._futures):
                try:
                    fut.result(timeout=deadline.remaining())
                except FutureTimeout:
                    raise deadline.error(f"layer {k} still being handed over") from None
            return self.sender.close(timeout=max(deadline.remaining(), 1e-3))
        except BaseException:
            self.abort()
            raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._futures.clear()
        if self._sender is not None:  # never opened: nothing to free
            self._sender.abort()


_SIDE_STREAMS: dict = {}


def stage_to_host(kv):
    """Queue a copy of the CUDA tensor ``kv`` into a new pinned host tensor on a side
    stream of its device (ordered after the work already queued on the current stream);
    returns (host tensor, event recorded after the copy). ``kv``'s memory is kept for the
    side stream (``record_stream``) so the caching allocator does not reuse it early."""
    import torch

    dev = kv.device
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(device=dev)
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        host.copy_(kv, non_blocking=True)
        kv.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
    return host, event
