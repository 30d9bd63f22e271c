"""Images a table row holds, or names: a JSONL / Parquet / ``hf`` input's image columns, and
an OpenAI batch line's ``image_url`` that is not a data: URL (docs/multimodal.md).

A task's ``images: {column: figure}`` takes its images from the row's ``figure`` column. A
value is one image or a list of them; each image is

* raw bytes (a Parquet binary value), or a Hugging Face ``Image`` value ``{bytes, path}``;
* a ``data:image/<png|jpeg|webp>;base64,...`` URL (`connectors.images.data_url_image`);
* a path or URL: a local path (a relative one from ``base``, the directory the job runs in,
  as every data path of a job file: docs/jobs.md) or any fsspec URL (``file://``, ``s3://``,
  ``http(s)://``, ...), read with the input's storage options where its scheme is the
  input's own, at most ``max_bytes`` bytes of it (``input.max_file_bytes``), an http(s)
  URL within ``input.parse_timeout_s`` seconds.

Each image is checked, never decoded: its format sniffed from its first bytes (PNG, JPEG or
WebP only), its size read by PIL from the header, its pixels and the document's image count
charged to the document's budget (`connectors.images.ImageBudget`: ``input.max_images``,
``input.max_image_pixels``). What comes out is the records `connectors.images.pack_images`
packs, as a PDF's rendered images: ``{kind: "column", column, label, page: 0, caption: "",
dpi: 0, format, width, height, data}``, the label ``"<column> <n>"`` (1-based in the column).

Every failure is an `ImageError` whose message names the column, the value (shortened) and
the reason; ``error_type`` is ``BadImage`` (unreadable, not an image) or
``ImageBudgetExceeded``. The parse stage turns it into the document's dead letter.

Plain functions over bytes and fsspec: no Ray, no model.
"""
from __future__ import annotations

import io
import os
import re
from typing import Any

from .images import IMAGE_BUDGET, MAX_IMAGES, MAX_PIXELS, ImageBudget, ImageBudgetExceeded, sniff_format

BAD_IMAGE = "BadImage"
KIND = "column"
READ_KEYS = ("base", "storage_options", "input_url", "max_bytes", "timeout_s")  # read_image_url's keywords


class ImageError(ValueError):
    """An image a row names that cannot be one of its document's images; ``error_type`` is its
    dead letter's."""

    def __init__(self, message: str, error_type: str = BAD_IMAGE):
        super().__init__(message)
        self.error_type = error_type


def shorten(value: Any, limit: int = 80) -> str:
    """A value as a dead letter names it: bytes by their size and first bytes, a string cut."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return f"<{len(data)} bytes starting {data[:8]!r}>"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) read by PIL from the image's header (no pixel decoded); ValueError naming
    why PIL cannot read it."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return int(im.size[0]), int(im.size[1])
    except Exception as e:
        raise ValueError(f"PIL cannot read it ({type(e).__name__}: {e})") from None


def checked_image(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) of compressed image bytes; ValueError naming what is wrong."""
    fmt = sniff_format(data)
    if fmt is None:
        raise ValueError(f"not a PNG, JPEG or WebP image (its {len(data)} bytes start {data[:8]!r})")
    width, height = image_size(data)
    return fmt, width, height


def read_image_url(url: str, *, base: str | None = None, storage_options: dict | None = None,
                   input_url: str | None = None, max_bytes: int | None = None,
                   timeout_s: float | None = None) -> bytes:
    """The bytes at ``url`` (a path or fsspec URL; module docstring), at most ``max_bytes``; an
    http(s) URL within ``timeout_s`` seconds (``input.parse_timeout_s``) unless the storage
    options give their own ``client_kwargs``. Raises ValueError naming the reason: not found,
    unreadable, no answer in time, too large."""
    import fsspec

    from .io_retry import call_with_retry
    from .secrets import masked, resolve_options

    target = _resolved(url, base)
    options = resolve_options(storage_options) if _scheme(target) == _scheme(input_url or "") else {}
    if timeout_s and _scheme(target) in ("http", "https") and "client_kwargs" not in options:
        import aiohttp

        options = {**options, "client_kwargs": {"timeout": aiohttp.ClientTimeout(total=float(timeout_s))}}

    def read():
        with masked():
            fs, path = fsspec.core.url_to_fs(target, **options)
        with fs.open(path, "rb") as f:
            return f.read(-1 if max_bytes is None else max_bytes + 1)

    try:
        data = call_with_retry(read, op=f"read image {shorten(url)}")
    except Exception as e:
        from .secrets import redact

        cause = e.__cause__ or e.__context__  # fsspec's http reports a refused connection as not found
        if isinstance(e, FileNotFoundError) and cause is None:
            raise ValueError(f"no such file or URL ({target})") from None
        why = cause if isinstance(e, FileNotFoundError) else e
        if isinstance(why, TimeoutError):
            raise ValueError(f"no answer in {timeout_s:g} s (input.parse_timeout_s)") from None
        raise ValueError(redact(f"cannot read it ({type(why).__name__}: {why})")[:300]) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"it is over input.max_file_bytes={max_bytes} bytes; not read")
    return data


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if _URL.match(url) else "file"


def _resolved(url: str, base: str | None) -> str:
    """A relative local path joined to ``base``; URLs and absolute paths as given."""
    if _URL.match(url):
        return url
    path = os.path.expanduser(url)
    return path if os.path.isabs(path) else os.path.join(base or os.getcwd(), path)


def value_bytes(value: Any, **read) -> bytes:
    """One image value (module docstring) -> its compressed bytes; ValueError naming the reason."""
    from .images import data_url_image

    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # a Hugging Face Image value
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("an empty string is not an image")
        if value.lstrip().startswith("data:"):
            return data_url_image(value)
        return read_image_url(value.strip(), **read)
    raise ValueError(f"a {type(value).__name__} is not an image (give bytes, a data: URL, a path or a URL)")


def column_images(row: dict, columns: list[str], *, max_images: int | None = MAX_IMAGES,
                  max_pixels: int | None = MAX_PIXELS, **read) -> list[dict]:
    """The images of ``row``'s ``columns`` (each value one image, a list of them, or null: none),
    as records (module docstring), in column then list order; ``read``: `read_image_url`'s
    keywords. Raises `ImageError` at the first image that is bad or over the budget."""
    budget = ImageBudget(max_images, max_pixels)
    out: list[dict] = []
    for column in columns:
        if column not in row:
            raise ImageError(f"image column {column!r}: the row has no such column (its columns: "
                             f"{', '.join(sorted(map(str, row))) or 'none'})")
        value = row[column]
        values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        for n, v in enumerate(values, 1):
            label = f"{column} {n}"
            try:
                data = value_bytes(v, **read)
                fmt, width, height = checked_image(data)
                budget.charge(f"image {label!r} ({width}x{height})", width * height)
            except ImageBudgetExceeded as e:
                raise ImageError(f"image column {column!r} value {shorten(v)!r}: {e}", IMAGE_BUDGET) from None
            except ValueError as e:
                raise ImageError(f"image column {column!r} value {shorten(v)!r}: {e}") from None
            out.append({"kind": KIND, "column": column, "label": label, "page": 0, "caption": "", "dpi": 0,
                        "format": fmt, "width": width, "height": height, "data": data})
    return out
