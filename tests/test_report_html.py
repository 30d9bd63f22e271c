"""The run report: PNG figure and self-contained HTML whose data-key values match the JSON."""
from __future__ import annotations

import base64
import math

import pytest

from dlbatch.report.html import COST_KEYS, HEADLINE_KEYS, render_report
from tests.helpers.report_html import PNG_MAGIC, lookup, parse, same


def full_report():
    return {
        "docs_total": 12,
        "docs_ok": 11,
        "docs_failed": 1,
        "rows_written": 33,
        "prompt_tokens": 61234,
        "prefill_tokens_computed": 20411,
        "output_tokens": 2001,
        "wall_s": 17.25,
        "docs_per_s": 0.6376811594202898,
        "tokens_per_s": 3665.855072463768,
        "plan": {"prefill": {"chip": "fast", "replicas": 1}, "decode": {"chip": "cheap", "replicas": 2}},
        "pools": {
            "prefill": {"busy_fraction": 0.83, "replicas": 1, "chip": "fast"},
            "decode": {"busy_fraction": 0.412, "replicas": 2, "chip": "cheap"},
        },
        "timeline": [{"t": 1.5 * i, "docs_done": i, "tokens_done": 300 * i * i} for i in range(10)],
        "prompt_token_hist": [1200, 3400, 5100, 800, 4096, 4096, 2900],
        "output_token_hist": [12, 30, 31, 48, 128, 64],
        "cost": {"usd_per_hour": 4.1, "usd_total": 0.019645833333333335, "usd_per_million_tokens": 0.31},
        "router": {"policy": "prefix_aware", "prefix_hit_rate": 0.66, "groups": 12},
        "retries": 2,
        "startup": {"intervals_s": {"driver_process": [-1.25, 0.0], "ray_start": [0.5, 5.0],
                                    "model_load": [6.0, 11.5], "generation": [12.0, 17.0]},
                    "phases_s": {"driver_process": 1.25, "ray_start": 4.5, "model_load": 5.5, "generation": 5.0},
                    "first_token_s": 12.0, "to_first_token_s": 13.25},
        "generation": {"bin_s": 1.0, "prefill_tokens": [0.0] * 12 + [3000.0, 0, 1500.0, 0, 0],
                       "decode_tokens": [0.0] * 12 + [100.0, 120.0, 130.0, 90.0, 40.0], "first_token_s": 12.0,
                       "last_done_s": 17.0, "requests": 9, "driver_clock_requests": 0},
    }


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One render of the full report shared by the tests that only read it (matplotlib is slow here)."""
    out = tmp_path_factory.mktemp("report") / "out"
    html_path, png_path = render_report(full_report(), out)
    return out, html_path, png_path


def test_html_values_match_the_report(rendered):
    report = full_report()
    out, html_path, png_path = rendered
    assert html_path == str(out / "_report.html")
    assert png_path == str(out / "_report.png")
    parsed = parse(html_path)

    expected = [k for k, _ in HEADLINE_KEYS] + [f"cost.{k}" for k, _ in COST_KEYS]
    expected += [f"pools.{p}.{f}" for p in ("prefill", "decode") for f in ("busy_fraction", "replicas", "chip")]
    expected += ["router.policy", "router.prefix_hit_rate", "router.groups", "plan"]
    expected += [f"startup.phases_s.{k}" for k in ("driver_process", "ray_start", "model_load", "generation")]
    expected += ["startup.first_token_s", "startup.to_first_token_s"]
    assert sorted(parsed.values) == sorted(expected)
    for key, text in parsed.values.items():
        assert same(text, lookup(report, key)), (key, text)
    # floats are written exactly, not rounded
    assert parsed.values["tokens_per_s"] == "3665.855072463768"
    assert parsed.values["cost.usd_total"] == "0.019645833333333335"
    # computed values are marked as such
    assert math.isclose(float(parsed.derived["prefill_saved_fraction"]), 1 - 20411 / 61234)


def test_html_is_self_contained_with_embedded_png(rendered):
    _, html_path, png_path = rendered
    parsed = parse(html_path)
    assert parsed.external == []
    assert len(parsed.images) == 1 and parsed.images[0].startswith("data:image/png;base64,")
    embedded = base64.b64decode(parsed.images[0].split(",", 1)[1])
    with open(png_path, "rb") as f:
        png = f.read()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert embedded == png


def test_png_is_a_valid_png_with_a_2x2_size(rendered):
    import struct

    _, _, png_path = rendered
    data = open(png_path, "rb").read()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 800 and height > 600
    assert data.endswith(b"IEND\xaeB`\x82")


def test_strings_are_escaped(tmp_path):
    report = full_report()
    report["pools"]["<script>alert(1)</script>"] = {"busy_fraction": 0.1, "replicas": 1, "chip": "a&b\"<i>"}
    report["router"]["note"] = "<b>bold</b>"
    report["plan"] = "<img src=x onerror=alert(1)>"
    report["job"] = "</title><script>x()</script>"
    html_path, _ = render_report(report, tmp_path)
    text = open(html_path, encoding="utf-8").read()
    assert "<script>" not in text and "<b>bold" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    parsed = parse(html_path)
    assert parsed.values["pools.<script>alert(1)</script>.chip"] == 'a&b"<i>'
    assert parsed.values["router.note"] == "<b>bold</b>"
    assert parsed.values["plan"] == "<img src=x onerror=alert(1)>"


def test_tolerates_missing_optional_keys(tmp_path):
    report = {"docs_total": 3, "docs_ok": 3, "tokens_per_s": 12.5, "timeline": [], "pools": {}}
    html_path, png_path = render_report(report, tmp_path / "sparse")
    parsed = parse(html_path)
    assert parsed.values == {"docs_total": "3", "docs_ok": "3", "tokens_per_s": "12.5"}
    assert open(png_path, "rb").read(8) == PNG_MAGIC
    html_path, png_path = render_report({}, tmp_path / "empty")
    assert parse(html_path).values == {}
    assert open(png_path, "rb").read(8) == PNG_MAGIC


def test_prebinned_histograms_and_odd_timelines(tmp_path):
    report = full_report()
    report["prompt_token_hist"] = {"edges": [0, 1024, 2048, 4096], "counts": [3, 5, 1]}
    report["timeline"] = [{"t": 0, "tokens_done": 0}, {"t": 0, "tokens_done": 5}, {"t": 2, "tokens_done": 100}, {"x": 1}]
    _, png_path = render_report(report, tmp_path)
    assert open(png_path, "rb").read(8) == PNG_MAGIC


def test_fsspec_url_output():
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        html_path, png_path = render_report(full_report(), "memory://reports/run1")
        assert (html_path, png_path) == ("memory://reports/run1/_report.html", "memory://reports/run1/_report.png")
        with fsspec.open(png_path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        with fsspec.open(html_path, "rt", encoding="utf-8") as f:
            assert 'data-key="tokens_per_s"' in f.read()
    finally:
        if fs.exists("/reports"):
            fs.rm("/reports", recursive=True)


def test_rejects_non_mapping(tmp_path):
    with pytest.raises(TypeError, match="report must be a mapping"):
        render_report([1, 2], tmp_path)


def test_throughput_is_binned_by_generation_time_with_a_startup_band():
    from dlbatch.report.html import _startup_span, generation_rates

    report = full_report()
    xs, pre, dec = generation_rates(report["generation"])
    assert xs[12] == 12.0 and pre[12] == 3000.0 and dec[13] == 120.0 and len(xs) == 17
    assert _startup_span(report) == (-1.25, 12.0)  # from the driver process's start to the first token
    assert generation_rates({"bin_s": 0}) == ([], [], [])


def test_old_reports_without_generation_still_render(tmp_path):
    report = full_report()
    del report["generation"], report["startup"]
    html_path, png_path = render_report(report, tmp_path)
    assert open(png_path, "rb").read(8) == PNG_MAGIC
