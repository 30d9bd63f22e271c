"""PDF -> one row of clean text, with pymupdf.

``extract_pdf(data, source, max_pages=None)`` never raises on bad input: encrypted,
corrupt/truncated, empty and image-only PDFs become error rows (see records.py). Running out of
memory raises MemoryError (MuPDF's failed allocations too): it says nothing about the file
being damaged, and `connectors.parse` runs this in a parser process with a memory cap.

What it does to a readable PDF, page by page (``page.get_text("dict")``):

* drops running headers / footers: text blocks lying wholly in the top or bottom
  ``MARGIN_FRAC`` of the page that repeat on other pages (digits ignored), or that are
  page numbers ("7", "Page 7", "7 of 12", "- 7 -"); bare page-number lines elsewhere too;
* restores reading order across columns: blocks crossing the middle of the text area are
  full-width (titles, abstracts); between two full-width blocks the left column is read
  top to bottom, then the right column;
* rebuilds paragraphs (a new block, a vertical gap or a change of font style starts one;
  a paragraph broken by a column or page break is joined back), joins words hyphenated at
  line ends ("compu-" + "tation" -> "computation", but "non-" + "English" keeps the
  hyphen), expands ligatures (U+FB00..U+FB06), tidies whitespace;
* title: the PDF metadata title when it looks real, else the largest-font text on page 1;
* structure (connectors/sections.py): ``abstract``, ``sections`` ([{heading, level, text}]),
  ``references`` and ``references_span`` (the references part's character span in ``text``,
  heading included), from the paragraphs' font sizes, boldness and numbering.

The returned row's ``pages`` is the document's page count (even when ``max_pages`` caps
how many pages are read).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics

from .sections import Para, structure
from .records import (CORRUPT_PDF, EMPTY_DOCUMENT, ENCRYPTED_PDF, IMAGE_ONLY_PDF, cut_text, error_row,
                      ok_row)

log = logging.getLogger(__name__)

MARGIN_FRAC = 0.07          # header/footer band, as a fraction of the page height
EOF_TAIL_BYTES = 2048       # a complete PDF has %%EOF within its last bytes

LIGATURE_MAP = {
    "\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl",
    "\ufb05": "st", "\ufb06": "st",
}
_LIGATURE_TABLE = str.maketrans(LIGATURE_MAP)
# spaces that should become a plain space; zero-width characters that should vanish
_SPACE_TABLE = str.maketrans({"\u00a0": " ", "\u2002": " ", "\u2003": " ", "\u2009": " ",
                              "\u202f": " ", "\t": " ", "\u200b": None, "\ufeff": None})

_PAGE_NUMBER_RE = re.compile(
    r"^[\s\-\u2013\u2014\[\(]*(?:page|p\.|seite|pag\.)?\s*(\d{1,4}|[ivxlcdm]{1,7})"
    r"(?:\s*(?:of|/|von|de)\s*(\d{1,4}))?[\s\-\u2013\u2014\]\)]*$",
    re.IGNORECASE)
_EXPLICIT_PAGE_RE = re.compile(r"^\s*(?:page\s+\d{1,4}(?:\s+of\s+\d{1,4})?|\d{1,4}\s*(?:of|/)\s*\d{1,4})\s*$",
                               re.IGNORECASE)
_JUNK_TITLES = re.compile(r"^(untitled|none|title|document\d*|microsoft word\b.*|.*\.(pdf|docx?|tex|dvi))$",
                          re.IGNORECASE)
_WORD_RE = re.compile(r"[^\W\d_][\w\-]*", re.UNICODE)
_TERMINAL = ".!?:;\u201d\"')]"


def normalize_ligatures(text: str) -> str:
    """Expand the Latin ligature code points U+FB00..U+FB06 (ﬀ ﬁ ﬂ ﬃ ﬄ ﬅ ﬆ)."""
    return text.translate(_LIGATURE_TABLE)


def tidy_line(text: str) -> str:
    """Ligatures expanded, odd spaces made plain, runs of spaces collapsed, ends stripped."""
    text = normalize_ligatures(text).translate(_SPACE_TABLE)
    text = "".join(ch for ch in text if ch >= " " or ch == "\n")
    return re.sub(r" {2,}", " ", text).strip()


def is_page_number(text: str) -> bool:
    """'7', 'Page 7', '7 of 12', '- 7 -', 'vii' (short roman numerals)."""
    return bool(_PAGE_NUMBER_RE.match(text.strip())) if text.strip() else False


def join_lines(lines: list[str], vocabulary: set[str] | None = None) -> str:
    """Join the lines of one paragraph, undoing end-of-line hyphenation.

    "compu-" + "tation" -> "computation"; "non-" + "English" -> "non-English";
    a soft hyphen (U+00AD) at a line end is always a break hyphen. With a
    ``vocabulary`` (words seen in the document), "key-" + "value" keeps its hyphen
    when "key-value" occurs elsewhere and "keyvalue" does not.
    """
    out = ""
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if not out:
            out = line
            continue
        if out.endswith("\u00ad"):
            out = out[:-1] + line
        elif out.endswith("-") and len(out) >= 2 and out[-2].isalpha() and line[0].isalpha():
            if line[0].islower() and not _keep_hyphen(out, line, vocabulary):
                out = out[:-1] + line
            else:
                out = out + line
        else:
            out = out + " " + line
    return out.replace("\u00ad", "")


def _keep_hyphen(left: str, right: str, vocabulary: set[str] | None) -> bool:
    if not vocabulary:
        return False
    head = re.search(r"([\w\-]+)-$", left)
    tail = re.match(r"[\w\-]+", right)
    if not head or not tail:
        return False
    hyphenated = f"{head.group(1)}-{tail.group(0)}".lower()
    joined = f"{head.group(1)}{tail.group(0)}".lower()
    return hyphenated in vocabulary and joined not in vocabulary


# ------------------------------------------------------------------ page model


@dataclasses.dataclass
class _Line:
    text: str
    x0: float
    y0: float
    x1: float
    y1: float
    size: float
    bold: bool


@dataclasses.dataclass
class _Block:
    lines: list[_Line]

    @property
    def x0(self) -> float:
        return min(l.x0 for l in self.lines)

    @property
    def x1(self) -> float:
        return max(l.x1 for l in self.lines)

    @property
    def y0(self) -> float:
        return min(l.y0 for l in self.lines)

    @property
    def y1(self) -> float:
        return max(l.y1 for l in self.lines)

    @property
    def text(self) -> str:
        return " ".join(l.text for l in self.lines)


def _page_blocks(page_dict: dict) -> list[_Block]:
    blocks = []
    for b in page_dict.get("blocks", ()):
        if b.get("type", 0) != 0:
            continue
        lines = []
        for ln in b.get("lines", ()):
            spans = [s for s in ln.get("spans", ()) if s.get("text")]
            text = tidy_line("".join(s["text"] for s in spans))
            if not text:
                continue
            # the style of a line is that of the span holding most of its characters
            main = max(spans, key=lambda s: len(s["text"].strip()))
            x0, y0, x1, y1 = ln["bbox"]
            lines.append(_Line(text, x0, y0, x1, y1, round(float(main.get("size", 0.0)), 1),
                               bool(main.get("flags", 0) & 16) or "bold" in main.get("font", "").lower()))
        if lines:
            blocks.append(_Block(lines))
    return blocks


def _margin_key(text: str) -> str:
    return re.sub(r"\d+", "#", text.lower()).strip()


def _in_margin(block: _Block, height: float) -> bool:
    band = MARGIN_FRAC * height
    return block.y1 <= band + 0.5 or block.y0 >= height - band - 0.5


def _drop_headers_footers(pages: list[tuple[float, list[_Block]]]) -> list[list[_Block]]:
    """Remove running headers/footers and page numbers; returns the body blocks per page."""
    counts: dict[str, int] = {}
    for height, blocks in pages:
        for key in {_margin_key(b.text) for b in blocks if _in_margin(b, height)}:
            counts[key] = counts.get(key, 0) + 1
    repeat_threshold = 2 if len(pages) >= 2 else 10**9
    kept_pages = []
    for number, (height, blocks) in enumerate(pages, start=1):
        kept = []
        for b in blocks:
            if _in_margin(b, height):
                if is_page_number(b.text) or counts.get(_margin_key(b.text), 0) >= repeat_threshold:
                    continue
            lines = [l for l in b.lines if not _bare_page_number(l.text, number)]
            if lines:
                kept.append(_Block(lines))
        kept_pages.append(kept)
    return kept_pages


def _bare_page_number(text: str, page_number: int) -> bool:
    if _EXPLICIT_PAGE_RE.match(text):
        return True
    digits = text.strip(" -\u2013\u2014")
    return digits.isdigit() and int(digits) == page_number


def _reading_order(blocks: list[_Block]) -> list[_Block]:
    """Order a page's blocks: full-width ones in place; between them left column, then right."""
    if len(blocks) < 2:
        return list(blocks)
    left_edge = min(b.x0 for b in blocks)
    right_edge = max(b.x1 for b in blocks)
    mid = (left_edge + right_edge) / 2
    tol = 0.02 * (right_edge - left_edge)

    def crosses(x0: float, x1: float) -> bool:
        return x0 < mid - tol and x1 > mid + tol

    items: list[tuple[str, _Block]] = []
    for b in blocks:
        if crosses(b.x0, b.x1):
            crossing = sum(crosses(l.x0, l.x1) for l in b.lines)
            if crossing * 2 >= len(b.lines):
                items.append(("full", b))
                continue
            # a block merged across the gutter: classify its lines one by one
            for l in b.lines:
                side = "full" if crosses(l.x0, l.x1) else ("left" if (l.x0 + l.x1) / 2 < mid else "right")
                items.append((side, _Block([l])))
            continue
        items.append(("left" if (b.x0 + b.x1) / 2 < mid else "right", b))

    lefts = [b for side, b in items if side == "left"]
    rights = [b for side, b in items if side == "right"]
    two_columns = any(l.y0 < r.y1 and r.y0 < l.y1 for l in lefts for r in rights)
    if not two_columns:
        return [b for _, b in sorted(items, key=lambda it: (round(it[1].y0, 1), it[1].x0))]

    ordered: list[_Block] = []
    segment: list[tuple[str, _Block]] = []

    def flush() -> None:
        ordered.extend(sorted((b for s, b in segment if s == "left"), key=lambda b: b.y0))
        ordered.extend(sorted((b for s, b in segment if s == "right"), key=lambda b: b.y0))
        segment.clear()

    for side, b in sorted(items, key=lambda it: it[1].y0):
        if side == "full":
            flush()
            ordered.append(b)
        else:
            segment.append((side, b))
    flush()
    return ordered


