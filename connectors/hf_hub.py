"""``input.format: hf`` by Hub id: a dataset on the Hugging Face Hub (``path: org/name``),
read through ``datasets.load_dataset`` with its config, split and revision.

A Hub dataset is one input. The job spec folds what it reads into one URL (`hub_url`),
``hf-dataset://org/name?config=<c>&split=<s>[&revision=<r>][&streaming=1]``: it is what
`connectors.listing.list_inputs` hands out, what the readers get, and what a row's ``source``
begins with (``<url>#<split>/row<N>``, like the rows of a saved DatasetDict).

The cache is the ``datasets`` one (``HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``, read
from the environment at each call), so an offline machine whose cache holds the dataset
(prepared once by ``load_dataset``) reads it; ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``
(``1``) keep every call off the network. Online, the Hub's address is probed first (a TCP
connect, `CONNECT_TIMEOUT_S`): when it does not answer, the read goes on offline from the
cache instead of waiting on HTTP timeouts, and fails at once if the cache lacks it.

A missing dataset, an unknown config or split is a `HubDatasetError` (a ValueError) naming
the id and what exists, raised when the job lists its inputs. ``streaming`` reads the rows
lazily (an IterableDataset) in their stored order, so ``input.limit``'s first N rows are the
same either way; without it ``load_dataset`` prepares the dataset's Arrow files in the cache
first (memory-mapped, not held in memory).

`hub_version` is the input's version for `connectors.versions`: a digest of the prepared
dataset's revision hash, cache folder and split sizes, so a new revision of the dataset
(or a re-prepared cache) is a changed input.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from .part import WHOLE, Part

log = logging.getLogger(__name__)

SCHEME = "hf-dataset://"
DEFAULT_SPLIT = "train"
CONNECT_TIMEOUT_S = float(os.environ.get("DLBATCH_HF_CONNECT_TIMEOUT_S", "5"))
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubDatasetError(ValueError):
    """The dataset, its config or split cannot be read: the message names the id and what exists."""


def is_hub_id(path: str) -> bool:
    """``org/name`` (one slash, Hub-legal characters) that is not a local path."""
    return bool(_ID_RE.match(path or "")) and not os.path.exists(os.path.expanduser(path))


def is_hub_url(url: str) -> bool:
    return isinstance(url, str) and url.startswith(SCHEME)


@dataclass(frozen=True)
class HubRef:
    id: str
    config: str | None = None
    split: str = DEFAULT_SPLIT
    revision: str | None = None
    streaming: bool = False

    @property
    def url(self) -> str:
        q = {k: v for k, v in (("config", self.config), ("split", self.split), ("revision", self.revision))
             if v is not None}
        if self.streaming:
            q["streaming"] = "1"
        return f"{SCHEME}{self.id}?{urlencode(q, quote_via=quote, safe='')}"


def hub_url(id: str, config: str | None = None, split: str | None = None, revision: str | None = None,
            streaming: bool = False) -> str:
    """The input URL of Hub dataset ``id`` read with these settings (module docstring)."""
    return HubRef(id, config, split or DEFAULT_SPLIT, revision, bool(streaming)).url


def parse_hub_url(url: str) -> HubRef:
    if not is_hub_url(url):
        raise ValueError(f"not a Hub dataset URL ({SCHEME}org/name?...): {url!r}")
    parts = urlsplit(url)
    q = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(q) - {"config", "split", "revision", "streaming"}
    if unknown:
        raise ValueError(f"{url!r}: unknown setting(s) {sorted(unknown)}; known: config, split, revision, streaming")
    return HubRef(id=f"{parts.netloc}{parts.path}", config=q.get("config") or None,
                  split=q.get("split") or DEFAULT_SPLIT, revision=q.get("revision") or None,
                  streaming=q.get("streaming", "").upper() in _TRUE)


# ------------------------------------------------------------------ environment


def cache_dir() -> str:
    """The ``datasets`` cache this process uses now: HF_DATASETS_CACHE, else $HF_HOME/datasets."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "datasets")


