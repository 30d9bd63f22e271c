"""Who can reach a dlslime endpoint. DLSlime's TCP server reads and writes any address of its
process for whoever connects, so the transport listens on loopback unless the job sets
``cluster.dlslime_allow_network``, a receiver follows only handles it can reach without the
network (same loopback scope) unless the job opted in, and a job whose prefill and decode
workers sit on different nodes is refused at start without the opt-in.

The address checks run without binding anything; the tests that open real endpoints skip,
naming the reason, when dlslime cannot be imported here."""

from __future__ import annotations

import socket

import numpy as np
import pytest


from dlbatch.transfer import dlslime_transport as D
from dlbatch.transfer import payload as P
from dlbatch.transfer.choose import choose_transport, get_transport, one_node_reason
from dlbatch.transfer.errors import TransportUnavailable
from tests.helpers.fake_workers import FakeWorker, Remote
from tests.helpers.optional import dlslime_missing
from tests.helpers.jobs import PD_POOLS

FP = "llama:security"
ENV = "DLBATCH_DLSLIME_ALLOW_NETWORK"  # set by the driver on its workers from cluster.dlslime_allow_network
OFF_LOOPBACK = "192.0.2.1"  # TEST-NET-1: never this machine's address, so nothing can bind it


def _meta():
    return P.make_meta(FP, "float32", 2, 4, 2, 8)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(D, "DEFAULT_IP", "127.0.0.1")


@pytest.fixture
def live(no_env):
    reason = dlslime_missing()
    if reason:
        pytest.skip(reason)
    yield D
    D.shutdown()


def _handle(host: str, scope: str) -> D.DLSlimeHandle:
    meta = _meta()
    return D.DLSlimeHandle(meta, host, 9, 1, "elsewhere", 4096, P.buffer_layout(meta).total_size, 8192, 3, scope)


# ------------------------------------------------------------------ the sender's listen address
def test_loopback_addresses_are_loopback():
    assert D.is_loopback("127.0.0.1") and D.is_loopback("127.0.0.2") and D.is_loopback("::1")
    assert D.is_loopback("localhost")
    assert not D.is_loopback(OFF_LOOPBACK) and not D.is_loopback("10.0.0.5") and not D.is_loopback("0.0.0.0")


def test_network_address_refused_without_the_jobs_opt_in(no_env):
    with pytest.raises(ValueError, match=r"192\.0\.2\.1.*not a loopback.*cluster\.dlslime_allow_network: true"):
        D.DLSlimeTransport(ip=OFF_LOOPBACK)
    with pytest.raises(ValueError, match="cluster.dlslime_allow_network"):
        D.DLSlimeSender(_meta(), ip=OFF_LOOPBACK)  # the sender alone checks too, before anything binds


def test_dlbatch_dlslime_ip_off_loopback_fails_the_job_at_start(no_env, monkeypatch):
    monkeypatch.setattr(D, "DEFAULT_IP", OFF_LOOPBACK)  # DLBATCH_DLSLIME_IP=192.0.2.1
    with pytest.raises(ValueError, match=r"kv_transport='dlslime' cannot run here.*DLBATCH_DLSLIME_IP.*"
                                         r"cluster\.dlslime_allow_network"):
        choose_transport("dlslime", "cpu", "cpu")
    with pytest.raises(ValueError, match="cluster.dlslime_allow_network"):
        get_transport("dlslime")


def test_opt_in_lets_a_network_address_through(no_env, monkeypatch):
    reason = dlslime_missing()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(D, "DEFAULT_IP", OFF_LOOPBACK)
    assert choose_transport("dlslime", "cpu", "cpu", dlslime_allow_network=True) == ("dlslime", "asked for by the job")
    assert D.DLSlimeTransport(ip=OFF_LOOPBACK, allow_network=True).allow_network
    monkeypatch.setenv(ENV, "1")  # how the driver hands the job's opt-in to its workers
    assert get_transport("dlslime").allow_network
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(ValueError, match="cluster.dlslime_allow_network"):
        get_transport("dlslime")


def test_loopback_endpoint_by_default(live):
    s = D.DLSlimeTransport().open_sender(_meta())
    try:
        h = s.handle
        assert h.host == "127.0.0.1" and h.scope == D.loopback_scope()
        with pytest.raises(OSError):  # nothing listens on another address of this machine for it
            socket.create_connection((_own_network_address() or pytest.skip("no non-loopback address here"),
                                      h.port), timeout=2).close()
    finally:
        s.abort()


def _own_network_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            ip = u.getsockname()[0]
    except OSError:
        return None
    return None if D.is_loopback(ip) else ip


# ------------------------------------------------------------------ the receiver's side
def test_receiver_refuses_a_network_handle_without_opt_in_before_connecting(live, monkeypatch):
    calls = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(OSError()))
    with pytest.raises(TransportUnavailable, match=r"192\.0\.2\.1.*network address.*cluster\.dlslime_allow_network"):
        D.DLSlimeReceiver(_handle(OFF_LOOPBACK, ""))
    assert calls == []