def _paragraphs(blocks: list[_Block]) -> list[list[_Line]]:
    """Split ordered blocks into paragraphs (lists of lines)."""
    paras: list[list[_Line]] = []
    for b in blocks:
        heights = [l.y1 - l.y0 for l in b.lines]
        typical = statistics.median(heights) if heights else 0.0
        current: list[_Line] = []
        for line in b.lines:
            if current:
                prev = current[-1]
                gap = line.y0 - prev.y1
                style_change = (abs(line.size - prev.size) > 0.6) or (line.bold != prev.bold)
                if style_change or gap > 0.6 * typical or line.y0 < prev.y0 - 1:
                    paras.append(current)
                    current = []
            current.append(line)
        if current:
            paras.append(current)
    return paras


def _continues(prev: list[_Line], nxt: list[_Line]) -> bool:
    """Is ``nxt`` the rest of ``prev``, split by a column or page break?"""
    last, first = prev[-1], nxt[0]
    if abs(last.size - first.size) > 0.6 or last.bold != first.bold:
        return False
    tail = last.text.rstrip()
    head = first.text.lstrip()
    if not tail or not head:
        return False
    # pymupdf sometimes puts the lines of one paragraph (e.g. a two-line title) in separate
    # blocks: same style, next line directly below and overlapping horizontally
    height = max(last.y1 - last.y0, 1.0)
    gap = first.y0 - last.y1
    if -0.3 * height <= gap < 0.6 * height and first.x0 < last.x1 and last.x0 < first.x1 \
            and tail[-1] not in ".!?":
        return True
    if tail.endswith("-") and head[0].isalpha():
        return True
    # a sentence broken by a column/page break goes on in lower case or with a number
    return tail[-1] not in _TERMINAL and (head[0].islower() or head[0].isdigit())


