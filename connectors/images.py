"""A PDF's pages and figures as images, rendered in the parser process (docs/multimodal.md).

``render_images(doc, pages_read, request)`` renders, with pymupdf, what the job's tasks ask
for (``request``, `image_request` of the job: one entry per distinct task ``images:``):

* page images: ``pages`` a list of 1-based page numbers, ``"all"`` or ``"first:N"``, at the
  entry's ``dpi``; pages past the document (or past ``input.max_pages``) are not rendered;
* figure and table crops (``figures: true``): every caption that starts "Figure n", "Fig. n"
  or "Table n" (then ":" or ".") found on a page, with the graphics it labels: for a figure
  the nearest cluster of drawings and raster images above the caption (a table's caption
  may also sit below it), for a table the rules below it and the text between them; each
  crop keeps its label ("Figure 3"), its caption text and its page. A caption whose
  graphics are not found gives no crop (a figure drawn as text alone, a caption split over
  a column break);
* every page with no text layer (a scanned page) at the largest dpi asked, so a document
  without text is no longer empty: a vision-language model reads it (OCR-free).

Each image is one record ``{kind: page|figure|table, label, page, caption, dpi, format,
width, height, data}``: ``data`` the compressed bytes (PNG, JPEG or WebP), never a decoded
array. Bounds, besides the parser process's own time and memory caps: at most
``max_images`` images and ``max_pixels`` pixels per document, checked before each render;
past either, `ImageBudgetExceeded` (the document's dead letter, naming the budget).

`pack_images` / `unpack_images`: the records of one document as one binary value (a JSON
header, then the bytes), the parse stage's ``images`` column: one Arrow type whatever a
document holds. Each record's ``digest`` (sha256 of its bytes) is the image's identity: it
enters the document's id and the requests' prefix salt.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct

MAGIC = b"DLBI1"
_LEN = struct.Struct("!I")
CAPTION = re.compile(r"^\s*(Figure|Fig\.|Table)\s*(\d+[A-Za-z]?)\s*[:.]", re.IGNORECASE)
FORMATS = ("png", "jpeg", "webp")
MAX_IMAGES = 64  # input.max_images' default
MAX_PIXELS = 64_000_000  # input.max_image_pixels' default
GAP = 8.0  # points: graphics this close belong to one figure
IMAGE_BUDGET = "ImageBudgetExceeded"


class ImageBudgetExceeded(ValueError):
    """A document asks for more images or pixels than the job's per-document budget."""


# ------------------------------------------------------------------ the container
def pack_images(images: list[dict]) -> bytes:
    """Records (with ``data`` bytes) -> one binary value; the header holds the rest and each
    image's digest."""
    header, blobs, offset = [], [], 0
    for im in images:
        data = bytes(im["data"])
        meta = {k: v for k, v in im.items() if k != "data"}
        meta.update(offset=offset, size=len(data), digest=hashlib.sha256(data).hexdigest())
        header.append(meta)
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, ensure_ascii=False).encode()
    return MAGIC + _LEN.pack(len(head)) + head + b"".join(blobs)


def unpack_images(blob: bytes | None) -> list[dict]:
    """`pack_images`' value -> the records, each with its ``data`` and ``digest``; [] for None."""
    if not blob:
        return []
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise ValueError("not a packed image list (no DLBI1 header)")
    (n,) = _LEN.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    header = json.loads(blob[start:start + n])
    body = start + n
    return [{**m, "data": blob[body + m["offset"]: body + m["offset"] + m["size"]]} for m in header]


def images_digest(images: list[dict]) -> str:
    """One digest of a document's rendered images (their bytes, in order), for its id."""
    h = hashlib.sha256()
    for im in images:
        h.update(hashlib.sha256(bytes(im["data"])).digest())
    return h.hexdigest()


def packed_digest(blob: bytes | None) -> str | None:
    """`images_digest` of a `pack_images` value, from its header alone; None for no images."""
    if not blob:
        return None
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise ValueError("not a packed image list (no DLBI1 header)")
    (n,) = _LEN.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    h = hashlib.sha256()
    for m in json.loads(blob[start:start + n]):
        h.update(bytes.fromhex(m["digest"]))
    return h.hexdigest()


# ------------------------------------------------------------------ images given inline
MAGIC_BYTES = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",), "webp": (b"RIFF",)}
DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp);base64,(.*)", re.DOTALL)


def sniff_format(data: bytes) -> str | None:
    """``png``, ``jpeg`` or ``webp`` from the first bytes; None for anything else."""
    for fmt, heads in MAGIC_BYTES.items():
        if any(data.startswith(h) for h in heads) and (fmt != "webp" or data[8:12] == b"WEBP"):
            return fmt
    return None


