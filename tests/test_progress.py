"""Progress: moving-window rates, ETA from the tokens left, a log line every 30 s off a TTY."""
from __future__ import annotations

import io
import logging

import pytest

from dlbatch.report.progress import Progress, format_eta, remaining_tokens


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_rates_use_a_moving_window_not_the_whole_run():
    clock = Clock()
    p = Progress("job", total_docs=100, tty=False, window_s=30, clock=clock, stream=io.StringIO())
    p.update(docs_done=0, tokens=0, remaining_tokens=None)
    clock.t += 120  # a long start-up with nothing done
    p.update(docs_done=0, tokens=0, remaining_tokens=50_000)
    for _ in range(30):  # then 2 docs/s and 500 tokens/s for 30 s
        clock.t += 1
        p.update(docs_done=p.docs_done + 2, tokens=p.tokens + 500, remaining_tokens=50_000 - p.tokens - 500)
    docs_s, tok_s = p.rates()
    assert docs_s == pytest.approx(2.0)
    assert tok_s == pytest.approx(500.0)
    # the ETA is the tokens left at the window's token rate
    assert p.eta_s() == pytest.approx((50_000 - 15_000) / 500.0)


def test_pipeline_fill_before_the_first_finished_document_does_not_dilute_the_rate():
    """Documents are in flight for a minute before the first one finishes (the engines are
    busy, nothing counts yet); then one finishes every 2 s, 3000 tokens each. The rate is
    the steady one, and there is no ETA from a single finished document."""
    clock = Clock()
    p = Progress("job", total_docs=100, tty=False, window_s=30, clock=clock, stream=io.StringIO())
    for _ in range(60):
        clock.t += 1
        p.update(docs_done=0, tokens=0, remaining_tokens=300_000)
    clock.t += 1
    p.update(docs_done=1, tokens=3000, remaining_tokens=297_000)
    assert p.eta_s() is None and "ETA ?" in p.summary()  # was 297000 / 100 tok/s: 49 minutes
    for i in range(2, 7):
        clock.t += 2
        p.update(docs_done=i, tokens=3000 * i, remaining_tokens=300_000 - 3000 * i)
    assert p.rates()[1] == pytest.approx(1500.0)  # was 600: the fill still in the window
    assert p.eta_s() == pytest.approx((300_000 - 18_000) / 1500.0)


def test_rate_falls_to_zero_when_work_stops_and_there_is_no_eta():
    clock = Clock()
    p = Progress("job", tty=False, window_s=10, clock=clock, stream=io.StringIO())
    for i in range(5):
        clock.t += 1
        p.update(docs_done=i, tokens=100 * i, remaining_tokens=1000)
    assert p.rates()[1] > 0
    for _ in range(20):  # a stall longer than the window
        clock.t += 1
        p.update(docs_done=4, tokens=400, remaining_tokens=1000)
    assert p.rates() == (0.0, 0.0)
    assert p.eta_s() is None and "ETA ?" in p.summary()


def test_eta_appears_in_non_tty_log_lines_every_30_s(caplog):
    clock = Clock()
    p = Progress("papers", total_docs=10, tty=False, clock=clock, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="dlbatch.run"):
        for i in range(1, 61):  # one update a second for a minute, 100 tokens/s, 6000 left at the end
            clock.t += 1
            p.update(docs_done=i // 10, tokens=100 * i, remaining_tokens=12_000 - 100 * i)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert len(lines) == 2, lines  # at 30 s and at 60 s, not on every update
    assert "100 tok/s" in lines[-1] and "6/10 documents" in lines[-1]
    assert "ETA 1:00" in lines[-1], lines[-1]  # 6000 tokens left at 100 tokens/s
    assert p.lines_logged == 2


def test_tty_uses_a_bar_and_logs_nothing(caplog):
    clock = Clock()
    out = io.StringIO()
    p = Progress("papers", total_docs=4, tty=True, clock=clock, stream=out)
    with caplog.at_level(logging.INFO, logger="dlbatch.run"):
        for i in range(1, 5):
            clock.t += 40
            p.update(docs_done=i, tokens=1000 * i, remaining_tokens=1000 * (4 - i) + 10)
    p.close()
    assert not [r for r in caplog.records if r.getMessage().startswith("progress:")]
    text = out.getvalue()
    assert "4/4" in text and "tok/s" in text and "ETA" in text


def test_the_bar_shows_one_rate_and_keeps_a_width_without_a_window_size(monkeypatch):
    """tqdm's own rate ("43.48s/doc") beside ours ("0.00 doc/s") were two conflicting figures;
    a terminal that reports 0 columns made the bar vanish."""
    import os
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(80, 24): os.terminal_size((0, 0)))
    clock = Clock()
    out = io.StringIO()
    p = Progress("papers", total_docs=4, tty=True, clock=clock, stream=out)
    for i in range(1, 4):
        clock.t += 40
        p.update(docs_done=i, tokens=1000 * i, remaining_tokens=1000 * (4 - i))
    p.close()
    last = [x for x in out.getvalue().replace("\r", "\n").splitlines() if x.strip()][-1]
    assert "3/4 docs" in last and "|" in last, last  # the bar is drawn
    assert last.count("doc/s") == 1 and "s/doc" not in last and "it/s" not in last, last
    assert "0.03 doc/s" in last and "ETA" in last, last


def test_remaining_tokens_counts_open_requests_and_extrapolates_unseen_documents():
    # two open requests exactly, plus 3 documents not tokenized yet at 1000 tokens each
    assert remaining_tokens([(700, 128), (700, 32)], unseen_docs=3, tokens_per_doc=1000.0) == 700 + 128 + 700 + 32 + 3000
    assert remaining_tokens([], unseen_docs=0, tokens_per_doc=1000.0) == 0


def test_format_eta():
    assert format_eta(None) == "?"
    assert format_eta(59.6) == "1:00"
    assert format_eta(3725) == "1:02:05"
