"""Reading the run report's HTML page back: the text of every data-key / data-derived
element, its images and external links, and comparing a text with the JSON value it
shows. Used by tests/test_report_html.py and tests/test_cluster.py."""
from __future__ import annotations

import json
from html.parser import HTMLParser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class DataKeys(HTMLParser):
    """Collects the text of every element carrying data-key / data-derived, and img sources."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, str] = {}
        self.derived: dict[str, str] = {}
        self.images: list[str] = []
        self.external: list[str] = []
        self._stack: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for a in ("href", "src"):
            if a in attrs and not str(attrs[a]).startswith("data:"):
                self.external.append(attrs[a])
        if "data-key" in attrs:
            self._stack.append((tag, "key", attrs["data-key"]))
        elif "data-derived" in attrs:
            self._stack.append((tag, "derived", attrs["data-derived"]))
        else:
            self._stack.append((tag, "", ""))
        self._text = []

    def handle_data(self, data):
        if self._stack and self._stack[-1][1]:
            self._text.append(data)

    def handle_endtag(self, tag):
        if not self._stack:
            return
        _, kind, key = self._stack.pop()
        if kind == "key":
            self.values[key] = "".join(self._text)
        elif kind == "derived":
            self.derived[key] = "".join(self._text)


def parse(path) -> DataKeys:
    parser = DataKeys()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    return parser


def lookup(report, key):
    if key in report:
        return report[key]
    node = report
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def same(text: str, value) -> bool:
    if isinstance(value, bool) or value is None:
        return text == json.dumps(value)
    if isinstance(value, (int, float)):
        return float(text) == float(value) and (not isinstance(value, int) or text == str(value))
    if isinstance(value, str):
        return text == value
    return json.loads(text) == value
