"""Build a corpus of bad (and a few good) inputs in a directory, for connector tests.

    from tests.helpers.bad_inputs import build_bad_corpus
    corpus = build_bad_corpus(tmp_path)   # -> Corpus(pdf_dir, text_dir, jsonl_path, expected...)

Every bad PDF is made with pymupdf at test time, nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random

import pymupdf

GOOD_PDF_TEXT = "A good paper about coastal fog. It has one page of ordinary text."


@dataclasses.dataclass
class Corpus:
    pdf_dir: pathlib.Path
    text_dir: pathlib.Path
    jsonl_path: pathlib.Path
    # file name -> expected error_type (None for a good document)
    pdf_expected: dict[str, str | None]
    text_expected: dict[str, str | None]
    # JSONL line number -> expected error_type (None: good)
    jsonl_expected: dict[int, str | None]
    oversized_pages: int


def _one_page_pdf(text: str) -> bytes:
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_text((72, 100), text, fontname="helv", fontsize=11)
    return doc.tobytes()


def good_pdf() -> bytes:
    return _one_page_pdf(GOOD_PDF_TEXT)


def corrupt_pdf(seed: int = 7) -> bytes:
    rng = random.Random(seed)
    return b"%PDF-1.7\n" + bytes(rng.randrange(256) for _ in range(4000))


def truncated_pdf() -> bytes:
    doc = pymupdf.open()
    for i in range(3):
        doc.new_page().insert_text((72, 100), f"Page body number {i} with some words.", fontsize=11)
    data = doc.tobytes()
    return data[: len(data) // 2]


def encrypted_pdf() -> bytes:
    doc = pymupdf.open()
    doc.new_page().insert_text((72, 100), "Secret text nobody should read.", fontsize=11)
    return doc.tobytes(encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw="user-secret",
                       owner_pw="owner-secret")


def blank_pdf() -> bytes:
    doc = pymupdf.open()
    doc.new_page()
    return doc.tobytes()


def image_only_pdf() -> bytes:
    pix = pymupdf.Pixmap(pymupdf.csRGB, pymupdf.IRect(0, 0, 32, 32), False)
    pix.set_rect(pix.irect, (200, 30, 30))
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_image(pymupdf.Rect(72, 72, 300, 300), stream=pix.tobytes("png"))
    return doc.tobytes(deflate=True)


def oversized_pdf(pages: int = 60) -> bytes:
    doc = pymupdf.open()
    for i in range(1, pages + 1):
        doc.new_page(width=300, height=400).insert_text((40, 80), f"Section {i} marker-{i:03d} text.",
                                                         fontsize=10)
    return doc.tobytes(deflate=True)


def build_bad_corpus(root: pathlib.Path, oversized_pages: int = 60) -> Corpus:
    root = pathlib.Path(root)
    pdf_dir = root / "pdfs"
    text_dir = root / "texts"
    pdf_dir.mkdir(parents=True, exist_ok=True)
    text_dir.mkdir(parents=True, exist_ok=True)

    pdfs = {
        "good.pdf": (good_pdf(), None),
        "corrupt.pdf": (corrupt_pdf(), "CorruptPDF"),
        "truncated.pdf": (truncated_pdf(), "CorruptPDF"),
        "encrypted.pdf": (encrypted_pdf(), "EncryptedPDF"),
        "blank.pdf": (blank_pdf(), "EmptyDocument"),
        "zero_bytes.pdf": (b"", "EmptyDocument"),
        "image_only.pdf": (image_only_pdf(), "ImageOnlyPDF"),
        "oversized.pdf": (oversized_pdf(oversized_pages), None),
    }
    for name, (data, _) in pdfs.items():
        (pdf_dir / name).write_bytes(data)

    texts = {
        "good.txt": ("Plain notes about tides.\nSecond line.\n".encode("utf-8"), None),
        "latin1.txt": ("Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9".encode("latin-1"), "DecodeError"),
        "empty.md": (b"  \n", "EmptyDocument"),
        "notes.md": ("# Field Notes\n\nSaw a heron \u2014 twice.\n".encode("utf-8"), None),
    }
    for name, (data, _) in texts.items():
        (text_dir / name).write_bytes(data)

    lines = [
        (json.dumps({"id": "a1", "text": "First good record.", "title": "One"}), None),
        ('{"id": "a2", "text": "unterminated', "MalformedJSON"),
        (json.dumps({"id": "a3", "body": "no text field here"}), "MissingField"),
        ("", "blank"),  # blank lines are skipped, not rows
        (json.dumps({"id": "a4", "text": "Second good record."}), None),
        (json.dumps(["not", "an", "object"]), "MalformedJSON"),
        (json.dumps({"id": "a6", "text": 42}), "BadFieldType"),
        (json.dumps({"text": "good text but no id"}), "MissingField"),
    ]
    jsonl_path = root / "records.jsonl"
    raw = "\n".join(line for line, _ in lines).encode("utf-8") + b"\n"
    raw += b'{"id": "a9", "text": "bad byte \xff here"}\n'
    jsonl_path.write_bytes(raw)
    jsonl_expected = {i: exp for i, (_, exp) in enumerate(lines, start=1) if exp != "blank"}
    jsonl_expected[len(lines) + 1] = "DecodeError"

    return Corpus(pdf_dir=pdf_dir, text_dir=text_dir, jsonl_path=jsonl_path,
                  pdf_expected={k: v for k, (_, v) in pdfs.items()},
                  text_expected={k: v for k, (_, v) in texts.items()},
                  jsonl_expected=jsonl_expected, oversized_pages=oversized_pages)
