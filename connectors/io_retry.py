"""Retries for transient I/O errors (tenacity), with a process-wide retry counter.

Transient (retried with exponential backoff + jitter, bounded attempts):
  ConnectionError, TimeoutError, socket timeouts, generic OSError (EIO, ECONNRESET, EBUSY,
  EREMOTEIO, ...), botocore ``ClientError`` with an HTTP 5xx status or a throttling code,
  botocore connection/read timeouts, s3fs/aiohttp transport errors.
Permanent (raised at once, with a note saying so):
  FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
  FileExistsError, OSError with EINVAL/ENOENT/EACCES/..., ClientError with a 4xx status,
  and every non-I/O exception (ValueError, TypeError, ...).
Every error re-raised (and every retry logged) has the credentials resolved in this process
masked (`connectors.secrets.redact_exception`): a filesystem may echo its options.

Usage::

    from connectors.io_retry import retry_io, call_with_retry, retry_count

    @retry_io
    def fetch(fs, path): return fs.cat_file(path)

    data = call_with_retry(fs.cat_file, path, op="cat s3://b/k")
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import socket
import threading
from typing import Any, Callable, TypeVar

import tenacity

from .secrets import redact, redact_exception

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class IOBackoff:
    """How hard an I/O call is retried (exponential back-off with jitter). ``max_attempts``
    counts the first try. (Who is to blame for a failed batch is `dlbatch.driver.retry_policy`.)"""

    max_attempts: int = 5
    initial_wait_s: float = 0.2
    max_wait_s: float = 8.0
    jitter_s: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_wait_s < 0 or self.max_wait_s < 0 or self.jitter_s < 0:
            raise ValueError(f"retry waits must be >= 0, got {self}")


def _policy_from_env() -> IOBackoff:
    attempts = os.environ.get("DLBATCH_IO_MAX_ATTEMPTS")
    if attempts is None:
        return IOBackoff()
    try:
        return IOBackoff(max_attempts=int(attempts))
    except ValueError as exc:
        raise ValueError(f"DLBATCH_IO_MAX_ATTEMPTS must be a positive integer, got {attempts!r}") from exc


# Module default; tests or callers may replace it (set_default_policy) or pass policy=.
_default_policy = _policy_from_env()

_counter_lock = threading.Lock()
_retry_count = 0


def set_default_policy(policy: IOBackoff) -> IOBackoff:
    """Replace the process default policy; returns the previous one."""
    global _default_policy
    if not isinstance(policy, IOBackoff):
        raise TypeError(f"expected IOBackoff, got {type(policy).__name__}")
    previous, _default_policy = _default_policy, policy
    return previous


def retry_count() -> int:
    """Number of retries (not first attempts) made in this process so far."""
    return _retry_count


def _bump() -> None:
    global _retry_count
    with _counter_lock:
        _retry_count += 1


# ---------------------------------------------------------------- classification

_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
)
_PERMANENT_ERRNOS = {
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.EINVAL, errno.EISDIR, errno.ENOTDIR,
    errno.EEXIST, errno.ENOTEMPTY, errno.ENAMETOOLONG, errno.EMSGSIZE, errno.ENOSYS,
    errno.EROFS, errno.ENOSPC, errno.EBADF,
}
if hasattr(errno, "EREMCHG"):
    _PERMANENT_ERRNOS.add(errno.EREMCHG)

_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
}


def _client_error_status(exc: BaseException) -> tuple[int | None, str | None] | None:
    """(http_status, code) for a botocore-style ClientError, else None."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    err = response.get("Error") or {}
    code = err.get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if status is None and isinstance(code, str) and code.isdigit():
        status = int(code)
    return (int(status) if status is not None else None, code)


def _transport_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.timeout]
    try:
        from botocore import exceptions as bexc

        types += [bexc.EndpointConnectionError, bexc.ConnectionClosedError,
                  bexc.ReadTimeoutError, bexc.ConnectTimeoutError, bexc.HTTPClientError,
                  bexc.ResponseStreamingError, bexc.IncompleteReadError]
    except (ImportError, AttributeError):
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    except ImportError:
        pass
    return tuple(types)


_TRANSPORT_TYPES: tuple[type[BaseException], ...] | None = None


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is worth retrying."""
    global _TRANSPORT_TYPES
    if _TRANSPORT_TYPES is None:
        _TRANSPORT_TYPES = _transport_error_types()
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    status = _client_error_status(exc)
    if status is not None:
        http, code = status
        if code in _TRANSIENT_CODES:
            return True
        return http is not None and (http >= 500 or http == 429)
    if isinstance(exc, _TRANSPORT_TYPES):
        return True
    if isinstance(exc, OSError):
        # s3fs translates 4xx into OSError(EINVAL/EPERM/...), 5xx into EREMOTEIO/EBUSY/EIO.
        return exc.errno not in _PERMANENT_ERRNOS
    return False


# ---------------------------------------------------------------- retrying


def _describe(fn: Callable[..., Any], op: str | None) -> str:
    return op or getattr(fn, "__qualname__", None) or repr(fn)


def _exp_jitter_wait(pol: IOBackoff):
    """Exponential backoff with jitter; tenacity >= 9 names the start 'multiplier'."""
    import inspect

    params = inspect.signature(tenacity.wait_exponential_jitter.__init__).parameters
    start = "multiplier" if "multiplier" in params else "initial"
    return tenacity.wait_exponential_jitter(**{start: pol.initial_wait_s}, max=pol.max_wait_s,
                                            jitter=pol.jitter_s)


def call_with_retry(fn: Callable[..., T], *args: Any, op: str | None = None,
                    policy: IOBackoff | None = None, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)``, retrying transient I/O errors.

    Permanent errors are re-raised at once (same exception type, with a note);
    after the last attempt the last transient error is re-raised with a note.
    """
    pol = policy or _default_policy
    what = _describe(fn, op)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        _bump()
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        log.warning("transient I/O error in %s (attempt %d/%d), retrying in %.2fs: %s: %s",
                    what, state.attempt_number, pol.max_attempts, wait,
                    type(exc).__name__, redact(str(exc)))

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(pol.max_attempts),
        wait=_exp_jitter_wait(pol),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(fn, *args, **kwargs)
    except Exception as exc:  # annotate, keep the type so callers can still catch it
        redact_exception(exc)  # a filesystem opened with resolved credentials may echo them
        if is_transient(exc):
            _add_note(exc, f"dlbatch io_retry: {what} still failing after "
                           f"{pol.max_attempts} attempts; giving up")
        elif isinstance(exc, OSError) or _client_error_status(exc) is not None:
            _add_note(exc, f"dlbatch io_retry: permanent I/O error in {what}; not retried")
        raise


def _add_note(exc: BaseException, note: str) -> None:
    notes = getattr(exc, "__notes__", None) or []
    if note not in notes and hasattr(exc, "add_note"):
        exc.add_note(note)


def retry_io(fn: Callable[..., T] | None = None, *, op: str | None = None,
             policy: IOBackoff | None = None):
    """Decorator form of :func:`call_with_retry`: ``@retry_io`` or ``@retry_io(op=...)``."""

    def wrap(f: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(f)
        def inner(*args: Any, **kwargs: Any) -> T:
            return call_with_retry(f, *args, op=op or f.__qualname__, policy=policy, **kwargs)

        return inner

    return wrap(fn) if fn is not None else wrap
