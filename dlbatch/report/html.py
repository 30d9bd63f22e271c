"""The run report as a picture and a self-contained HTML page.

``render_report(report, out_dir)`` writes two files next to a job's output:

* ``_report.png``: a 2x2 figure: throughput over time, per-pool utilisation,
  prompt-token and output-token histograms. Throughput is binned by the time the
  workers generated the tokens (the report's ``generation`` section: prefill and
  decode tokens per bin, stacked), with the start-up before the first token (Ray
  start, model load, ...; the ``startup`` section) as a grey band; reports
  without a ``generation`` section fall back to the commit-time ``timeline``;
* ``_report.html``: one file with no external resources (the PNG is embedded
  as a base64 data URI) and tables of the headline numbers, cost, pools and
  router statistics. Each value from the report sits in an element with a
  ``data-key`` attribute holding its key path (``tokens_per_s``,
  ``cost.usd_total``, ``pools.prefill.busy_fraction``, ``router.hits``) and
  its exact value as text (floats as ``repr``), so the page can be checked
  against the JSON it came from. Values computed here, not present in the
  report, carry ``data-derived`` instead.

Missing optional keys are skipped (their row or panel says so); every string
is HTML-escaped. ``out_dir`` is a local path or an fsspec URL.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from typing import Any, Mapping, Optional, Sequence

__all__ = ["render_report", "HEADLINE_KEYS", "COST_KEYS", "REPORT_PNG", "REPORT_HTML"]

REPORT_PNG = "_report.png"
REPORT_HTML = "_report.html"

HEADLINE_KEYS: tuple[tuple[str, str], ...] = (
    ("docs_total", "documents"),
    ("docs_ok", "documents ok"),
    ("docs_failed", "documents failed"),
    ("rows_written", "rows written"),
    ("prompt_tokens", "prompt tokens"),
    ("prefill_tokens_computed", "prefill tokens computed"),
    ("output_tokens", "output tokens"),
    ("wall_s", "wall time (s)"),
    ("docs_per_s", "documents / s"),
    ("tokens_per_s", "tokens / s"),
    ("retries", "retries"),
)
COST_KEYS: tuple[tuple[str, str], ...] = (
    ("usd_per_hour", "USD / hour"),
    ("usd_total", "USD total"),
    ("usd_per_million_tokens", "USD / million tokens"),
)


# --------------------------------------------------------------------------- helpers


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _exact(v: Any) -> str:
    """The value as text that parses back to the same value."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def _pretty(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.1f}"
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return _exact(v)


def _cell(key: str, value: Any, derived: bool = False) -> str:
    attr = "data-derived" if derived else "data-key"
    pretty = _pretty(value)
    exact = _exact(value)
    title = f' title="{html.escape(pretty)}"' if pretty != exact else ""
    return f'<td {attr}="{html.escape(key)}"{title}>{html.escape(exact)}</td>'


def _row(label: str, key: str, value: Any, derived: bool = False) -> str:
    return f"<tr><th>{html.escape(label)}</th>{_cell(key, value, derived)}</tr>"


