"""The README stays a five-minute read and every link in the docs leads somewhere."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
README_MAX_LINES = 150


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it to {README_MAX_LINES} (the rest belongs in docs/)"


def broken_links(page: pathlib.Path) -> list[str]:
    out = []
    for target, _ in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            out.append(f"{page.relative_to(ROOT)}: {target}")
    return out


def test_every_relative_link_exists():
    bad = [b for p in _pages() for b in broken_links(p)]
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_the_link_check_catches_a_missing_file(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("see [this](missing.md) and [that](x.md#top) and [web](https://example.org)")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["x.md: missing.md"]
    finally:
        ROOT = root
