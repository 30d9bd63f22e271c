"""Job progress: documents and tokens per second over a moving window, and an ETA.

`Progress` is a plain object (no Ray, no model): the driving loop calls
``update(docs_done=..., tokens=..., remaining_tokens=...)`` once per iteration with running
totals. Rates are taken over the last ``window_s`` seconds of samples (so a long start-up
does not drag the rate down for the whole run, and a stall shows at once), and never from
before the run's first finished document: until then the engines are busy but nothing
counts, so the pipeline's fill would dilute the first rates. With one finished document
there is no interval to measure yet, so no rate. The ETA divides
the tokens still to process -- the remaining documents' prompt tokens, known at tokenize
time, plus their max_tokens -- by the token rate; before any token is done, or while the
rate is zero, there is no ETA. Output is a tqdm bar on a terminal, else one log line every
``log_every_s`` seconds carrying the same rate and ETA. The bar shows our rates only (tqdm's
own per-iteration rate would be a second, conflicting figure: it counts from the bar's
start, pipeline fill included) and keeps a width where the terminal reports none (a pty
without a window size), so it never disappears.

The clock is injectable (``clock=``) so that tests drive time by hand.
"""
from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Callable

log = logging.getLogger("dlbatch.run")


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(max(0.0, seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# tqdm's bar with our postfix as the only rate (no {rate_fmt}, no {remaining}: ours are windowed)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} docs [{elapsed}{postfix}]"
BAR_FORMAT_NO_TOTAL = "{desc}: {n_fmt} docs [{elapsed}{postfix}]"


def _columns() -> int:
    """The terminal's width, 100 where it reports none (0 columns: a pty without a window size)."""
    import shutil

    return shutil.get_terminal_size(fallback=(100, 24)).columns or 100


class Progress:
    def __init__(self, name: str, total_docs: int | None = None, initial_docs: int = 0, tty: bool | None = None,
                 window_s: float = 30.0, log_every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 stream=None):
        self.name = name
        self.total_docs = total_docs
        self.initial_docs = initial_docs
        self.window_s = window_s
        self.log_every_s = log_every_s
        self.clock = clock
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.samples: collections.deque = collections.deque()  # (t, docs_done, tokens)
        self.docs_done = initial_docs
        self.tokens = 0
        self.remaining_tokens: int | None = None
        self.remaining_docs: int | None = None
        self.last_log = clock()
        self.lines_logged = 0
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_docs, initial=initial_docs, unit="doc", desc=name, file=self.stream,
                            bar_format=BAR_FORMAT if total_docs else BAR_FORMAT_NO_TOTAL, ncols=_columns(),
                            dynamic_ncols=False)

    # ------------------------------------------------------------------------------------
    def update(self, docs_done: int, tokens: int, remaining_tokens: int | None = None,
               remaining_docs: int | None = None) -> None:
        """Running totals: documents finished (ok or failed, previous runs included), tokens
        processed (prompt + output), and tokens still to process (None: unknown yet)."""
        now = self.clock()
        self.docs_done, self.tokens = docs_done, tokens
        self.remaining_tokens, self.remaining_docs = remaining_tokens, remaining_docs
        if docs_done > self.initial_docs:  # rates start at the run's first finished document
            self.samples.append((now, docs_done, tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()  # keep one sample at or before the window's start
        if self.bar is not None:
            self.bar.n = docs_done
            self.bar.set_postfix_str(self.summary(), refresh=False)
            self.bar.refresh()
        elif now - self.last_log >= self.log_every_s:
            self.last_log = now
            self.lines_logged += 1
            log.info("progress: %s", self.line())

    def rates(self) -> tuple[float, float]:
        """(documents/s, tokens/s) over the moving window; (0, 0) with fewer than two samples."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        (t0, d0, k0), (t1, d1, k1) = self.samples[0], self.samples[-1]
        dt = t1 - t0
        if dt <= 0:
            return 0.0, 0.0
        return (d1 - d0) / dt, (k1 - k0) / dt

    def eta_s(self) -> float | None:
        _, tok_s = self.rates()
        if self.remaining_tokens is None:
            return None
        if self.remaining_tokens <= 0:
            return 0.0
        return self.remaining_tokens / tok_s if tok_s > 0 else None

    def summary(self) -> str:
        docs_s, tok_s = self.rates()
        return f"{docs_s:.2f} doc/s, {tok_s:.0f} tok/s, ETA {format_eta(self.eta_s())}"

    def line(self) -> str:
        total = f"/{self.total_docs}" if self.total_docs is not None else ""
        left = f", {self.remaining_tokens} tokens left" if self.remaining_tokens is not None else ""
        return f"{self.docs_done}{total} documents, {self.tokens} tokens{left}; {self.summary()}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def remaining_tokens(open_rows, unseen_docs: int, tokens_per_doc: float) -> int:
    """Tokens still to process: each open request's prompt tokens + max_tokens (known once
    it is tokenized), plus ``tokens_per_doc`` (the mean seen so far) for each document not
    tokenized yet. ``open_rows``: (prompt_tokens, max_tokens) of requests not finished."""
    return sum(p + m for p, m in open_rows) + round(max(0, unseen_docs) * tokens_per_doc)
