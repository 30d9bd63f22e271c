"""When the work happened: tokens by generation time, and the start-up before the first token.

`GenerationTimeline` bins each finished request by when its worker generated it, not by
when the driver committed it (a small job commits everything at the end, which made a
commit-time plot one spike). Prefill tokens (prompt tokens computed, i.e. not served from
the prefix cache) are spread evenly over [first token - ttft, first token] (ttft counts from
the request's arrival in the engine, so a wait in its queue widens it); output tokens over
[first token, done]. Times are the workers' wall clocks
(``t_first_token``/``t_done`` in each result); a time the driver could not have seen yet
(after the driver received the result) or from before the run comes from a clock that
disagrees with the driver's, and the driver's receive time is used instead (both stamps
shifted alike). Bins start at ``bin_s`` and double, merging pairs, whenever the run
outgrows ``max_bins``, so the report stays small for any job length.

`StartupClock` records named intervals of the run's start-up (Ray start, model load, the
data pipeline's first batch, ...) relative to the run's start.
"""
from __future__ import annotations

import time

SKEW_TOLERANCE_S = 0.5


class GenerationTimeline:
    def __init__(self, t0: float, bin_s: float = 0.5, max_bins: int = 240):
        self.t0 = t0
        self.bin_s = bin_s
        self.max_bins = max_bins
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.first_token: float | None = None
        self.last_done: float | None = None
        self.requests = 0
        self.driver_clock = 0  # requests timed by the driver's receive time (worker clock unusable)

    # ------------------------------------------------------------------------------------
    def _grow(self, t: float) -> int:
        """Bin index of time t (absolute), widening bins until it fits."""
        i = int(max(0.0, t - self.t0) / self.bin_s)
        while i >= self.max_bins:
            for arr in (self.prefill, self.decode):
                merged = [sum(arr[j:j + 2]) for j in range(0, len(arr), 2)]
                arr[:] = merged
            self.bin_s *= 2
            i = int(max(0.0, t - self.t0) / self.bin_s)
        for arr in (self.prefill, self.decode):
            if len(arr) <= i:
                arr.extend([0.0] * (i + 1 - len(arr)))
        return i

    def _spread(self, arr_name: str, t_a: float, t_b: float, tokens: float) -> None:
        if tokens <= 0:
            return
        ib = self._grow(t_b)  # grow first: bin_s is final for this call
        ia = int(max(0.0, t_a - self.t0) / self.bin_s)
        arr = getattr(self, arr_name)
        if ia >= ib or t_b <= t_a:
            arr[ib] += tokens
            return
        span = t_b - t_a
        for i in range(ia, ib + 1):
            lo = max(t_a, self.t0 + i * self.bin_s)
            hi = min(t_b, self.t0 + (i + 1) * self.bin_s)
            if hi > lo:
                arr[i] += tokens * (hi - lo) / span

    def times(self, res: dict, received: float) -> tuple[float, float]:
        """(first token, done) wall times of a result, on the driver's clock."""
        t_done, t_ft = res.get("t_done"), res.get("t_first_token")
        if t_done is None or not (self.t0 - SKEW_TOLERANCE_S <= t_done <= received + SKEW_TOLERANCE_S):
            self.driver_clock += 1
            shift = received - t_done if t_done is not None else 0.0
            t_done = received
            t_ft = t_ft + shift if t_ft is not None else None
        if t_ft is None or t_ft > t_done or t_ft < self.t0 - SKEW_TOLERANCE_S:
            lat, ttft = res.get("latency_s"), res.get("ttft_s")
            t_ft = t_done - (lat - ttft) if lat is not None and ttft is not None else t_done
        return max(self.t0, t_ft), max(self.t0, t_done)

    def add(self, res: dict, received: float | None = None) -> None:
        """One finished request (a worker's result dict), received by the driver at `received`."""
        received = time.time() if received is None else received
        t_ft, t_done = self.times(res, received)
        prompt = res.get("prompt_tokens") or 0
        ttft = res.get("ttft_s") if isinstance(res.get("ttft_s"), (int, float)) else 0.0
        self._spread("prefill", max(self.t0, t_ft - ttft), t_ft, max(0, prompt - (res.get("cached_tokens") or 0)))
        self._spread("decode", t_ft, t_done, res.get("output_tokens") or 0)
        self.first_token = t_ft if self.first_token is None else min(self.first_token, t_ft)
        self.last_done = t_done if self.last_done is None else max(self.last_done, t_done)
        self.requests += 1

    def to_dict(self) -> dict:
        rel = (lambda t: None if t is None else round(t - self.t0, 3))
        return {"bin_s": self.bin_s, "prefill_tokens": [round(x, 2) for x in self.prefill],
                "decode_tokens": [round(x, 2) for x in self.decode], "first_token_s": rel(self.first_token),
                "last_done_s": rel(self.last_done), "requests": self.requests,
                "driver_clock_requests": self.driver_clock}


class StartupClock:
    """Named [start, end] intervals in seconds from the run's start (t0)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.intervals: dict[str, list[float]] = {}
        self._open: dict[str, float] = {}

    def start(self, name: str, at: float | None = None) -> None:
        self._open[name] = time.time() if at is None else at

    def end(self, name: str, at: float | None = None) -> None:
        begun = self._open.pop(name, None)
        if begun is not None:
            self.span(name, begun, time.time() if at is None else at)

    def span(self, name: str, begun: float, ended: float) -> None:
        self.intervals[name] = [round(begun - self.t0, 3), round(ended - self.t0, 3)]

    def to_dict(self, first_token: float | None) -> dict:
        phases = {k: round(b - a, 3) for k, (a, b) in self.intervals.items()}
        ft = None if first_token is None else round(first_token - self.t0, 3)
        before = -min([a for a, _ in self.intervals.values()] + [0.0])
        return {"intervals_s": self.intervals, "phases_s": phases, "first_token_s": ft,
                "to_first_token_s": None if ft is None else round(ft + before, 3)}
