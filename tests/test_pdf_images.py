"""A PDF's page images and figure/table crops (connectors/images.py), rendered in the parse
process under the job's budgets: captions and the graphics they label, the container the
parse stage ships them in, scanned pages, and the document's identity. No model, no Ray."""
from __future__ import annotations

import pathlib

import pytest

from connectors.images import find_figures, images_digest, pack_images, render_images, selected_pages, unpack_images
from connectors.pdf import extract_pdf

PAPERS = pathlib.Path(__file__).resolve().parent.parent / "samples" / "papers"
LONG = ("rainfed_wheat_soil_moisture", "tidal_array_wakes", "urban_heat_islands", "long_context_batch_serving")
FIGS = {"renders": [{"pages": None, "figures": True, "dpi": 144, "format": "png"}]}


def _pdf_with_table_and_photo() -> bytes:
    """Page 1: a raster image with "Figure 1: ..." below it; a booktabs table (three rules, text
    rows) under "Table 1. ..."; body text around both."""
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=612, height=792)
    page.insert_text((72, 80), "Body text before the figure explains the setting of the study.", fontsize=10)
    pix = pymupdf.Pixmap(pymupdf.csRGB, pymupdf.IRect(0, 0, 40, 20), False)
    pix.set_rect(pix.irect, (30, 90, 200))
    page.insert_image(pymupdf.Rect(72, 100, 372, 250), stream=pix.tobytes("png"))
    page.insert_text((72, 268), "Figure 1: A photograph of the instrument.", fontsize=9)
    page.insert_text((72, 330), "More body text between the figure and the table, long enough to be prose.",
                     fontsize=10)
    page.insert_text((72, 370), "Table 1. Yields by site and year.", fontsize=9)
    for y in (380, 398, 460):
        page.draw_line((72, y), (400, y), width=0.8)
    for i, row in enumerate(("site  2019  2020", "north  3.1  3.4", "south  2.7  2.9", "east  3.3  3.0")):
        page.insert_text((80, 393 + 18 * i + (4 if i else 0)), row, fontsize=9)
    page.insert_text((72, 520), "Text after the table closes the page.", fontsize=10)
    return doc.tobytes()


@pytest.mark.parametrize("slug", LONG)
def test_every_figure_of_the_long_samples_is_found_with_its_caption(slug):
    import pymupdf

    with pymupdf.open(PAPERS / f"{slug}.pdf") as doc:
        found = [(n + 1, *f) for n in range(doc.page_count) for f in find_figures(doc[n])]
    assert [f[2] for f in found] == ["Figure 1", "Figure 2", "Figure 3", "Figure 4"]
    for page, kind, label, caption, rect in found:
        assert kind == "figure" and caption.startswith(label + ":")
        width, height = rect[2] - rect[0], rect[3] - rect[1]
        assert 150 < width < 300 and 60 < height < 150, (label, rect)  # the drawn plot, one column wide


def test_a_table_and_a_raster_figure_are_cropped_with_their_captions():
    import pymupdf

    with pymupdf.open(stream=_pdf_with_table_and_photo(), filetype="pdf") as doc:
        found = {label: (kind, caption, rect) for kind, label, caption, rect in find_figures(doc[0])}
    assert set(found) == {"Figure 1", "Table 1"}
    kind, caption, rect = found["Figure 1"]
    assert kind == "figure" and caption == "Figure 1: A photograph of the instrument."
    assert rect[1] < 100 + 1 and rect[3] > 250 - 1 and rect[3] < 262  # the image, not its caption
    kind, caption, rect = found["Table 1"]
    assert kind == "table" and caption == "Table 1. Yields by site and year."
    assert 372 < rect[1] < 381 and 459 < rect[3] < 470  # from the top rule to the bottom rule, rows inside


