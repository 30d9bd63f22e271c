"""Models by Hugging Face Hub id, and a model's identity by content.

A job names its model as a local folder, a GGUF file, an fsspec URL, a bundled alias, or a
Hub id: ``org/name``, optionally pinned as ``org/name@revision`` (what `ref` makes of the
job's ``model.name`` and ``model.revision``). A Hub id resolves through ``huggingface_hub``
into its cache, so ``HF_HOME``, ``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` mean what
they mean everywhere else; only the files an engine reads are fetched (configs, tokenizer
files, chat templates, ``*.safetensors``), never pickled weights. The cache's file locks make
concurrent workers of one node download once; each node downloads into its own cache.

`identity` is what the job fingerprint records of a model: the resolved commit of a
Hub id; for a folder a hash of its config, tokenizer files and the names and sizes of its
weights; for a GGUF a hash of its header and size. The same name over other weights gives
another identity, so a resume cannot mix two models' rows.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time

log = logging.getLogger("dlbatch.hub")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*(@[A-Za-z0-9_.\-/]+)?$")
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
RETRIES = 4  # a download is tried this many times (network errors), with growing waits


class HubError(ValueError):
    """A Hub id that cannot be resolved (missing, offline without a cached copy, no safetensors)."""


def ref(name: str, revision: str | None) -> str:
    """The model string the engine loads: ``org/name@revision`` when a revision is pinned."""
    if revision and is_hub_id(name) and "@" not in name:
        return f"{name}@{revision}"
    return name


def is_hub_id(name: str) -> bool:
    """``org/name[@rev]`` that is not an existing local path nor a URL."""
    if not isinstance(name, str) or "://" in name or name.startswith((".", "/", "~")):
        return False
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def split(name: str) -> tuple[str, str | None]:
    repo, _, rev = name.partition("@")
    return repo, rev or None


def snapshot(name: str, offline: bool | None = None) -> str:
    """The local folder of a Hub id's snapshot (downloaded once into the HF cache)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, rev = split(name)
    offline = offline if offline is not None else os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false")
    err: Exception | None = None
    for attempt in range(1 if offline else RETRIES):
        try:
            path = snapshot_download(repo, revision=rev, allow_patterns=FILES, local_files_only=offline,
                                     cache_dir=_cache_dir())
            break
        except LocalEntryNotFoundError as e:
            raise HubError(f"model {name!r}: not in the Hugging Face cache ({_cache_dir()}) and "
                           f"{'HF_HUB_OFFLINE is set' if offline else 'the Hub cannot be reached'}: {e}") from None
        except Exception as e:  # network errors: retried; a missing repo or revision is not
            if type(e).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"):
                raise HubError(f"model {name!r}: {type(e).__name__}: {e}") from None
            err = e
            wait = 2.0 ** attempt
            log.warning("downloading %s failed (%s); retrying in %.0f s", name, e, wait)
            time.sleep(wait)
    else:
        raise HubError(f"model {name!r}: download failed after {RETRIES} tries: {err}")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise HubError(f"model {name!r} has no *.safetensors weights at {path} (pickled weights are never loaded)")
    return path


def commit_of(path: str) -> str | None:
    """The commit hash of a snapshot folder (``.../snapshots/<commit>``), else None."""
    parent, leaf = os.path.split(os.path.normpath(path))
    if os.path.basename(parent) == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", leaf):
        return leaf
    return None


def _cache_dir() -> str:
    """The Hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json", "tokenizer.model")


def dir_identity(fs, root: str) -> str:
    """sha256 of a model folder's configs and tokenizer files and, per weight file, its size,
    modification stamp and safetensors header (every tensor's name, dtype, shape, offsets).
    The weights themselves are not read: a checkpoint rewritten in place changes the stamp."""
    h = hashlib.sha256()
    root = root.rstrip("/")
    listing = {os.path.basename(i["name"]): i for i in fs.ls(root, detail=True)}
    for fname in IDENTITY_FILES:
        if fname in listing:
            h.update(fname.encode() + b"\0" + fs.cat_file(f"{root}/{fname}") + b"\0")
    for fname in sorted(listing):
        if fname.endswith(".safetensors"):
            info = listing[fname]
            stamp = info.get("mtime", info.get("LastModified", info.get("ETag", "")))
            h.update(f"{fname}:{info.get('size')}:{stamp}\0".encode())
            # the header holds every tensor's name, dtype, shape and offsets: cheap and exact
            h.update(_safetensors_header(fs, f"{root}/{fname}"))
    return h.hexdigest()[:32]


def _safetensors_header(fs, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100_000_000:
            return b""
        return f.read(n)


def gguf_identity(fs, path: str) -> str:
    """sha256 of a GGUF file's size and its first MiB (magic, metadata, tensor infos)."""
    info = fs.info(path)
    with fs.open(path, "rb") as f:
        head = f.read(1 << 20)
    return hashlib.sha256(f"{info.get('size')}\0".encode() + head).hexdigest()[:32]


def identity(name: str, path: str, storage_options: dict | None = None) -> str:
    """What the job fingerprint records of model ``name``, resolved to ``path`` (see the
    module docstring; `dlbatch.engine.loader.model_identity` resolves and calls this)."""
    import fsspec

    if is_hub_id(name):
        commit = commit_of(path)
        if commit:
            return f"hub:{split(name)[0]}@{commit}"
    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if fs.isdir(p):
        return "dir:" + dir_identity(fs, p)
    return "gguf:" + gguf_identity(fs, p)