def _vocabulary(paras: list[list[_Line]]) -> set[str]:
    vocab: set[str] = set()
    for para in paras:
        for line in para:
            words = _WORD_RE.findall(line.text)
            if words and line.text.rstrip().endswith("-"):
                words = words[:-1]  # the broken word at the line end is not evidence
            vocab.update(w.lower().strip("-") for w in words)
    return vocab


def _title_from_fonts(blocks: list[_Block]) -> str | None:
    lines = [l for b in blocks for l in b.lines]
    if not lines:
        return None
    chars_by_size: dict[float, int] = {}
    for l in lines:
        chars_by_size[l.size] = chars_by_size.get(l.size, 0) + len(l.text)
    body_size = max(chars_by_size, key=chars_by_size.get)
    top = max(l.size for l in lines)
    if top <= body_size + 0.5:
        return None
    title_lines: list[_Line] = []
    for l in sorted(lines, key=lambda l: (l.y0, l.x0)):
        if l.size >= top - 0.5:
            title_lines.append(l)
        elif title_lines:
            break
    title = join_lines([l.text for l in title_lines])
    return title[:500] or None


def _metadata_title(meta: dict | None) -> str | None:
    title = tidy_line((meta or {}).get("title") or "")
    if len(title) < 3 or _JUNK_TITLES.match(title):
        return None
    return title


