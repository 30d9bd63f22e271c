"""KV payload: what a prefill engine exports and a decode engine imports.

A payload is per layer one array of shape ``(2, num_tokens, kv_heads, head_dim)``
(K and V stacked, token-major). It does not depend on the engine's block size:
the exporter gathers its blocks into token order, the importer scatters them into
its own blocks, so two engines with different block sizes exchange KV for free.

bfloat16 has no numpy dtype; its layers are held as ``uint16`` views of the same
bytes and the real dtype is in :class:`KVMeta`.

Flat buffer format (``to_buffer`` / ``from_buffer``, also the shared-memory layout)::

    0   4s   magic b"DLKV"
    4   u16  format version (1)
    6   u16  reserved (0)
    8   u64  total size in bytes
    16  u32  meta JSON length (m)
    20  u32  number of layers (n)
    24  u64  offset of layer 0 (64-byte aligned)
    32  m    meta JSON (utf-8)
    ..  n*16 layer table: u64 checksum, u8 ready, u8 has_checksum, 6 pad
    ..       layer bytes, each layer 64-byte aligned

The per-layer ``ready`` byte is written after the layer's bytes and checksum, so
a reader can consume layer i while layer i+1 is still being written.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from dlbatch.transfer import fastcopy as _fastcopy
from dlbatch.transfer.errors import (
    CorruptPayload,
    FingerprintMismatch,
    LayoutMismatch,
    TruncatedPayload,
)

if TYPE_CHECKING:  # torch is imported lazily: the format itself needs numpy only
    import torch

LAYOUT_VERSION = "token_major_v1"
FORMAT_VERSION = 1
MAGIC = b"DLKV"
ALIGN = 64
_HEADER = struct.Struct("<4sHHQIIQ")  # magic, version, reserved, total, meta_len, n_layers, data_off
_ENTRY = struct.Struct("<QBB6x")  # checksum, ready, has_checksum
ENTRY_SIZE = _ENTRY.size

# dtype name -> (numpy storage dtype, itemsize)
_NP_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}
DTYPES = tuple(_NP_STORAGE)
CHECKSUM_ALGOS = ("sum64", "crc32")


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# ---------------------------------------------------------------- checksums
def _bytes_view(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def checksum(arr: np.ndarray, algo: str = "sum64") -> int:
    """Checksum of an array's bytes.

    ``sum64``: the wrapping sum of the bytes read as little-endian uint64 words (tail
    zero-padded). Runs at memory bandwidth (about memcpy speed); catches any single
    corrupted byte, truncation and zeroed pages, not swapped 8-byte words.
    ``crc32``: zlib CRC-32 (stronger, ~1.8 GB/s per core here, several times slower
    than memcpy); chunks of 16 MiB are hashed and the chunk CRCs CRC'd again.
    """
    b = _bytes_view(arr)
    if algo == "sum64":
        if b.size >= _NATIVE_MIN and _fastcopy.available():
            return _fastcopy.sum64(b)
        n8 = b.size // 8
        total = int(np.add.reduce(b[: n8 * 8].view("<u8"), dtype=np.uint64)) if n8 else 0
        tail = b[n8 * 8 :]
        if tail.size:
            pad = np.zeros(8, dtype=np.uint8)
            pad[: tail.size] = tail
            total += int(pad.view("<u8")[0])
        return (total + b.size) & 0xFFFFFFFFFFFFFFFF
    if algo == "crc32":
        chunk = 16 << 20
        mv = memoryview(b)
        crcs = [zlib.crc32(mv[i : i + chunk]) for i in range(0, b.size, chunk)]
        return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs)) if len(crcs) != 1 else crcs[0]
    raise ValueError(f"unknown checksum algorithm {algo!r}; expected one of {CHECKSUM_ALGOS}")


_FUSED_CHUNK = 512 << 10  # fits in L2: the checksum reads the chunk just copied from cache
_NATIVE_MIN = 64 << 10  # below this the ctypes call overhead is not worth it


def copy_checksum(dst: np.ndarray, src: np.ndarray, algo: str | None = "sum64") -> int | None:
    """Copy ``src``'s bytes into ``dst`` (same byte size) and return ``checksum(dst, algo)``.

    ``sum64`` (and ``algo=None``, copy only) use the native fused loop of
    :mod:`dlbatch.transfer.fastcopy` when it is available: one read of each word, added
    to the checksum in registers, non-temporal stores, GIL released. Otherwise numpy:
    the copy goes in 512 KiB chunks and each chunk is summed while still in cache.
    ``crc32``: copy, then checksum.
    """
    if not dst.flags.c_contiguous:
        raise ValueError("copy_checksum: destination must be C-contiguous")
    s, d = _bytes_view(src), dst.reshape(-1).view(np.uint8)
    if d.size != s.size:
        raise ValueError(f"copy_checksum: destination has {d.size} bytes, source {s.size}")
    if not d.flags.writeable:
        raise ValueError("copy_checksum: destination is read-only")
    if algo in ("sum64", None) and s.size >= _NATIVE_MIN and d.flags.c_contiguous and _fastcopy.available():
        return _fastcopy.copy_sum64(d, s, algo is not None)
    if algo != "sum64":
        np.copyto(d, s)
        return None if algo is None else checksum(d, algo)
    n8 = s.size // 8 * 8
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for off in range(0, n8, _FUSED_CHUNK):
            end = min(off + _FUSED_CHUNK, n8)
            np.copyto(d[off:end], s[off:end])
            total += np.add.reduce(d[off:end].view("<u8"), dtype=np.uint64)
    total = int(total)
    if n8 < s.size:
        np.copyto(d[n8:], s[n8:])
        pad = np.zeros(8, dtype=np.uint8)
        pad[: s.size - n8] = s[n8:]
        total += int(pad.view("<u8")[0])
    return (total + s.size) & 0xFFFFFFFFFFFFFFFF


# ---------------------------------------------------------------- meta
@dataclass(frozen=True)
class KVMeta:
    """Describes a KV payload. ``checksums`` is one entry per layer, or None (unverified)."""

    fingerprint: str
    dtype: str
    num_layers: int
    num_tokens: int
    kv_heads: int
    head_dim: int
    layout: str = LAYOUT_VERSION
    checksums: tuple[int, ...] | None = None
    checksum_algo: str = "sum64"

    def __post_init__(self):
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise ValueError(f"KVMeta.fingerprint must be a non-empty str, got {self.fingerprint!r}")
        if self.dtype not in _NP_STORAGE:
            raise ValueError(f"KVMeta.dtype {self.dtype!r} is not supported; expected one of {DTYPES}")
        for name in ("num_layers", "num_tokens", "kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"KVMeta.{name} must be a positive int, got {v!r}")
        if self.checksum_algo not in CHECKSUM_ALGOS:
            raise ValueError(f"KVMeta.checksum_algo {self.checksum_algo!r} is not one of {CHECKSUM_ALGOS}")
        if self.checksums is not None:
            object.__setattr__(self, "checksums", tuple(int(c) for c in self.checksums))
            if len(self.checksums) != self.num_layers:
                raise ValueError(
                    f"KVMeta.checksums has {len(self.checksums)} entries for {self.num_layers} layers"
                )

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.kv_heads, self.head_dim)

    @property
    def storage_dtype(self) -> np.dtype:
        """numpy dtype the layers are held in (uint16 for bfloat16)."""
        return _NP_STORAGE[self.dtype]

    @property
    def layer_nbytes(self) -> int:
        return 2 * self.num_tokens * self.kv_heads * self.head_dim * self.storage_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.layer_nbytes * self.num_layers

    def without_checksums(self) -> "KVMeta":
        return replace(self, checksums=None)

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["checksums"] = list(self.checksums) if self.checksums is not None else None
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str | bytes) -> "KVMeta":
        try:
            d = json.loads(s)
        except (ValueError, UnicodeDecodeError) as e:
            raise TruncatedPayload(f"KV payload meta is not valid JSON ({e}): {s[:80]!r}") from e
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise LayoutMismatch(f"KV payload meta has unknown fields {sorted(unknown)}")
        return cls(**d)


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {DTYPES}")
    return table[name]


def dtype_name(dt: "torch.dtype") -> str:
    import torch

    table = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if dt not in table:
        raise ValueError(f"KV dtype {dt} is not supported; expected one of {DTYPES}")
    return table[dt]


# ---------------------------------------------------------------- payload
@dataclass
class KVPayload:
    meta: KVMeta
    layers: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.layers)

    def torch_layers(self, expected_fingerprint: str | None = None) -> list:
        """Checked (``validate``), then every layer as a torch tensor view: what an engine's
        decode imports (``LLM.decode`` takes any KV object with this method)."""
        validate(self, expected_fingerprint=expected_fingerprint)
        return [layer_to_torch(self, i) for i in range(self.meta.num_layers)]


def make_meta(
    fingerprint: str,
    dtype: str,
    num_layers: int,
    num_tokens: int,
    kv_heads: int,
    head_dim: int,
    checksum_algo: str = "sum64",
) -> KVMeta:
    """Meta for a payload whose layers are not computed yet (streaming senders)."""
    return KVMeta(fingerprint, dtype, num_layers, num_tokens, kv_heads, head_dim, checksum_algo=checksum_algo)


def check_layer(meta: KVMeta, i: int, arr: np.ndarray) -> np.ndarray:
    """Check one layer against the meta; returns it C-contiguous. Raises LayoutMismatch."""
    if not isinstance(i, (int, np.integer)) or not 0 <= i < meta.num_layers:
        raise LayoutMismatch(f"layer index {i!r} out of range for {meta.num_layers} layers")
    if not isinstance(arr, np.ndarray):
        raise LayoutMismatch(f"layer {i} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != meta.storage_dtype:
        raise LayoutMismatch(
            f"layer {i} has numpy dtype {arr.dtype}, expected {meta.storage_dtype} for KV dtype {meta.dtype}"
        )
    if tuple(arr.shape) != meta.layer_shape:
        raise LayoutMismatch(f"layer {i} has shape {tuple(arr.shape)}, expected {meta.layer_shape}")
    return np.ascontiguousarray(arr)


def tensor_to_numpy(t: "torch.Tensor") -> np.ndarray:
    """CPU numpy view of a KV tensor (bfloat16 -> uint16 view); copies only if it must."""
    import torch

    dtype_name(t.dtype)  # validates
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy()


def from_torch_layers(
    layers: Sequence["torch.Tensor"], fingerprint: str, *, checksums: bool = True, checksum_algo: str = "sum64"
) -> KVPayload:
    """Build a payload from per-layer tensors ``(2, num_tokens, kv_heads, head_dim)``.

    Zero-copy for contiguous CPU tensors (the arrays share their memory).
    """
    if len(layers) == 0:
        raise ValueError("from_torch_layers needs at least one layer, got an empty list")
    first = layers[0]
    if first.dim() != 4 or first.shape[0] != 2:
        raise LayoutMismatch(
            f"layer 0 has shape {tuple(first.shape)}, expected (2, num_tokens, kv_heads, head_dim)"
        )
    meta = make_meta(fingerprint, dtype_name(first.dtype), len(layers), *map(int, first.shape[1:]), checksum_algo)
    arrays = []
    for i, t in enumerate(layers):
        if t.dtype != first.dtype:
            raise LayoutMismatch(f"layer {i} has dtype {t.dtype}, layer 0 has {first.dtype}")
        arrays.append(check_layer(meta, i, tensor_to_numpy(t)))
    if checksums:
        meta = replace(meta, checksums=tuple(checksum(a, checksum_algo) for a in arrays))
    return KVPayload(meta, arrays)


def layer_to_torch(payload: KVPayload, i: int, device=None, dtype=None) -> "torch.Tensor":
    """Layer ``i`` as a torch tensor: a zero-copy view when no device/dtype change is asked.

    ``dtype`` (torch dtype or name) converts, e.g. bfloat16 -> float32 (exact) or
    float32 -> bfloat16 (round to nearest even). A view of a read-only buffer is
    returned as is; torch warns about writes it cannot do, so do not write to it.
    """
    import warnings

    import torch

    meta = payload.meta
    if not 0 <= i < len(payload.layers):
        raise IndexError(f"layer {i} out of range: payload has {len(payload.layers)} layers")
    arr = payload.layers[i]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        t = torch.from_numpy(arr)
    if meta.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    if dtype is not None:
        target = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        dtype_name(target)
        t = t.to(device=device, dtype=target) if device is not None else t.to(target)
    elif device is not None:
        t = t.to(device)
    return t


def validate(
    payload: KVPayload,
    expected_fingerprint: str | None = None,
    expected_shape: tuple[int, int, int] | None = None,
    *,
    verify: bool = True,
) -> KVPayload:
    """Check a received payload; returns it. ``expected_shape`` is ``(kv_heads, head_dim, num_layers)``.

    Raises FingerprintMismatch, LayoutMismatch, TruncatedPayload or CorruptPayload
    (only with ``verify`` and when the sender recorded checksums).
    """
    meta = payload.meta
    if expected_fingerprint is not None and meta.fingerprint != expected_fingerprint:
        raise FingerprintMismatch(expected_fingerprint, meta.fingerprint)
    if meta.layout != LAYOUT_VERSION:
        raise LayoutMismatch(f"KV layout {meta.layout!r} is not supported; this reader knows {LAYOUT_VERSION!r}")
    if expected_shape is not None:
        kv_heads, head_dim, num_layers = expected_shape
        got = (meta.kv_heads, meta.head_dim, meta.num_layers)
        if got != tuple(expected_shape):
            raise LayoutMismatch(
                f"KV payload has (kv_heads, head_dim, num_layers)={got}, engine expects {tuple(expected_shape)}"
            )
    if len(payload.layers) != meta.num_layers:
        raise TruncatedPayload(f"KV payload has {len(payload.layers)} of {meta.num_layers} layers")
    for i, arr in enumerate(payload.layers):
        check_layer(meta, i, arr)
        if verify and meta.checksums is not None:
            got_sum = checksum(arr, meta.checksum_algo)
            if got_sum != meta.checksums[i]:
                raise CorruptPayload(i, meta.checksums[i], got_sum, meta.checksum_algo)
    return payload


# ---------------------------------------------------------------- flat buffer
@dataclass(frozen=True)
class BufferLayout:
    meta_json: bytes
    table_offset: int
    data_offset: int
    layer_offsets: tuple[int, ...]
    total_size: int


def buffer_layout(meta: KVMeta) -> BufferLayout:
    """Offsets of the flat buffer for ``meta`` (checksums live in the table, not the JSON)."""
    meta_json = meta.without_checksums().to_json().encode()
    table_offset = _HEADER.size + len(meta_json)
    data_offset = _align(table_offset + ENTRY_SIZE * meta.num_layers)
    step = _align(meta.layer_nbytes)
    offsets = tuple(data_offset + i * step for i in range(meta.num_layers))
    return BufferLayout(meta_json, table_offset, data_offset, offsets, offsets[-1] + meta.layer_nbytes)


def write_header(buf, meta: KVMeta) -> BufferLayout:
    """Write header, meta and an all-pending layer table into ``buf`` (writable, large enough)."""
    lay = buffer_layout(meta)
    mv = memoryview(buf).cast("B")
    if len(mv) < lay.total_size:
        raise ValueError(f"buffer of {len(mv)} bytes is too small for this payload ({lay.total_size} bytes)")
    _HEADER.pack_into(mv, 0, MAGIC, FORMAT_VERSION, 0, lay.total_size, len(lay.meta_json), meta.num_layers, lay.data_offset)
    mv[_HEADER.size : lay.table_offset] = lay.meta_json
    mv[lay.table_offset : lay.table_offset + ENTRY_SIZE * meta.num_layers] = bytes(ENTRY_SIZE * meta.num_layers)
    return lay


def write_layer(buf, lay: BufferLayout, meta: KVMeta, i: int, arr: np.ndarray, csum: int | None) -> None:
    """Copy layer ``i`` into ``buf`` then mark it ready (bytes first, flag last)."""
    arr = check_layer(meta, i, arr)
    mv = memoryview(buf).cast("B")
    off = lay.layer_offsets[i]
    dst = np.frombuffer(mv, dtype=np.uint8, count=meta.layer_nbytes, offset=off)
    np.copyto(dst, _bytes_view(arr))
    entry = lay.table_offset + i * ENTRY_SIZE
    _ENTRY.pack_into(mv, entry, csum or 0, 0, csum is not None)
    mv[entry + 8] = 1  # ready flag written last


def layer_state(buf, lay: BufferLayout, i: int) -> tuple[bool, int | None]:
    """(ready, checksum or None) for layer ``i``."""
    csum, ready, has = _ENTRY.unpack_from(buf, lay.table_offset + i * ENTRY_SIZE)
    return bool(ready), (csum if has else None)


def read_header(buf) -> tuple[KVMeta, BufferLayout]:
    """Parse and check the header; raises TruncatedPayload / LayoutMismatch."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _HEADER.size:
        raise TruncatedPayload(f"KV buffer has {len(mv)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, _, total, meta_len, n_layers, data_off = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise LayoutMismatch(f"not a KV payload buffer: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise LayoutMismatch(f"KV buffer format version {version} is not supported (reader knows {FORMAT_VERSION})")
    if len(mv) < _HEADER.size + meta_len:
        raise TruncatedPayload(f"KV buffer has {len(mv)} bytes, its meta needs {_HEADER.size + meta_len}")
    meta = KVMeta.from_json(bytes(mv[_HEADER.size : _HEADER.size + meta_len]))
    lay = buffer_layout(meta)
    if (lay.total_size, lay.data_offset, meta.num_layers) != (total, data_off, n_layers):
        raise LayoutMismatch(
            f"KV buffer header (size {total}, data offset {data_off}, {n_layers} layers) disagrees "
            f"with its meta (size {lay.total_size}, data offset {lay.data_offset}, {meta.num_layers} layers)"
        )
    return meta, lay


def layer_view(buf, lay: BufferLayout, meta: KVMeta, i: int) -> np.ndarray:
    """Zero-copy view of layer ``i`` in ``buf``."""
    return np.frombuffer(
        buf, dtype=meta.storage_dtype, count=meta.layer_nbytes // meta.storage_dtype.itemsize, offset=lay.layer_offsets[i]
    ).reshape(meta.layer_shape)


def to_buffer(payload: KVPayload) -> bytearray:
    """Serialise into one flat buffer (one copy of the layer bytes)."""
    meta = payload.meta
    if len(payload.layers) != meta.num_layers:
        raise TruncatedPayload(f"KV payload has {len(payload.layers)} of {meta.num_layers} layers")
    buf = bytearray(buffer_layout(meta).total_size)
    lay = write_header(buf, meta)
    for i, arr in enumerate(payload.layers):
        write_layer(buf, lay, meta, i, arr, meta.checksums[i] if meta.checksums is not None else None)
    return buf


def from_buffer(buf, *, verify: bool = True, expected_fingerprint: str | None = None) -> KVPayload:
    """Read a flat buffer. Layers are zero-copy views of ``buf`` (read-only if ``buf`` is).

    Raises TruncatedPayload (short buffer, missing layers), CorruptPayload, FingerprintMismatch.
    """
    mv = memoryview(buf).cast("B")
    meta, lay = read_header(mv)
    if expected_fingerprint is not None and meta.fingerprint != expected_fingerprint:
        raise FingerprintMismatch(expected_fingerprint, meta.fingerprint)
    if len(mv) < lay.total_size:
        have = sum(1 for off in lay.layer_offsets if off + meta.layer_nbytes <= len(mv))
        raise TruncatedPayload(
            f"KV buffer has {len(mv)} of {lay.total_size} bytes: only {have} of {meta.num_layers} layers are complete"
        )
    layers, sums = [], []
    for i in range(meta.num_layers):
        ready, csum = layer_state(mv, lay, i)
        if not ready:
            raise TruncatedPayload(f"KV buffer layer {i} of {meta.num_layers} was never written (ready flag is 0)")
        layers.append(layer_view(mv, lay, meta, i))
        sums.append(csum)
    if all(s is not None for s in sums):
        meta = replace(meta, checksums=tuple(sums))
    payload = KVPayload(meta, layers)
    return validate(payload, verify=verify)
