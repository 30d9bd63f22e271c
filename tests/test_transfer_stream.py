"""The engine's layer-wise KV stream onto transports (dlbatch/transfer/sink.py): the shm
sender lends its segment so the export gather writes there directly; the sink hands layers
over on a background thread in order; aborting frees the transfer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dlbatch.transfer import payload as P
from dlbatch.transfer.choose import get_transport
from dlbatch.transfer.sink import TransportSink

FP = "llama:stream"


def _layers(dtype, n=4, tokens=33, heads=2, dim=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, tokens, heads, dim, generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_sink_gathers_into_the_segment(dtype):
    layers = _layers(dtype)
    meta = P.make_meta(FP, P.dtype_name(dtype), len(layers), *layers[0].shape[1:])
    tr = get_transport("shm", same_node=True)
    sink = TransportSink(tr.open_sender(meta))
    for i, layer in enumerate(layers):
        buf = sink.layer_buffer(i)
        assert buf is not None and buf.dtype == dtype and tuple(buf.shape) == meta.layer_shape
        buf.copy_(layer)  # what the engine's export gather does
        sink.send_layer(i, buf)
    handle = sink.finish(timeout=10)
    rx = tr.open_receiver(handle)
    got = [a.copy() for _, a in rx.receive_layers(timeout=10)]  # checksums verified on the way
    rx.release()
    assert [g.tobytes() for g in got] == [P.tensor_to_numpy(t).tobytes() for t in layers]


def test_shm_sink_copies_a_foreign_tensor_and_detects_corruption():
    from dlbatch.transfer.errors import CorruptPayload, TransferError

    layers = _layers(torch.float32)
    meta = P.make_meta(FP, "float32", len(layers), *layers[0].shape[1:])
    tr = get_transport("shm", same_node=True)
    sink = TransportSink(tr.open_sender(meta))
    for i, layer in enumerate(layers):
        sink.send_layer(i, layer)  # not the lent buffer: copied in, checksummed
    handle = sink.finish(timeout=10)
    with pytest.raises(TransferError, match="closed"):
        sink.sender.layer_buffer(0)  # the sender is closed: no more buffers
    rx = tr.open_receiver(handle)
    view = None
    for i, a in rx.receive_layers(timeout=10):
        if i == 1:
            view = a
    assert np.array_equal(view, P.tensor_to_numpy(layers[1]))
    rx.release()
    # a layer changed after its checksum was taken is caught by the receiver
    sink = TransportSink(tr.open_sender(meta))
    for i, layer in enumerate(layers):
        buf = sink.layer_buffer(i)
        buf.copy_(layer)
        sink.send_layer(i, buf)
    handle = sink.finish(timeout=10)
    rx = tr.open_receiver(handle)
    it = rx.receive_layers(timeout=10)
    next(it)
    arr = rx._shm.buf  # flip one byte of layer 2 in the shared pages
    off = P.buffer_layout(meta).layer_offsets[2]
    arr[off] ^= 0xFF
    with pytest.raises(CorruptPayload, match="layer 2"):
        for _ in it:
            pass
    rx.release()


def test_sink_abort_frees_and_finish_times_out_clearly():
    from dlbatch.transfer.errors import TransferError

    layers = _layers(torch.float32)
    meta = P.make_meta(FP, "float32", len(layers), *layers[0].shape[1:])
    tr = get_transport("shm", same_node=True)
    sink = TransportSink(tr.open_sender(meta))
    sink.send_layer(0, layers[0])
    with pytest.raises(TransferError, match="never sent"):
        sink.finish(timeout=5)  # layers 1-3 missing: refused, and the segment freed
    sink = TransportSink(tr.open_sender(meta))
    sink.send_layer(0, layers[0])
    sink.abort()
    with pytest.raises(TransferError, match="closed"):
        sink.sender.send_layer(1, P.tensor_to_numpy(layers[1]))


def test_sink_opens_its_sender_only_when_the_first_layer_comes():
    from dlbatch.transfer.errors import TruncatedPayload

    layers = _layers(torch.float32)
    meta = P.make_meta(FP, "float32", len(layers), *layers[0].shape[1:])
    tr = get_transport("shm", same_node=True)
    opened = []

    def open_():
        opened.append(1)
        return tr.open_sender(meta)

    sink = TransportSink(open=open_)
    assert not opened  # a queued request holds no segment
    for i, layer in enumerate(layers):
        sink.send_layer(i, layer)
    assert len(opened) == 1
    rx = tr.open_receiver(sink.finish(timeout=10))
    assert [a.tobytes() for _, a in rx.receive_layers(timeout=10)] == [P.tensor_to_numpy(t).tobytes() for t in layers]
    rx.release()
    never = TransportSink(open=open_)
    with pytest.raises(TruncatedPayload, match="before any layer"):
        never.finish(timeout=5)
    never.abort()
    assert len(opened) == 1
    with pytest.raises(ValueError, match="not both"):
        TransportSink(tr.open_sender(meta), open=open_)