# ------------------------------------------------------------------ entry point


def extract_pdf(data: bytes, source: str, max_pages: int | None = None, max_text_chars: int | None = None,
                images: dict | None = None) -> dict:
    """Extract one PDF into a row (see connectors/records.py). Never raises on bad data.
    A text over ``max_text_chars`` is cut here, in the parser process, with its structure
    (`cut_document`), so the row that leaves it is bounded whatever the PDF expands to.
    ``images``: what to render besides the text (`connectors.images.render_images`' request):
    the row's ``images`` records; a PDF with no text but scanned pages is then a document."""
    if max_pages is not None and (not isinstance(max_pages, int) or max_pages < 1):
        raise ValueError(f"max_pages must be a positive int or None, got {max_pages!r}")
    data = bytes(data)
    if not data:
        return error_row(source=source, raw=data, error_type=EMPTY_DOCUMENT, error="file is empty (0 bytes)")
    if b"%PDF" not in data[:1024]:
        return error_row(source=source, raw=data, error_type=CORRUPT_PDF,
                         error=f"not a PDF: no %PDF header in the first 1024 bytes ({len(data)} bytes)")
    try:
        import pymupdf
    except ImportError as exc:  # a deployment problem, not a data problem
        raise RuntimeError("connectors.pdf needs pymupdf (pip install pymupdf)") from exc

    try:
        doc = pymupdf.open(stream=data, filetype="pdf")
    except Exception as exc:  # pymupdf raises FileDataError and friends
        _raise_if_out_of_memory(exc)
        return error_row(source=source, raw=data, error_type=CORRUPT_PDF,
                         error=f"cannot open PDF: {_short(exc)}")
    try:
        row = cut_document(_extract_open(doc, data, source, max_pages, pymupdf), max_text_chars)
        return _with_images(row, doc, data, source, max_pages, images) if images else row
    except Exception as exc:  # anything MuPDF throws mid-way on a damaged file
        _raise_if_out_of_memory(exc)
        log.warning("PDF extraction failed for %s: %s", source, exc)
        return error_row(source=source, raw=data, error_type=CORRUPT_PDF,
                         error=f"PDF extraction failed: {_short(exc)}")
    finally:
        doc.close()


