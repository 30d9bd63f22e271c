"""Exceptions raised by the KV payload format and the transports.

Every error names the offending value (layer index, fingerprint, segment name,
what was waited for) so a worker log line is enough to act on.
"""

from __future__ import annotations


def brief(e: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (at most ``limit`` characters) for a log line;
    the type's name when the message is empty."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


class TransferError(Exception):
    """Base class of every error raised by ``dlbatch.transfer``."""


class PayloadError(TransferError):
    """A KV payload is not usable by the receiver."""


class FingerprintMismatch(PayloadError):
    """The payload was produced by a different model (architecture or weights)."""

    def __init__(self, expected: str, got: str):
        self.expected = expected
        self.got = got
        super().__init__(
            f"KV payload model fingerprint {got!r} does not match the receiving "
            f"engine's fingerprint {expected!r}: KV from one model cannot be used by another"
        )

    def __reduce__(self):  # picklable across Ray / process boundaries
        return (type(self), (self.expected, self.got))


class CorruptPayload(PayloadError):
    """A layer's bytes do not match the checksum its sender recorded."""

    def __init__(self, layer: int, expected: int, got: int, algo: str):
        self.layer = layer
        self._args = (layer, expected, got, algo)
        super().__init__(
            f"KV payload layer {layer} is corrupt: {algo} checksum is {got:#x}, "
            f"sender recorded {expected:#x}"
        )

    def __reduce__(self):
        return (type(self), self._args)


class TruncatedPayload(PayloadError):
    """Layers or bytes are missing."""


class LayoutMismatch(PayloadError):
    """Shape, dtype or layout version differs from what the receiver expects."""


class TransferTimeout(TransferError, TimeoutError):
    """A receive did not complete within its timeout."""


class SenderDied(TransferError):
    """The sending process or actor died before the transfer completed."""


class TransportUnavailable(TransferError):
    """The requested transport cannot be used here (missing package, no device...)."""
