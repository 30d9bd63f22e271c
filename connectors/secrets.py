"""Credentials in ``storage_options``: written as references, resolved where they are used,
never printed.

A job file travels: ``dlbatch submit`` uploads it to the cluster, and a run hands its job to
Ray tasks and actors on every node. So a credential in ``input.storage_options`` or
``output.storage_options`` is written as a reference, ``${env:NAME}`` (the whole value),
and resolved from the environment of the process that opens the filesystem
(``resolve_options``, called by the connectors' ``_url_to_fs`` helpers and by
``listing.read_document_file``): the node's own environment, or the job's runtime_env. The
provider's own credential chain (instance roles, ``~/.aws/credentials``,
``GOOGLE_APPLICATION_CREDENTIALS`` on the nodes) needs no option at all.

Which references resolve (`reference_problems`): only inside ``storage_options``, and only
under an option that carries a credential (`is_secret_key`: ``key``, ``secret``, ``token``,
``password``, ``*_key``, ``credentials``, ..., or any option nested under one) or one of
`REFERENCE_KEYS`, the connection settings the filesystems document that a deployment keeps
in its environment (``endpoint_url``, ``region_name``, ``profile``, ``project``,
``account_name``, ...). Any other ``${env:NAME}`` is refused, naming its key path: at load
(dlbatch/jobspec) and again by `resolve_options`, so a job cannot read an arbitrary
variable of a node (``${env:HOME}``, another service's secret) into an option whose value
a filesystem may echo.

Never printed. Every value `resolve_options` puts into options is remembered in this
process, and `redact` writes it back as its reference (``${env:NAME}``) in any text; values
shorter than ``MASK_MIN_CHARS`` are left alone (they would mangle every message and hold no
secret). Errors raised by a filesystem opened or called with resolved options are redacted
where they are re-raised: `masked` around the connectors' ``url_to_fs`` calls,
`redact_exception` in `connectors.io_retry.call_with_retry` (every filesystem call goes
through it) and in the parse stage's dead letters; the ``dlbatch`` command writes its
stdout and stderr (its messages, its log) through `redacting_streams` as the last line.

- ``literal_secrets(options)``: the key paths that hold a literal value under a
  secret-looking key (``key``, ``secret``, ``token``, ``password``, ``credential``,
  ``session``, ...; a value nested under such a key counts too). ``dlbatch submit`` refuses
  a job with any.
- ``resolve_options(options)``: a copy with every reference replaced. A variable that is not
  set is an error naming the key and the variable, never a value.
- ``seal(options)``: what a run hands Ray tasks and actors instead of the options: an
  ObjectRef of them (``ray.put``), so no value is among a task's or an actor's arguments.
  ``resolve_options`` accepts it where a dict is expected.
- ``without_storage_options(spec)``: the job for stages that read no files (the prompt
  actors): both sections' options emptied.

A literal credential is still accepted by a local ``dlbatch run`` (the file stays on the
machine); it then travels inside a run only sealed.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any

ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
_SECRET_WORDS = frozenset({  # a part of the option's name (split at _ - . and camelCase)
    "key", "secret", "token", "password", "passwd", "pwd", "passphrase", "credential", "credentials",
    "session", "auth", "authorization", "sas", "cookie", "bearer",
})
_SECRET_ENDINGS = ("key", "secret", "token", "password", "passwd", "credential", "credentials")
_PARTS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
# options that are not credentials but may be read from the environment: the connection
# settings the filesystems document (s3fs/botocore, gcsfs, adlfs)
REFERENCE_KEYS = frozenset({
    "endpoint_url", "endpoint", "region", "region_name", "profile", "profile_name", "project", "account_name",
    "tenant_id", "client_id",
})
MASK_MIN_CHARS = 4  # a resolved value shorter than this is not masked in messages


class MissingCredential(ValueError):
    """A ``${env:NAME}`` reference whose variable is not set in this process."""


class ReferenceNotAllowed(ValueError):
    """A ``${env:NAME}`` reference under an option that may not read the environment."""


def is_secret_key(key: str) -> bool:
    """Does this option name look like it holds a credential (``aws_secret_access_key``,
    ``sessionToken``, ``account_key``, ``apikey``, ``credentials``, ...)?"""
    parts = [p.lower() for p in _PARTS.findall(str(key))]
    return ("connection" in parts and "string" in parts  # Azure's connection_string holds the account key
            or any(p in _SECRET_WORDS or p.endswith(_SECRET_ENDINGS) for p in parts))


def is_reference(value: Any) -> bool:
    return isinstance(value, str) and ENV_REF.match(value.strip()) is not None


def literal_secrets(options: Any, prefix: str = "storage_options") -> list[str]:
    """Key paths (``prefix.client_kwargs.aws_secret_access_key``) whose value is a literal
    string under a secret-looking key, or under a key nested in one. Empty strings, None,
    booleans and numbers are not credentials; ``${env:NAME}`` references are fine."""
    found: list[str] = []

    def walk(value: Any, path: str, secret: bool) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}", secret or is_secret_key(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}", secret)
        elif secret and isinstance(value, (str, bytes)) and value and not is_reference(value):
            found.append(path)

    walk(options, prefix, False)
    return found


def reference_problems(options: Any, prefix: str = "storage_options") -> list[tuple[str, str]]:
    """``(key path, why)`` for each ``${env:NAME}`` reference the rule (module docstring)
    refuses; empty when every reference is under a credential option or a `REFERENCE_KEYS` one."""
    found: list[tuple[str, str]] = []

    def walk(value: Any, path: str, key: str, allowed: bool) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}", str(k), allowed or is_secret_key(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}", key, allowed)
        elif is_reference(value) and not (allowed or key in REFERENCE_KEYS):
            found.append((path, f"{value.strip()} is not read here: a reference to the environment is read only "
                                f"under a credential option (key, secret, token, password, *_key, credentials, ...) "
                                f"or one of {', '.join(sorted(REFERENCE_KEYS))}"))

    if isinstance(options, Mapping):
        for k, v in options.items():
            walk(v, f"{prefix}.{k}", str(k), is_secret_key(k))
    return found


def resolve_options(options: Any, what: str = "storage_options") -> dict:
    """A copy of ``options`` (a dict, None, or ``seal``'s ObjectRef) with every ``${env:NAME}``
    value, at any depth, replaced by that variable of this process's environment. A reference
    the rule refuses raises `ReferenceNotAllowed`, a variable not set `MissingCredential`; each
    resolved value is remembered so that `redact` masks it."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        import ray

        options = ray.get(options)  # seal()'s ObjectRef
    problems = reference_problems(options, what)
    if problems:
        raise ReferenceNotAllowed(": ".join(problems[0]))

    def sub(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            return {k: sub(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [sub(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, str):
            m = ENV_REF.match(value.strip())
            if m:
                name = m.group(1)
                if name not in os.environ:
                    raise MissingCredential(
                        f"{path} is ${{env:{name}}}, but {name} is not set in the environment of this process "
                        f"(pid {os.getpid()} on {socket.gethostname()}): set it on every node that reads or "
                        f"writes the data (the node's environment, or the job's runtime_env), or use the "
                        f"provider's own credential chain"
                    )
                _remember(os.environ[name], name)
                return os.environ[name]
        return value

    return {k: sub(v, f"{what}.{k}") for k, v in options.items()}


# ------------------------------------------------------------------ masking resolved values

_RESOLVED: dict[str, str] = {}  # a resolved value -> its reference, "${env:NAME}"
_MASKS: tuple[tuple[str, str], ...] = ()  # the same pairs, longest value first (replaced whole, read lock-free)
_LOCK = threading.Lock()


def _remember(value: str, name: str) -> None:
    global _MASKS
    if len(value) >= MASK_MIN_CHARS and value not in _RESOLVED:
        with _LOCK:
            _RESOLVED[value] = f"${{env:{name}}}"
            _MASKS = tuple(sorted(_RESOLVED.items(), key=lambda kv: len(kv[0]), reverse=True))


def redact(text: str) -> str:
    """``text`` with every value resolved in this process written as its reference (longest first)."""
    masks = _MASKS
    if not masks or not isinstance(text, str):
        return text
    for value, reference in masks:
        if value in text:
            text = text.replace(value, reference)
    return text


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if type(value) in (list, tuple):
        return type(value)(_redact_value(v) for v in value)
    if type(value) is dict:
        return {k: _redact_value(v) for k, v in value.items()}
    return value


def redact_exception(exc: BaseException) -> BaseException:
    """Mask resolved values in ``exc`` in place (its arguments, an OSError's strerror and file
    names, a botocore error's keyword arguments, its notes) and in the exceptions it chains to."""
    first, seen = exc, set()
    while exc is not None and id(exc) not in seen and _MASKS:
        seen.add(id(exc))
        try:
            exc.args = tuple(_redact_value(a) for a in exc.args)
            if isinstance(exc, OSError):
                for attr in ("strerror", "filename", "filename2"):
                    if isinstance(getattr(exc, attr, None), str):
                        setattr(exc, attr, redact(getattr(exc, attr)))
            if isinstance(getattr(exc, "kwargs", None), dict):
                exc.kwargs = _redact_value(exc.kwargs)
            if getattr(exc, "__notes__", None):
                exc.__notes__ = [redact(n) for n in exc.__notes__]
        except (AttributeError, TypeError):  # an exception type that refuses new attributes
            pass
        exc = exc.__cause__ or exc.__context__
    return first


@contextlib.contextmanager
def masked():
    """``with masked():`` an exception raised inside leaves with resolved values masked."""
    try:
        yield
    except BaseException as e:
        redact_exception(e)
        raise


class _RedactingStream:
    """A text stream that masks resolved values in what is written to it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacting_streams():
    """``sys.stdout`` and ``sys.stderr`` mask resolved values while inside (the ``dlbatch`` command)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RedactingStream(sys.stdout), _RedactingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def seal(options: Mapping | None):
    """The options as an ObjectRef (``ray.put``), for Ray task and actor arguments; None when
    there are none. Unresolved: each use site resolves references in its own environment."""
    if not options:
        return None
    import ray

    return ray.put(dict(options))


def without_storage_options(spec):
    """``spec`` (a JobSpec) with ``input`` and ``output`` storage options emptied."""
    return spec.model_copy(update={
        "input": spec.input.model_copy(update={"storage_options": {}}),
        "output": spec.output.model_copy(update={"storage_options": {}}),
    })