def test_pages_and_crops_render_as_compressed_bytes_and_pack_losslessly():
    import pymupdf

    req = {"renders": [{"pages": "first:2", "figures": True, "dpi": 72, "format": "jpeg"},
                       {"pages": [1], "figures": False, "dpi": 144, "format": "webp"}]}
    with pymupdf.open(PAPERS / "rainfed_wheat_soil_moisture.pdf") as doc:
        images = render_images(doc, doc.page_count, req)
    labels = [(i["label"], i["dpi"], i["format"]) for i in images]
    assert labels == [("page 1", 72, "jpeg"), ("page 2", 72, "jpeg"), ("page 1", 144, "webp"),
                      ("Figure 1", 72, "jpeg"), ("Figure 2", 72, "jpeg"), ("Figure 3", 72, "jpeg"),
                      ("Figure 4", 72, "jpeg")]
    assert images[0]["data"][:3] == b"\xff\xd8\xff" and images[2]["data"][8:12] == b"WEBP"
    assert (images[0]["width"], images[0]["height"]) == (612, 792) and images[2]["width"] == 1224
    back = unpack_images(pack_images(images))
    assert [b["data"] for b in back] == [i["data"] for i in images]
    assert [b["label"] for b in back] == [i["label"] for i in images] and all(len(b["digest"]) == 64 for b in back)
    assert unpack_images(None) == []


def test_page_selections():
    assert selected_pages("all", 3) == [1, 2, 3] and selected_pages("first:2", 5) == [1, 2]
    assert selected_pages([3, 1, 9], 4) == [1, 3] and selected_pages(None, 4) == []
    with pytest.raises(ValueError, match="first:N"):
        selected_pages("last:2", 4)


def test_past_the_image_budget_the_pdf_is_a_dead_letter():
    data = (PAPERS / "rainfed_wheat_soil_moisture.pdf").read_bytes()
    row = extract_pdf(data, "x.pdf", images={**FIGS, "max_images": 3})
    assert row["error_type"] == "ImageBudgetExceeded" and "input.max_images=3" in row["error"]
    row = extract_pdf(data, "x.pdf", images={"renders": [{"pages": "all", "dpi": 144}], "max_pixels": 5_000_000})
    assert row["error_type"] == "ImageBudgetExceeded" and "input.max_image_pixels=5,000,000" in row["error"]


def test_a_scanned_pdf_is_a_document_when_its_tasks_take_images():
    from tests.helpers.bad_inputs import image_only_pdf

    data = image_only_pdf()
    assert extract_pdf(data, "scan.pdf")["error_type"] == "ImageOnlyPDF"  # a text job: nothing to read
    row = extract_pdf(data, "scan.pdf", images={"renders": [{"pages": None, "dpi": 100, "format": "png"}]})
    assert row["error"] is None and row["text"] == "" and row["pages"] == 1
    (page,) = row["images"]
    assert page["label"] == "page 1" and page["textless"] and page["dpi"] == 100 and page["data"][:4] == b"\x89PNG"


def test_the_images_are_part_of_the_documents_identity():
    data = (PAPERS / "rainfed_wheat_soil_moisture.pdf").read_bytes()
    text_only = extract_pdf(data, "a.pdf")
    with_figs = extract_pdf(data, "a.pdf", images=FIGS)
    at_72 = extract_pdf(data, "a.pdf", images={"renders": [{**FIGS["renders"][0], "dpi": 72}]})
    assert with_figs["text"] == text_only["text"]
    assert len({text_only["doc_id"], with_figs["doc_id"], at_72["doc_id"]}) == 3
    assert extract_pdf(data, "b.pdf", images=FIGS)["doc_id"] == with_figs["doc_id"]  # content, not the name
    assert images_digest(with_figs["images"]) != images_digest(at_72["images"])


def test_the_parse_stage_renders_in_the_parser_process_and_packs_the_images(tmp_path):
    from connectors.parse import parse_file

    (row,) = parse_file({"url": str(PAPERS / "tidal_array_wakes.pdf")}, "pdf", "text", None, None, 1000,
                        images={"renders": [{"pages": [2], "figures": True, "dpi": 72, "format": "png"}]})
    assert row["error"] is None and isinstance(row["images"], bytes)
    assert [i["label"] for i in unpack_images(row["images"])] == ["page 2", "Figure 1", "Figure 2", "Figure 3",
                                                                  "Figure 4"]
    (plain,) = parse_file({"url": str(PAPERS / "tidal_array_wakes.pdf")}, "pdf", "text", None, None, 1000)
    assert plain["images"] is None
