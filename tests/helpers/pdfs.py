"""The sample papers: their folder and samples/make_samples.py (the source text each PDF
was built from), for tests/test_pdf.py, test_pdf_sections.py and test_longdoc.py."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAPERS_DIR = ROOT / "samples" / "papers"


def _load_samples_module():
    spec = importlib.util.spec_from_file_location("make_samples", ROOT / "samples" / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_samples", module)
    spec.loader.exec_module(module)
    return module


SAMPLES = _load_samples_module()