def cut_document(row: dict, max_chars: int | None) -> dict:
    """`connectors.records.cut_text` for a PDF's row, its structure cut to the kept text: the
    sections in order while their text fits (the last one cut), the abstract cut, the
    references (and their span) only as far as the kept text reaches."""
    text = row.get("text") or ""
    if max_chars is None or len(text) <= max_chars:
        return row
    cut_text(row, max_chars)
    left, sections = max_chars, []
    for sec in row.get("sections") or []:
        if left <= 0:
            break
        sections.append({**sec, "text": sec["text"][:left]})
        left -= len(sec["text"])
    row["sections"] = sections
    row["abstract"] = (row.get("abstract") or "")[:max_chars]
    span = row.get("references_span")
    if span and span[0] < max_chars:
        end = min(span[1], max_chars)
        row["references"] = (row.get("references") or "")[:end - span[0]]
        row["references_span"] = [span[0], end]
    elif span:
        row["references"], row["references_span"] = "", None
    return row


def _with_images(row: dict, doc, data: bytes, source: str, max_pages: int | None, images: dict) -> dict:
    """The row with the images the job asks for (docs/multimodal.md): rendered here, in the
    parser process; its id covers them (the same text with other figures is another
    document). Past the per-document image budget the document is a dead letter."""
    from .ids import content_id
    from .images import IMAGE_BUDGET, ImageBudgetExceeded, images_digest, render_images

    if row.get("error") and row.get("error_type") not in (IMAGE_ONLY_PDF, EMPTY_DOCUMENT):
        return row
    if not doc.page_count:
        return row
    limit = doc.page_count if max_pages is None else min(doc.page_count, max_pages)
    try:
        rendered = render_images(doc, limit, images)
    except ImageBudgetExceeded as e:
        return error_row(source=source, raw=data, error_type=IMAGE_BUDGET, pages=doc.page_count,
                         error=f"{IMAGE_BUDGET}: {e}")
    if row.get("error"):  # no text layer: the scanned pages are the document
        if not any(im["textless"] for im in rendered):
            return row
        row = ok_row(doc_id=None, source=source, text="", title=_metadata_title(doc.metadata),
                     pages=doc.page_count)
        row.update(structure([], row["title"]))
    row["doc_id"] = content_id(row["text"] + "\n" + images_digest(rendered))
    row["images"] = rendered
    return row


_ALLOCATION_FAILED = re.compile(r"\b(?:m|c|re)alloc\b.*\bfailed\b|out of memory|cannot allocate", re.IGNORECASE)


def _raise_if_out_of_memory(exc: BaseException) -> None:
    """Memory exhaustion is not a damaged file: raise it as MemoryError (the parser process
    reports ParseMemoryExceeded) instead of a CorruptPDF row or a silently dropped page.
    MuPDF reports a failed allocation as ``FzErrorSystem: ... malloc (N bytes) failed`` (or
    ``calloc``, ``realloc``)."""
    if isinstance(exc, MemoryError):
        raise exc
    if _ALLOCATION_FAILED.search(str(exc)):
        raise MemoryError(_short(exc)) from exc


