"""Tokens binned by when the workers generated them, not when the driver committed them."""
from __future__ import annotations

import pytest

from dlbatch.report.timeline import GenerationTimeline, StartupClock

T0 = 1_000_000.0


def result(t_first, t_done, prompt=1000, cached=0, out=50, ttft=0.0):
    return {"request_id": "x", "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out,
            "t_first_token": T0 + t_first, "t_done": T0 + t_done, "ttft_s": ttft, "latency_s": t_done - t_first + ttft}


def test_requests_received_together_land_in_the_bins_of_their_generation_time():
    g = GenerationTimeline(T0, bin_s=1.0)
    received = T0 + 30.0  # all three committed at the end, as a small job does
    g.add(result(10.2, 10.8, prompt=1000, cached=0, out=6), received)
    g.add(result(20.5, 20.9, prompt=1000, cached=800, out=4), received)
    g.add(result(25.0, 29.0, prompt=500, cached=0, out=40), received)
    d = g.to_dict()
    pre, dec = d["prefill_tokens"], d["decode_tokens"]
    assert pre[10] == 1000 and pre[20] == 200 and pre[25] == 500  # computed prefill (not cached) at the first token
    assert sum(pre) == 1700
    assert dec[10] == pytest.approx(6) and dec[20] == pytest.approx(4)
    assert dec[25:29] == pytest.approx([10, 10, 10, 10])  # spread over [first token, done]
    assert sum(dec) == pytest.approx(50)
    assert pre[29] == 0 and dec[29] == 0  # nothing at the commit time
    assert d["first_token_s"] == pytest.approx(10.2) and d["last_done_s"] == pytest.approx(29.0)
    assert d["requests"] == 3 and d["driver_clock_requests"] == 0


def test_prefill_is_spread_over_the_time_to_first_token():
    g = GenerationTimeline(T0, bin_s=1.0)
    g.add(result(14.0, 15.0, prompt=4000, out=1, ttft=4.0), received=T0 + 30.0)
    assert g.to_dict()["prefill_tokens"][10:14] == pytest.approx([1000, 1000, 1000, 1000])


def test_a_worker_clock_ahead_of_the_driver_falls_back_to_the_receive_time():
    g = GenerationTimeline(T0, bin_s=1.0)
    res = result(40.0, 45.0, out=10)  # the worker says 45 s, but the driver received it at 12 s
    g.add(res, received=T0 + 12.0)
    d = g.to_dict()
    assert d["driver_clock_requests"] == 1
    assert d["last_done_s"] == pytest.approx(12.0) and d["first_token_s"] == pytest.approx(7.0)
    assert d["prefill_tokens"][7] == 1000
    # no worker times at all (an older worker): the receive time, first token from ttft/latency
    g.add({"prompt_tokens": 10, "output_tokens": 3, "ttft_s": 1.0, "latency_s": 3.0}, received=T0 + 20.0)
    assert g.to_dict()["prefill_tokens"][17] == 10  # first token at 18 s, prefill over the 1 s ttft before it


def test_bins_widen_to_stay_bounded_and_keep_every_token():
    g = GenerationTimeline(T0, bin_s=0.5, max_bins=10)
    for t in range(0, 100, 7):
        g.add(result(t, t + 0.1, prompt=100, out=1), received=T0 + 200)
    d = g.to_dict()
    assert len(d["prefill_tokens"]) <= 10 and d["bin_s"] >= 10
    assert sum(d["prefill_tokens"]) == 100 * len(range(0, 100, 7))
    assert sum(d["decode_tokens"]) == pytest.approx(len(range(0, 100, 7)))


def test_startup_clock_intervals_and_time_to_first_token():
    c = StartupClock(T0)
    c.span("driver_process", T0 - 1.5, T0)
    c.start("ray_start", at=T0 + 0.5)
    c.end("ray_start", at=T0 + 5.0)
    d = c.to_dict(first_token=T0 + 20.0)
    assert d["phases_s"] == {"driver_process": 1.5, "ray_start": 4.5}
    assert d["intervals_s"]["ray_start"] == [0.5, 5.0]
    assert d["first_token_s"] == 20.0 and d["to_first_token_s"] == 21.5