def test_receiver_refuses_a_loopback_handle_of_another_node(live, monkeypatch):
    calls = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(OSError()))
    other = "another-boot-id/net:[4026531840]"
    assert other != D.loopback_scope()
    with pytest.raises(TransportUnavailable, match=r"loopback of another node.*cluster\.dlslime_allow_network"):
        D.DLSlimeReceiver(_handle("127.0.0.1", other), allow_network=True)  # opt-in or not: loopback is local
    assert calls == []  # the same port here could be another process's endpoint: never touched


def test_transfer_within_one_loopback_scope_still_works(live):
    meta = _meta()
    layers = [np.full(meta.layer_shape, i, dtype=np.float32) for i in range(meta.num_layers)]
    tr = D.DLSlimeTransport()
    s = tr.open_sender(meta)
    for i, a in enumerate(layers):
        s.send_layer(i, a)
    r = tr.open_receiver(s.close())
    got = [a.copy() for _, a in r.receive_layers(timeout=10)]
    r.release()
    s.wait_received(10)
    assert all(np.array_equal(a, b) for a, b in zip(got, layers))


# ------------------------------------------------------------------ placement of the job's workers

def _pools(workers, overrides=()):
    from dlbatch.driver.config import RunConfig
    from dlbatch.workers.pools import WorkerPools
    from dlbatch.jobspec import load_job

    spec = load_job("jobs/papers_jsonl.yaml", ["cluster.kv_transport=dlslime", *PD_POOLS, *overrides])
    p = WorkerPools(RunConfig.resolve(spec))
    p.kv_via, p.workers = "dlslime", workers
    return p


def test_one_node_reason():
    assert "cluster.dlslime_allow_network" in one_node_reason("dlslime")
    assert one_node_reason("dlslime", dlslime_allow_network=True) is None
    assert one_node_reason("shm", dlslime_allow_network=True) is not None
    assert one_node_reason("object_store") is None and one_node_reason("rdt") is None


def test_dlslime_pools_across_nodes_fail_at_start_without_opt_in(monkeypatch):
    import ray

    from dlbatch.workers.pools import JobFailed

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    split = {"prefill": [FakeWorker("aaaa")], "decode": [FakeWorker("bbbb")]}
    with pytest.raises(JobFailed, match=r"kv_transport='dlslime' needs every prefill and decode worker on one node.*"
                                        r"2 nodes.*cluster\.dlslime_allow_network: true"):
        _pools(split)._check_shm_same_node()
    _pools({"prefill": [FakeWorker("aaaa")], "decode": [FakeWorker("aaaa")]})._check_shm_same_node()
    _pools(split, ["cluster.dlslime_allow_network=true"])._check_shm_same_node()  # opted in: across nodes


def test_cluster_spec_opt_in_defaults_off():
    from dlbatch.jobspec import load_job

    assert load_job("jobs/papers_jsonl.yaml").cluster.dlslime_allow_network is False
    spec = load_job("jobs/papers_jsonl.yaml", ["cluster.dlslime_allow_network=true"])
    assert spec.cluster.dlslime_allow_network is True


@pytest.mark.parametrize("opt_in", [False, True])
def test_workers_get_the_jobs_opt_in_not_the_drivers_env(monkeypatch, opt_in):
    """The driver's own DLBATCH_DLSLIME_ALLOW_NETWORK never reaches the workers: the job decides."""
    from dlbatch.workers import pools as pools_mod
    from dlbatch.workers import session
    from dlbatch.workers import actors as workers
    from dlbatch.engine import loader
    from dlbatch.report.timeline import StartupClock

    monkeypatch.setenv(ENV, "1")
    made = []

    class _Cls:
        def options(self, **opts):
            made.append(opts)
            return Remote(lambda spec: object())

    p = _pools({}, ["cluster.dlslime_allow_network=true"] if opt_in else [])  # the run's config: reads the model
    monkeypatch.setattr(session, "start_ray", lambda address, chips: False)
    monkeypatch.setattr(loader, "model_dir", lambda ref: None)
    monkeypatch.setattr(workers, "make_worker_class", lambda role, tensor_transport=False: _Cls())
    monkeypatch.setattr(pools_mod.WorkerPools, "_wait_for_resources", lambda self, since: None)
    monkeypatch.setattr(pools_mod.WorkerPools, "_place_by_chip", lambda self, chips: True)  # no Ray to ask
    p.kv_via = "object_store"
    monkeypatch.setattr(pools_mod.WorkerPools, "_choose_transport", lambda self, probe: ("dlslime", "job"))
    p.start(StartupClock(0.0))
    envs = [o["runtime_env"]["env_vars"] for o in made]
    assert len(envs) == 2 and all(e[ENV] == ("1" if opt_in else "0") for e in envs)
