"""Credentials in ``storage_options``: written as references, resolved where they are used.

A job file travels: ``dlbatch submit`` uploads it to the cluster, and a run hands its job to
Ray tasks and actors on every node. So a credential in ``input.storage_options`` or
``output.storage_options`` is written as a reference, ``${env:NAME}`` (the whole value),
and resolved from the environment of the process that opens the filesystem
(``resolve_options``, called by the connectors' ``_url_to_fs`` helpers and by
``listing.read_document_file``): the node's own environment, or the job's runtime_env. The
provider's own credential chain (instance roles, ``~/.aws/credentials``,
``GOOGLE_APPLICATION_CREDENTIALS`` on the nodes) needs no option at all.

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

import os
import re
import socket
from collections.abc import Mapping
from typing import Any

ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
_SECRET_WORDS = frozenset({  # a part of the option's name (split at _ - . and camelCase)
    "key", "secret", "token", "password", "passwd", "pwd", "passphrase", "credential", "credentials",
    "session", "auth", "authorization", "sas", "cookie", "bearer",
})
_SECRET_ENDINGS = ("key", "secret", "token", "password", "passwd", "credential", "credentials")
_PARTS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


class MissingCredential(ValueError):
    """A ``${env:NAME}`` reference whose variable is not set in this process."""


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


def resolve_options(options: Any, what: str = "storage_options") -> dict:
    """A copy of ``options`` (a dict, None, or ``seal``'s ObjectRef) with every ``${env:NAME}``
    value, at any depth, replaced by that variable of this process's environment."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        import ray

        options = ray.get(options)  # seal()'s ObjectRef

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
                return os.environ[name]
        return value

    return {k: sub(v, f"{what}.{k}") for k, v in options.items()}


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