def _short(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _extract_open(doc, data: bytes, source: str, max_pages: int | None, pymupdf) -> dict:
    if doc.needs_pass:
        return error_row(source=source, raw=data, error_type=ENCRYPTED_PDF,
                         error="PDF is encrypted and needs a password to open")
    total = doc.page_count
    if b"%%EOF" not in data[-EOF_TAIL_BYTES:]:
        return error_row(source=source, raw=data, error_type=CORRUPT_PDF, pages=total or None,
                         error=f"truncated PDF: no %%EOF marker at the end ({len(data)} bytes)")
    if total == 0:
        return error_row(source=source, raw=data, error_type=EMPTY_DOCUMENT, pages=0,
                         error="PDF has no pages")
    limit = total if max_pages is None else min(total, max_pages)
    if limit < total:
        log.info("%s: reading the first %d of %d pages (max_pages)", source, limit, total)

    flags = pymupdf.TEXT_PRESERVE_WHITESPACE | pymupdf.TEXT_MEDIABOX_CLIP
    pages: list[tuple[float, list[_Block]]] = []
    page_failures: list[str] = []
    images = 0
    for index in range(limit):
        try:
            page = doc.load_page(index)
            page_dict = page.get_text("dict", flags=flags)
            images += len(page.get_images(full=False))
            pages.append((page.rect.height, _page_blocks(page_dict)))
        except Exception as exc:
            _raise_if_out_of_memory(exc)
            page_failures.append(f"page {index + 1}: {_short(exc, 80)}")
            pages.append((792.0, []))
    if page_failures and len(page_failures) == limit:
        return error_row(source=source, raw=data, error_type=CORRUPT_PDF, pages=total,
                         error="no page could be read: " + "; ".join(page_failures[:3]))
    if page_failures:
        log.warning("%s: %d unreadable page(s): %s", source, len(page_failures), "; ".join(page_failures[:3]))

    body_pages = _drop_headers_footers(pages)
    styled = _body_paragraphs(body_pages)
    text = "\n\n".join(p.text for p in styled)

    if not text.strip():
        if images:
            return error_row(source=source, raw=data, error_type=IMAGE_ONLY_PDF, pages=total,
                             error=f"no extractable text on {limit} page(s) but {images} image(s): "
                                   f"scanned PDF? (needs OCR)")
        return error_row(source=source, raw=data, error_type=EMPTY_DOCUMENT, pages=total,
                         error=f"no text on {limit} page(s)")

    title = _metadata_title(doc.metadata) or (_title_from_fonts(body_pages[0]) if body_pages else None)
    row = ok_row(doc_id=None, source=source, text=text, title=title, pages=total)
    row.update(structure(styled, title))
    return row


def _body_paragraphs(body_pages: list[list[_Block]]) -> list[Para]:
    """The text's paragraphs in reading order, each with its dominant style."""
    paras: list[list[_Line]] = []
    for blocks in body_pages:
        for para in _paragraphs(_reading_order(blocks)):
            if paras and _continues(paras[-1], para):
                paras[-1].extend(para)
            else:
                paras.append(para)
    vocab = _vocabulary(paras)
    texts = [join_lines([l.text for l in para], vocab) for para in paras]
    return [_styled(para, t) for para, t in zip(paras, texts) if t]


def styled_paragraphs(data: bytes) -> list[Para]:
    """The paragraphs ``extract_pdf`` joins into ``text`` (same order, same text), with
    their styles: what connectors/sections.py works from. For tests and inspection."""
    import pymupdf

    flags = pymupdf.TEXT_PRESERVE_WHITESPACE | pymupdf.TEXT_MEDIABOX_CLIP
    with pymupdf.open(stream=bytes(data), filetype="pdf") as doc:
        pages = [(page.rect.height, _page_blocks(page.get_text("dict", flags=flags))) for page in doc]
    return _body_paragraphs(_drop_headers_footers(pages))


def _styled(para: list[_Line], text: str) -> Para:
    """A paragraph with the size and boldness that most of its characters have."""
    by_size: dict[float, int] = {}
    bold_chars = 0
    for line in para:
        by_size[line.size] = by_size.get(line.size, 0) + len(line.text)
        bold_chars += len(line.text) if line.bold else 0
    total = sum(by_size.values())
    return Para(text=text, size=max(by_size, key=by_size.get), bold=bold_chars * 2 > total, lines=len(para))