def _join(base: str, name: str) -> str:
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def _throughput(timeline: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    points = []
    for p in timeline or ():
        if isinstance(p, Mapping) and _is_number(p.get("t")) and _is_number(p.get("tokens_done")):
            points.append((float(p["t"]), float(p["tokens_done"])))
    points.sort()
    xs, ys = [], []
    for (t0, k0), (t1, k1) in zip(points, points[1:]):
        if t1 > t0:
            xs.append(t1)
            ys.append((k1 - k0) / (t1 - t0))
    return xs, ys


def generation_rates(gen: Mapping[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """(bin start times, prefill tokens/s, decode tokens/s) of a report's ``generation``
    section; empty lists when it is missing or malformed."""
    if not isinstance(gen, Mapping) or not _is_number(gen.get("bin_s")) or gen["bin_s"] <= 0:
        return [], [], []
    pre = [float(v) if _is_number(v) else 0.0 for v in gen.get("prefill_tokens") or ()]
    dec = [float(v) if _is_number(v) else 0.0 for v in gen.get("decode_tokens") or ()]
    n = max(len(pre), len(dec))
    pre += [0.0] * (n - len(pre))
    dec += [0.0] * (n - len(dec))
    b = float(gen["bin_s"])
    return [i * b for i in range(n)], [v / b for v in pre], [v / b for v in dec]


def _startup_span(report: Mapping[str, Any]) -> tuple[float, float] | None:
    """(start, first token) in seconds from the run's start: the band before any token."""
    st = report.get("startup")
    if not isinstance(st, Mapping) or not _is_number(st.get("first_token_s")):
        return None
    starts = [iv[0] for iv in (st.get("intervals_s") or {}).values()
              if isinstance(iv, (list, tuple)) and iv and _is_number(iv[0])]
    return min(starts + [0.0]), float(st["first_token_s"])


def _throughput_panel(ax, report: Mapping[str, Any]) -> None:
    ax.set_title("throughput (by generation time)")
    xs, pre, dec = generation_rates(report.get("generation"))
    span = _startup_span(report)
    if span is not None:
        ax.axvspan(span[0], span[1], color="0.85", zorder=0,
                   label=f"start-up {span[1] - span[0]:.1f} s (Ray, model load, first batch)")
    if xs and (any(pre) or any(dec)):
        b = float(report["generation"]["bin_s"])
        ax.bar(xs, pre, width=b, align="edge", color="tab:orange", label="prefill tokens/s")
        ax.bar(xs, dec, width=b, align="edge", bottom=pre, color="tab:blue", label="decode tokens/s")
        ax.set_ylim(bottom=0)
    else:
        ax.set_title("throughput (by commit time)")
        txs, tys = _throughput(report.get("timeline") or [])
        if txs:
            ax.step(txs, tys, where="pre", color="tab:blue")
            ax.fill_between(txs, tys, step="pre", alpha=0.25, color="tab:blue")
            ax.set_ylim(bottom=0)
        elif span is None:
            ax.text(0.5, 0.5, "no timeline", ha="center", va="center", transform=ax.transAxes)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize="small")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("tokens / s")


def _hist_panel(ax, data: Any, title: str, color: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("requests")
    if isinstance(data, Mapping) and "edges" in data and "counts" in data:
        edges, counts = list(data["edges"]), list(data["counts"])
        if len(edges) == len(counts) + 1 and counts:
            ax.stairs(counts, edges, fill=True, color=color)
            ax.set_xlabel("tokens")
            return
    values = [v for v in (data or ()) if _is_number(v)] if isinstance(data, (list, tuple)) else []
    if not values:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values, bins=min(30, max(1, len(set(values)))), color=color, edgecolor="white")
    ax.set_xlabel("tokens")


def _figure_png(report: Mapping[str, Any]) -> bytes:
    # Agg canvas used directly: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)

    _throughput_panel(axes[0][0], report)

    ax = axes[0][1]
    ax.set_title("pool utilisation")
    pools = report.get("pools") or {}
    names, busy = [], []
    if isinstance(pools, Mapping):
        for name, pool in pools.items():
            pool = pool if isinstance(pool, Mapping) else {}
            frac = pool.get("busy_fraction")
            label = str(name)
            extra = [str(pool[k]) for k in ("chip",) if pool.get(k) is not None]
            if _is_number(pool.get("replicas")):
                extra.append(f"x{pool['replicas']}")
            if extra:
                label += "\n" + " ".join(extra)
            names.append(label)
            busy.append(100.0 * float(frac) if _is_number(frac) else 0.0)
    if names:
        bars = ax.bar(range(len(names)), busy, color="tab:green")
        ax.set_xticks(range(len(names)), names)
        ax.bar_label(bars, fmt="%.0f%%")
        ax.set_ylim(0, 105)
    else:
        ax.text(0.5, 0.5, "no pools", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("busy (%)")

    _hist_panel(axes[1][0], report.get("prompt_token_hist"), "prompt tokens per request", "tab:orange")
    _hist_panel(axes[1][1], report.get("output_token_hist"), "output tokens per request", "tab:purple")

    # fixed margins: tight_layout costs an extra full draw on every call
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.95, wspace=0.22, hspace=0.38)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:0 2em 1.5em 0;display:inline-table;vertical-align:top}
th,td{border:1px solid #ccc;padding:4px 10px;text-align:left}
td{font-variant-numeric:tabular-nums;text-align:right}
caption{font-weight:bold;text-align:left;padding:4px 0}
img{max-width:100%;border:1px solid #eee}
pre{background:#f6f6f6;padding:1em;overflow:auto}
"""


def _html_page(report: Mapping[str, Any], png: bytes) -> str:
    title = "dlbatch run report"
    job = report.get("job") or report.get("name")
    if isinstance(job, str) and job:
        title += f": {job}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]

    rows = [_row(label, key, report[key]) for key, label in HEADLINE_KEYS if key in report]
    prompt, computed = report.get("prompt_tokens"), report.get("prefill_tokens_computed")
    if _is_number(prompt) and _is_number(computed) and prompt > 0:
        saved = 1.0 - computed / prompt
        rows.append(_row("prefill saved by prefix sharing", "prefill_saved_fraction", saved, derived=True))
    if rows:
        parts.append("<table><caption>run</caption>" + "".join(rows) + "</table>")

    cost = report.get("cost")
    if isinstance(cost, Mapping):
        rows = [_row(label, f"cost.{key}", cost[key]) for key, label in COST_KEYS if key in cost]
        rows += [_row(str(k), f"cost.{k}", v) for k, v in cost.items() if k not in dict(COST_KEYS) and not isinstance(v, (Mapping, list))]
        if rows:
            parts.append("<table><caption>cost</caption>" + "".join(rows) + "</table>")

    pools = report.get("pools")
    if isinstance(pools, Mapping) and pools:
        cols = ["chip", "replicas", "busy_fraction"]
        for pool in pools.values():
            if isinstance(pool, Mapping):
                cols += [k for k, v in pool.items() if k not in cols and not isinstance(v, (Mapping, list))]
        head = "<tr><th>pool</th>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in cols) + "</tr>"
        body = []
        for name, pool in pools.items():
            pool = pool if isinstance(pool, Mapping) else {}
            cells = []
            for c in cols:
                if c in pool:
                    cells.append(_cell(f"pools.{name}.{c}", pool[c]))
                else:
                    cells.append("<td>&mdash;</td>")
            body.append(f"<tr><th>{html.escape(str(name))}</th>{''.join(cells)}</tr>")
        parts.append("<table><caption>pools</caption>" + head + "".join(body) + "</table>")

    parts += _layout_tables(report.get("layout"))

    startup = report.get("startup")
    if isinstance(startup, Mapping) and isinstance(startup.get("phases_s"), Mapping):
        rows = [_row(str(k), f"startup.phases_s.{k}", v) for k, v in startup["phases_s"].items() if _is_number(v)]
        for key in ("first_token_s", "to_first_token_s"):
            if _is_number(startup.get(key)):
                rows.append(_row(key, f"startup.{key}", startup[key]))
        if rows:
            parts.append("<table><caption>start-up and phases (s)</caption>" + "".join(rows) + "</table>")

    router = report.get("router")
    if isinstance(router, Mapping) and router:
        rows = [_row(str(k), f"router.{k}", v) for k, v in router.items() if not isinstance(v, (Mapping, list))]
        if rows:
            parts.append("<table><caption>router</caption>" + "".join(rows) + "</table>")

    data_uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    parts.append(f'<p><img alt="throughput, utilisation and token histograms" src="{data_uri}"></p>')

    plan = report.get("plan")
    if plan is not None:
        text = plan if isinstance(plan, str) else json.dumps(plan, indent=2, sort_keys=True, default=str)
        parts.append(f'<h2>plan</h2><pre data-key="plan">{html.escape(text)}</pre>')

    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _layout_tables(layout: Any) -> list[str]:
    """The layout that ran (how it was chosen, the solver's expected figures beside the
    measured ones) and the alternatives the solver weighed."""
    if not isinstance(layout, Mapping):
        return []
    rows = [_row(k, f"layout.{k}", layout[k]) for k in ("mode", "chosen_by", "reason") if k in layout]
    for part in ("expected", "measured"):
        figures = layout.get(part)
        if isinstance(figures, Mapping):
            rows += [_row(f"{part} {k}", f"layout.{part}.{k}", v) for k, v in figures.items() if _is_number(v)]
    out = ["<table><caption>layout</caption>" + "".join(rows) + "</table>"]
    alts = [a for a in layout.get("alternatives") or () if isinstance(a, Mapping)]
    if alts:
        cols = ["mode", "docs_per_s", "tokens_per_s", "simulated_docs_per_s", "usd_per_hour", "ttft_s", "error"]
        head = "<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in ["pools", *cols]) + "</tr>"
        body = []
        for i, a in enumerate(alts):
            pools = ", ".join(f"{p.get('role')} {p.get('chip')} x{p.get('replicas')}" for p in a.get("pools") or ()
                              if isinstance(p, Mapping))
            cells = "".join(_cell(f"layout.alternatives.{i}.{c}", a[c]) if c in a else "<td>&mdash;</td>"
                            for c in cols)
            body.append(f"<tr><th>{html.escape(pools or '-')}</th>{cells}</tr>")
        out.append("<table><caption>layouts the solver weighed</caption>" + head + "".join(body) + "</table>")
    return out


def render_report(
    report: Mapping[str, Any],
    out_dir_url_or_path: str | os.PathLike,
    storage_options: Optional[Mapping[str, Any]] = None,
) -> tuple[str, str]:
    """Write ``_report.html`` and ``_report.png`` into ``out_dir``; return ``(html_path, png_path)``."""
    if not isinstance(report, Mapping):
        raise TypeError(f"report must be a mapping, got {type(report).__name__}")
    out = os.fspath(out_dir_url_or_path)
    png = _figure_png(report)
    page = _html_page(report, png)
    html_path, png_path = _join(out, REPORT_HTML), _join(out, REPORT_PNG)
    if "://" in out:
        import fsspec

        fs, root = fsspec.core.url_to_fs(out, **dict(storage_options or {}))
        fs.makedirs(root, exist_ok=True)
        with fsspec.open(png_path, "wb", **dict(storage_options or {})) as f:
            f.write(png)
        with fsspec.open(html_path, "wb", **dict(storage_options or {})) as f:
            f.write(page.encode("utf-8"))
    else:
        os.makedirs(out, exist_ok=True)
        with open(png_path, "wb") as f:
            f.write(png)
        with open(html_path, "w", encoding="utf-8") as f:
            f.write(page)
    return html_path, png_path