def data_url_image(url: str) -> bytes:
    """A ``data:image/<png|jpeg|webp>;base64,...`` URL -> the image's compressed bytes (not
    decoded: their first bytes checked against the format the URL names). Raises ValueError
    naming what is wrong."""
    import base64
    import binascii

    m = DATA_URL.fullmatch(url.strip()) if isinstance(url, str) else None
    if m is None:
        head = url[:40] if isinstance(url, str) else type(url).__name__
        raise ValueError(f"{head!r} is not a data:image/(png|jpeg|webp);base64 URL")
    fmt = "jpeg" if m.group(1) == "jpg" else m.group(1)
    try:
        data = base64.b64decode(m.group(2), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"its base64 payload does not decode ({e})") from None
    if sniff_format(data) != fmt:
        raise ValueError(f"its bytes are not a {fmt.upper()} image (they start {data[:8]!r})")
    return data


# ------------------------------------------------------------------ what to render
def selected_pages(pages, count: int) -> list[int]:
    """1-based page numbers of a ``pages`` selection within a document of ``count`` pages read."""
    if pages is None:
        return []
    if pages == "all":
        return list(range(1, count + 1))
    if isinstance(pages, str):
        m = re.fullmatch(r"first:(\d+)", pages)
        if not m:
            raise ValueError(f"pages {pages!r}: give a list of page numbers, 'all' or 'first:N'")
        return list(range(1, min(count, int(m.group(1))) + 1))
    return sorted({int(p) for p in pages if 1 <= int(p) <= count})


def render_images(doc, pages_read: int, request: dict) -> list[dict]:
    """The images ``request`` asks of the open pymupdf ``doc`` (its first ``pages_read``
    pages): ``{"renders": [{pages, figures, dpi, format}], "max_images", "max_pixels"}``."""
    budget = ImageBudget.from_options(request)
    out: list[dict] = []
    seen: set = set()
    renders = request.get("renders") or []
    textless = {n for n in range(1, pages_read + 1) if not doc[n - 1].get_text("text").strip()}  # scanned
    for r in renders:
        for n in selected_pages(r.get("pages"), pages_read):
            _add(out, seen, budget, doc[n - 1], "page", f"page {n}", n, "", None, {**r, "textless": n in textless})
    top = max(renders, key=lambda r: int(r.get("dpi", 144)), default={"dpi": 144, "format": "png"})
    for n in sorted(textless):  # a scanned page is the document's content: always rendered (once, at any dpi)
        if not any(k[:2] == ("page", f"page {n}") for k in seen):
            _add(out, seen, budget, doc[n - 1], "page", f"page {n}", n, "", None, {**top, "textless": True})
    for r in renders:
        if r.get("figures"):
            for n in range(1, pages_read + 1):
                for kind, label, caption, rect in find_figures(doc[n - 1]):
                    _add(out, seen, budget, doc[n - 1], kind, label, n, caption, rect, r)
    return out


class ImageBudget:
    """A document's image budget: at most ``max_images`` images and ``max_pixels`` pixels together."""

    def __init__(self, max_images: int | None = None, max_pixels: int | None = None):
        """None (or 0): the default, MAX_IMAGES / MAX_PIXELS."""
        self.max_images, self.max_pixels = int(max_images or MAX_IMAGES), int(max_pixels or MAX_PIXELS)
        self.images = self.pixels = 0

    @classmethod
    def from_options(cls, options: dict | None) -> "ImageBudget":
        """A fresh budget from a request's ``max_images`` / ``max_pixels`` (defaults where absent)."""
        options = options or {}
        return cls(options.get("max_images"), options.get("max_pixels"))

    def charge(self, label: str, pixels: int) -> None:
        self.images += 1
        self.pixels += pixels
        if self.images > self.max_images:
            raise ImageBudgetExceeded(f"{label} would be image {self.images} of the document, over "
                                      f"input.max_images={self.max_images}")
        if self.pixels > self.max_pixels:
            raise ImageBudgetExceeded(f"{label} would bring the document's images to {self.pixels:,} pixels, over "
                                      f"input.max_image_pixels={self.max_pixels:,}")


def _add(out: list, seen: set, budget: ImageBudget, page, kind: str, label: str, number: int, caption: str, rect,
         r: dict) -> None:
    import pymupdf

    dpi, fmt = int(r.get("dpi", 144)), r.get("format", "png")
    key = (kind, label, dpi, fmt)
    if key in seen:
        return
    seen.add(key)
    clip = pymupdf.Rect(rect) if rect is not None else page.rect
    w, h = round(clip.width * dpi / 72), round(clip.height * dpi / 72)
    budget.charge(f"{label} at {dpi} dpi ({w}x{h})", w * h)
    pix = page.get_pixmap(dpi=dpi, clip=clip, alpha=False)
    out.append({"kind": kind, "label": label, "page": number, "caption": caption, "dpi": dpi, "format": fmt,
                "width": pix.width, "height": pix.height, "textless": bool(r.get("textless")),
                "data": encode_pixmap(pix, fmt)})


