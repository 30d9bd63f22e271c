"""The prefill/decode half of the backend contract (`DisaggregatedBackend`), on our engine
without Ray: a request its first token ends on the prefill worker gets its row from the
backend (`first_token_result`), the same row a colocated worker gives it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

TIMES = ("ttft_s", "latency_s", "t_first_token", "t_done", "cached_tokens")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("llama"))
    make_tiny_model("llama", path)
    return path


def _spec(path, via="rdt"):
    from dlbatch.engine.config import EngineConfig

    return SimpleNamespace(model=path, engine=EngineConfig(dtype="float32", max_model_len=256), chat=False,
                           storage_options=None, kv_transport=via, kv_timeout_s=30)


def _run(be, kind, item):
    key = be.add(kind, item)
    done = {}
    while be.has_unfinished():
        done.update(be.step())
    return done[key]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_request_ended_by_its_first_token_is_the_colocated_row(tiny, logprobs):
    from dlbatch.backends import DisaggregatedBackend
    from dlbatch.backends.native import NativeBackend

    item = {"request_id": "r", "token_ids": list(range(5, 40)), "max_tokens": 1, "ignore_eos": True,
            **({"logprobs": logprobs} if logprobs is not None else {})}
    prefill = NativeBackend(_spec(tiny), "prefill", "cpu")
    assert isinstance(prefill, DisaggregatedBackend)
    handle = _run(prefill, "prefill", item)
    assert handle["finish_reason"] == "length"  # its one-token budget: nothing left to decode, no KV kept
    decode = NativeBackend(_spec(tiny), "decode", "cpu")
    row = decode.first_token_result(handle, item)
    ours = _run(NativeBackend(_spec(tiny), "colocated", "cpu"), "generate", item)
    assert set(row) == set(ours) and ("logprobs" in row) == (logprobs is not None)
    assert {k: v for k, v in row.items() if k not in TIMES} == {k: v for k, v in ours.items() if k not in TIMES}
    assert row["t_done"] == handle["t_first_token"] and row["latency_s"] == handle["ttft_s"]
    assert prefill.rdt_export([handle]) == {}  # nothing was kept for a pull