def _env_offline() -> bool:
    return any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the endpoint opens within ``timeout``; else why not."""
    parts = urlsplit(endpoint)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        return f"no host in HF_ENDPOINT {endpoint!r}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def offline_mode(offline: bool):
    """``datasets`` and ``huggingface_hub`` read their offline flags at import: set them (and
    the environment, for processes started inside) for the call, restore them after."""
    import datasets.config as dcfg
    import huggingface_hub.constants as hcst

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    patched = [(m, a, getattr(m, a)) for m, a in ((dcfg, "HF_HUB_OFFLINE"), (dcfg, "HF_DATASETS_OFFLINE"),
                                                  (hcst, "HF_HUB_OFFLINE")) if hasattr(m, a)]
    try:
        for m, a, _ in patched:
            setattr(m, a, offline)
        if offline:
            for k in saved_env:
                os.environ[k] = "1"
        yield
    finally:
        for m, a, v in patched:
            setattr(m, a, v)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _hub_session(ref: HubRef):
    """Offline when the environment says so or the Hub does not answer (module docstring);
    yields why the Hub is not used (None: online)."""
    why = "offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if _env_offline() else None
    if why is None:
        unreachable = _reachable(_endpoint())
        if unreachable is not None:
            why = f"the Hub at {_endpoint()} does not answer ({unreachable})"
            log.warning("%s: %s; reading it from the cache %s", ref.id, why, cache_dir())
    with offline_mode(why is not None):
        yield why


def _cached_configs(id: str, cache: str) -> list[str]:
    """Configs of ``id`` prepared in the ``datasets`` cache (``org___name/<config>/...``)."""
    ns, _, name = id.partition("/")
    root = os.path.join(cache, f"{ns}___{name}")
    try:
        return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    except OSError:
        return []


def _explain(ref: HubRef, exc: BaseException, why_offline: str | None) -> HubDatasetError:
    """One message naming the dataset and what exists, from what ``datasets`` raised."""
    cache = cache_dir()
    what = f"Hub dataset {ref.id!r}" + (f" config {ref.config!r}" if ref.config else "") \
        + (f" revision {ref.revision!r}" if ref.revision else "")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    cached = _cached_configs(ref.id, cache)
    m = re.search(r"Unknown split \"?([^\".]*)\"?\. Should be one of (\[.*\])", str(exc))
    if m:
        return HubDatasetError(f"{what}: no split {ref.split!r} (splits: {m.group(2)})")
    if "multiple" in str(exc) and "configurations" in str(exc):
        return HubDatasetError(f"{what}: it has several configs ({', '.join(cached)}): name one in input.config")
    if "Available configs" in str(exc) or (cached and "for config" in str(exc)):
        return HubDatasetError(f"{what}: no such config (configs in the cache {cache}: {', '.join(cached)})")
    if "BuilderConfig" in str(exc) and "not found" in str(exc):
        return HubDatasetError(f"{what}: {first}")
    if why_offline is not None:
        where = f"configs there: {', '.join(cached)}" if cached else "it is not there"
        return HubDatasetError(f"{what}: cannot be read from the datasets cache {cache} ({where}) and "
                               f"the Hub is not used: {why_offline}. {type(exc).__name__}: {first}"[:800])
    return HubDatasetError(f"{what}: {type(exc).__name__}: {first}"[:800])


# ------------------------------------------------------------------ builder, listing, version


def _builder(ref: HubRef, storage_options: dict | None = None):
    import datasets

    return datasets.load_dataset_builder(ref.id, name=ref.config, revision=ref.revision, cache_dir=cache_dir(),
                                         storage_options=storage_options or None)


def check_hub_dataset(url: str, storage_options: dict | None = None) -> dict:
    """Raise `HubDatasetError` unless the dataset, config and split of ``url`` can be read;
    returns what identifies the version read (`hub_version`)."""
    ref = parse_hub_url(url)
    with _quiet(), _hub_session(ref) as why:
        try:
            b = _builder(ref, storage_options)
        except Exception as e:
            raise _explain(ref, e, why) from None
        splits = b.info.splits
        if splits and ref.split not in splits and not re.search(r"[\[%+]", ref.split):
            raise HubDatasetError(f"Hub dataset {ref.id!r}{f' config {b.config.name!r}' if b.config else ''}: "
                                  f"no split {ref.split!r} (splits: {sorted(splits)})")
        cache = b.cache_dir if os.path.isdir(b.cache_dir or "") else None
        return {"id": ref.id, "config": b.config.name if b.config else None, "hash": b.hash,
                "cache": os.path.relpath(cache, cache_dir()) if cache else None,
                "splits": {n: [s.num_examples, s.num_bytes] for n, s in sorted((splits or {}).items())},
                "revision": ref.revision, "checksums": sorted((b.info.download_checksums or {}).items())}


def hub_version(url: str, storage_options: dict | None = None) -> str:
    """The version of a Hub dataset input (module docstring)."""
    ident = check_hub_dataset(url, storage_options)
    body = json.dumps(ident, sort_keys=True, default=str)
    return f"hf:{hashlib.sha256(body.encode()).hexdigest()[:32]}"


@contextlib.contextmanager
def _quiet():
    """``datasets`` logs a warning on every cached load ("Using the latest cached version"):
    it is the expected path offline, so its logger says errors only inside."""
    from datasets.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(level)


def count_hub_rows(url: str, stop: int, storage_options: dict | None = None, **read_kwargs) -> int:
    """Rows of the split, at most ``stop``: the size the dataset states, else counted by reading."""
    ident = check_hub_dataset(url, storage_options)
    size = ident["splits"].get(parse_hub_url(url).split, [None])[0]
    if size is not None:
        return min(int(size), stop)
    n = 0
    for _ in read_hub(url, read_kwargs.get("text_field") or "text", read_kwargs.get("id_field"), None,
                      storage_options=storage_options):
        n += 1
        if n >= stop:
            break
    return n


# ------------------------------------------------------------------ reading


def read_hub(url: str, text_field: str, id_field: str | None, title_field: str | None,
             storage_options: dict | None = None, batch_size: int = 256, part: Part = WHOLE) -> Iterator[dict]:
    """Rows of the Hub dataset ``url`` names, in stored order, ``source`` ``<url>#<split>/row<N>``;
    ``part``: its rows [start, stop) only."""
    import datasets

    ref = parse_hub_url(url)
    with _quiet(), _hub_session(ref) as why:
        try:
            ds = datasets.load_dataset(ref.id, name=ref.config, split=ref.split, revision=ref.revision,
                                       streaming=ref.streaming, cache_dir=cache_dir(),
                                       storage_options=storage_options or None)
        except Exception as e:
            raise _explain(ref, e, why) from None
        if not part.whole:
            ds = _rows(ds, part)
        yield from iter_rows(ds, f"{url}#{ref.split}/row", text_field, id_field, title_field, batch_size,
                             first=part.start)


def _rows(ds, part: Part):
    """The rows [part.start, part.stop) of a Dataset (selected, memory-mapped) or of a
    streamed IterableDataset (skipped to, then taken)."""
    import datasets

    if isinstance(ds, datasets.IterableDataset):
        ds = ds.skip(part.start)
        return ds if part.stop is None else ds.take(part.stop - part.start)
    stop = len(ds) if part.stop is None else min(part.stop, len(ds))
    return ds.select(range(min(part.start, stop), stop))


def iter_rows(ds, prefix: str, text_field: str, id_field: str | None, title_field: str | None,
              batch_size: int = 256, first: int = 0) -> Iterator[dict]:
    """Rows of a Dataset or IterableDataset, read ``batch_size`` at a time as Arrow (the
    same records whether streamed or not); ``first``: the index of its first row (a part's)."""
    from .records import record_to_row

    index = first
    for table in ds.with_format("arrow").iter(batch_size=batch_size):
        for i, record in enumerate(table.to_pylist()):
            source = f"{prefix}{index}"
            yield record_to_row(record, source, text_field, id_field, title_field,
                                raw=None if record.get(text_field) else source, arrow=table.slice(i, 1))
            index += 1