def encode_pixmap(pix, fmt: str) -> bytes:
    """A pymupdf pixmap (RGB) as compressed bytes: PNG, JPEG (quality 90) or WebP (Pillow)."""
    if fmt == "png":
        return pix.tobytes("png")
    if fmt == "jpeg":
        return pix.tobytes("jpg", jpg_quality=90)
    if fmt == "webp":
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.frombytes("RGB", (pix.width, pix.height), pix.samples).save(buf, "WEBP", quality=90)
        return buf.getvalue()
    raise ValueError(f"image format {fmt!r} is not one of {', '.join(FORMATS)}")


# ------------------------------------------------------------------ figures and tables
def find_figures(page) -> list[tuple[str, str, str, tuple]]:
    """(kind, label, caption, crop rect) of the captioned figures and tables of a page."""
    blocks = [b for b in page.get_text("blocks") if b[6] == 0]  # text blocks: (x0, y0, x1, y1, text, n, type)
    captions = [(b, m) for b in blocks for m in [CAPTION.match(b[4])] if m]
    if not captions:
        return []
    graphics = _graphics(page)
    out = []
    for b, m in captions:
        kind = "table" if m.group(1).lower() == "table" else "figure"
        label = f"{'Table' if kind == 'table' else 'Figure'} {m.group(2)}"
        cap = (b[0], b[1], b[2], b[3])
        rect = _table_region(cap, graphics, blocks) if kind == "table" else None
        rect = rect or _figure_region(cap, graphics)
        if rect is not None:
            out.append((kind, label, " ".join(b[4].split()), _pad(rect, page.rect)))
    return out


def _graphics(page) -> list[tuple]:
    """Rects of the page's drawings and raster images, less page-wide rules (headers, footers)."""
    rects = [tuple(d["rect"]) for d in page.get_drawings()]
    rects += [tuple(b["bbox"]) for b in page.get_text("dict")["blocks"] if b.get("type") == 1]
    width = page.rect.width
    return [r for r in rects if not (r[2] - r[0] > 0.8 * width and r[3] - r[1] < 2.0)]


def _overlap(a, b) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0]))


def _union(rects) -> tuple:
    return (min(r[0] for r in rects), min(r[1] for r in rects), max(r[2] for r in rects), max(r[3] for r in rects))


def _clusters(rects: list[tuple]) -> list[tuple]:
    """Rects merged while any two lie within GAP points of each other."""
    groups = [tuple(r) for r in rects]
    merged = True
    while merged:
        merged = False
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                a, b = groups[i], groups[j]
                if a[0] - GAP <= b[2] and b[0] - GAP <= a[2] and a[1] - GAP <= b[3] and b[1] - GAP <= a[3]:
                    groups[i] = _union([a, b])
                    del groups[j]
                    merged = True
                    break
            if merged:
                break
    return groups


def _figure_region(cap: tuple, graphics: list[tuple]) -> tuple | None:
    """The cluster of graphics nearest above the caption (else below), overlapping its column."""
    clusters = [c for c in _clusters(graphics) if _overlap(c, cap) > 0.3 * min(c[2] - c[0], cap[2] - cap[0])]
    above = [c for c in clusters if c[3] <= cap[1] + 2.0]
    if above:
        return max(above, key=lambda c: c[3])
    below = [c for c in clusters if c[1] >= cap[3] - 2.0]
    return min(below, key=lambda c: c[1]) if below else None


def _table_region(cap: tuple, graphics: list[tuple], blocks: list) -> tuple | None:
    """The rules below a table caption (each within 200 points of the one before, overlapping
    the caption's column) and the text blocks between them."""
    rules = sorted((g for g in graphics if g[1] >= cap[3] - 2.0 and _overlap(g, cap) > 0), key=lambda g: g[1])
    taken: list[tuple] = []
    for g in rules:
        if taken and g[1] - max(t[3] for t in taken) > 200.0:
            break
        taken.append(g)
    if not taken:
        return None
    box = _union(taken)
    inside = [b[:4] for b in blocks if b[1] >= box[1] - 1 and b[3] <= box[3] + 1 and _overlap(b, box) > 0]
    return _union([box, *inside])


def _pad(rect: tuple, page_rect, margin: float = 4.0) -> tuple:
    return (max(page_rect.x0, rect[0] - margin), max(page_rect.y0, rect[1] - margin),
            min(page_rect.x1, rect[2] + margin), min(page_rect.y1, rect[3] + margin))
