"""Discrete-event simulation of a plan's pools, with the same cost models as the solver.

A batch job: every document is queued at t=0.

* **Prefill workers** (PD) pull documents from the global queue, earliest-free worker
  first (a heap of workers). A worker runs chunked prefill batches of
  ``chunk_tokens``: a document of ``P`` tokens costs ``a*P/chunk + b*P + c*Q``
  (the per-batch constant amortised over the tokens of the stream), so its KV is
  ready at its position in that worker's token stream.
* **KV transfer**: each ready document goes to the decode worker with the least
  expected load (documents assigned / worker capacity); the bytes cross the prefill
  worker's egress link and the decode worker's ingress link, both FIFO, at
  ``min(bw_p, bw_d)``: ``time = bytes / bw``.
* **Decode workers** run continuous batching: a document is admitted (its K sequences,
  FIFO) when K slots are free and its reserved KV (``D + K*(S+O)`` tokens, shared
  prefix) fits next to the weights. Each step costs ``a + b*batch + c*sum_context``.
  The simulation is batch-level, not token-level: the worker advances in strides of
  several steps at once, up to the step where ``refill`` sequences (default 1/32 of
  the slots) have finished or the next KV arrives, with the stride's duration in
  closed form (context grows by one token per sequence per step); freed slots are
  refilled at stride ends. KV waiting for admission is held off the decoder (on the
  prefill side / host memory): no backpressure on prefill is modelled.
* **Colocated workers** run the same decode loop and, whenever slots and memory are
  free and the global queue is not empty, prefill the next documents (decode stalls
  meanwhile: time-sharing, as the solver assumes).

Per-slot state is kept in numpy arrays so a stride is a handful of vector operations;
this keeps 1M documents over 1,000 chips within a minute on two cores.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, asdict
from typing import Any

import numpy as np

from dlbatch.solver.capacity import role_rates
from dlbatch.solver.milp import Plan
from dlbatch.solver.profile import ChipProfile, ModelSpec
from dlbatch.solver.workload import Workload


@dataclass
class PoolStats:
    chip: str
    role: str
    replicas: int
    docs: int
    busy_fraction: float          # time working / makespan, averaged over the pool's workers
    slot_occupancy: float         # decode slots in use / slots, over busy steps (decode/colocated)
    mean_queue_len: float         # time-averaged documents waiting at a worker (decode: KV waiting)
    max_queue_len: int
    mean_wait_s: float
    max_wait_s: float


@dataclass
class SimResult:
    n_docs: int
    makespan_s: float
    docs_per_s: float
    tokens_per_s: float
    steady_docs_per_s: float      # between the 10th and 90th percentile completions
    predicted_docs_per_s: float
    pools: list[PoolStats]
    prefill_mean_wait_s: float
    prefill_max_wait_s: float
    kv_transfer_mean_s: float
    wall_seconds: float
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Docs:
    """Sampled documents (vectors indexed by document id)."""

    def __init__(self, workload: Workload, model: ModelSpec, n: int, seed: int):
        rng = np.random.default_rng(seed)
        K = workload.tasks_per_doc
        D = rng.choice(np.asarray(workload.doc_tokens, dtype=np.int64), size=n)
        S = rng.choice(np.asarray(workload.suffix_tokens, dtype=np.int64), size=(n, K))
        O = rng.choice(np.asarray(workload.output_tokens, dtype=np.int64), size=(n, K))
        Df = D.astype(float)
        if workload.prefix_shared:
            self.P = Df + S.sum(1)
            self.Q = Df * Df / 2 + (S * (Df[:, None] + S / 2.0)).sum(1)
            self.reserve = Df + (S + O).sum(1)
        else:
            self.P = (Df[:, None] + S).sum(1)
            self.Q = ((Df[:, None] + S) ** 2 / 2.0).sum(1)
            self.reserve = (Df[:, None] + S + O).sum(1)
        self.ctx0 = (Df[:, None] + S).astype(float)      # (n, K) context at first decode step
        self.O = O
        self.kv_bytes = self.P * model.kv_bytes_per_token
        self.tokens = float((Df[:, None] + S).sum() + O.sum())
        self.n, self.K = n, K
        self.O_l = O.tolist()
        self.ctx0_l = self.ctx0.tolist()
        self.reserve_l = self.reserve.tolist()


class _Decoder:
    """Continuous-batching decode state of one worker (batch-level strides).

    Sequences are bucketed by the step at which they finish; a stride advances, in
    closed form per segment between finish steps, until ``refill`` sequences have
    finished (or ``until`` is reached), so the work per stride is O(finished)."""

    def __init__(self, chip: ChipProfile, slots: int, kv_cap_tokens: float, K: int, refill: int):
        self.a, self.b, self.c = chip.decode.as_tuple()
        self.slots, self.K, self.cap = slots, K, kv_cap_tokens
        self.refill = max(1, refill)
        self.s = 0                       # steps done
        self.t = 0.0
        self.n_active = 0
        self.sum_ctx = 0.0
        self.kv_used = 0.0
        self.busy = 0.0
        self.slot_steps = 0.0
        self.steps = 0
        self.keys: list[int] = []        # heap of distinct finish steps
        self.fin: dict[int, list] = {}   # finish step -> [count, ctx_sum_at_finish, [doc ids]]
        self.left: dict[int, int] = {}

    def free_docs(self) -> int:
        return (self.slots - self.n_active) // self.K

    def admit(self, ids, docs: "_Docs") -> None:
        s, fin, keys = self.s, self.fin, self.keys
        for d in ids:
            for o, c0 in zip(docs.O_l[d], docs.ctx0_l[d]):
                f = s + o
                e = fin.get(f)
                if e is None:
                    fin[f] = [1, c0 + o, [d]]
                    heapq.heappush(keys, f)
                else:
                    e[0] += 1
                    e[1] += c0 + o
                    e[2].append(d)
                self.sum_ctx += c0
            self.left[d] = self.K
            self.kv_used += docs.reserve_l[d]
        self.n_active += self.K * len(ids)

    def how_many_fit(self, reserve: list) -> int:
        """How many of the next documents (reserve = their KV tokens, in order) fit now."""
        k = min(self.free_docs(), len(reserve))
        room = self.cap - self.kv_used
        for i in range(k):
            room -= reserve[i]
            if room < 0:
                return i
        return k

    def stride(self, until: float, done_t: np.ndarray, docs: "_Docs") -> None:
        """Advance until ``refill`` sequences finish, or to the first step boundary at or
        after ``until`` (when ``until`` is later than now)."""
        a, b, c = self.a, self.b, self.c
        freed = 0
        while self.n_active > 0:
            f = self.keys[0]
            n = f - self.s
            B = self.n_active
            A0 = a + b * B + c * self.sum_ctx
            g = c * B
            if until > self.t:
                dt = until - self.t
                if g > 0:
                    h = A0 - g / 2.0
                    m = (-h + math.sqrt(h * h + 2.0 * g * dt)) / g
                else:
                    m = dt / A0
                m = max(1, int(math.ceil(m - 1e-9)))
                if m < n:
                    self._advance(m, A0, g, B)
                    return
            self._advance(n, A0, g, B)
            heapq.heappop(self.keys)
            cnt, ctx_sum, ds = self.fin.pop(f)
            self.n_active -= cnt
            self.sum_ctx -= ctx_sum
            freed += cnt
            left = self.left
            for d in ds:
                k = left[d] - 1
                if k == 0:
                    del left[d]
                    done_t[d] = self.t
                    self.kv_used -= docs.reserve_l[d]
                else:
                    left[d] = k
            if freed >= self.refill or until > 0 and self.t >= until:
                return

    def _advance(self, n: int, A0: float, g: float, B: int) -> None:
        dur = n * A0 + g * n * (n - 1) / 2.0
        self.t += dur
        self.busy += dur
        self.s += n
        self.steps += n
        self.slot_steps += B * n
        self.sum_ctx += B * n


def _group(assign: np.ndarray, k: int) -> list[np.ndarray]:
    """Document ids per worker 0..k-1 (ids < 0 are ignored), in id order."""
    order = np.argsort(assign, kind="stable")
    bounds = np.searchsorted(assign[order], np.arange(k + 1))
    return [order[bounds[i]: bounds[i + 1]] for i in range(k)]


def _queue_stats(arrive: np.ndarray, admit: np.ndarray, horizon: float) -> tuple[float, int, float, float]:
    if len(arrive) == 0:
        return 0.0, 0, 0.0, 0.0
    wait = admit - arrive
    times = np.concatenate([arrive, admit])
    delta = np.concatenate([np.ones(len(arrive)), -np.ones(len(admit))])
    order = np.lexsort((delta, times))          # admissions before arrivals at equal times
    qmax = int(np.cumsum(delta[order]).max())
    return float(wait.sum() / horizon) if horizon > 0 else 0.0, qmax, float(wait.mean()), float(wait.max())


def _check_args(plan: Plan, chips: dict[str, ChipProfile], n, refill_frac: float) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n_docs must be an integer >= 1, got {n!r}")
    if not (0 < refill_frac <= 1):
        raise ValueError(f"refill_frac must be in (0, 1], got {refill_frac!r}")
    for p in plan.pools:
        if p.chip not in chips:
            raise ValueError(f"plan uses chip {p.chip!r} but no profile was given; have {sorted(chips)}")
    if not plan.pools:
        raise ValueError("plan has no pools")


@dataclass
class _Workers:
    """The plan's workers by role, one ``(chip, pool)`` entry per replica. A worker's id is
    its index in its role's list (prefill, decode and colocated ids are separate)."""
    pre: list[tuple[str, Any]]
    dec: list[tuple[str, Any]]
    col: list[tuple[str, Any]]

    @classmethod
    def of(cls, plan: Plan) -> "_Workers":
        w = cls([], [], [])
        for pool in plan.pools:
            target = {"prefill": w.pre, "decode": w.dec, "colocated": w.col}[pool.role]
            target.extend([(pool.chip, pool)] * pool.replicas)
        if w.pre and not w.dec:
            raise ValueError("plan has prefill workers but no decode workers")
        if w.dec and not w.pre:
            raise ValueError("plan has decode workers but no prefill workers")
        return w

    def groups(self) -> dict[tuple[str, str], list[int]]:
        """Worker ids per (chip, role), in report order: prefill, decode, colocated pools."""
        groups: dict[tuple[str, str], list[int]] = {}
        for role, entries in (("prefill", self.pre), ("decode", self.dec), ("colocated", self.col)):
            for idx, (c, _) in enumerate(entries):
                groups.setdefault((c, role), []).append(idx)
        return groups


def _decoder_for(chip: ChipProfile, model: ModelSpec, workload: Workload, batch: int, refill_frac: float):
    K = workload.tasks_per_doc
    slots = max(K, batch)
    cap = (chip.memory_bytes - model.weight_bytes) / model.kv_bytes_per_token
    return _Decoder(chip, slots, cap, K, int(round(slots * refill_frac)))


def _decoders(entries, chips: dict[str, ChipProfile], model: ModelSpec, workload: Workload,
              max_batch: int, chunk_tokens: int, refill_frac: float) -> list[_Decoder]:
    """One decoder per worker; its batch is the pool's ``decode_batch``, or the profile's
    (``role_rates``) when the plan does not record it."""
    out = []
    for c, pool in entries:
        if pool.decode_batch:
            batch = int(pool.decode_batch)
        else:
            batch = role_rates(chips[c], model, workload, max_batch, chunk_tokens).decode_batch
        out.append(_decoder_for(chips[c], model, workload, batch, refill_frac))
    return out


def _prefill_times(chips: dict[str, ChipProfile], names, docs: _Docs, chunk_tokens: int) -> dict[str, list]:
    """Per-document prefill seconds on each chip of ``names``: the per-batch constant is
    amortised over the worker's token stream of ``chunk_tokens`` batches."""
    tp = {}
    for chip in set(names):
        a, b, c = chips[chip].prefill.as_tuple()
        tp[chip] = (a * docs.P / chunk_tokens + b * docs.P + c * docs.Q).tolist()
    return tp


@dataclass
class _Prefilled:
    """Phase 1, indexed by document id: when its prefill started and ended and on which
    prefill worker (-1: a colocated worker, which decodes it itself); each prefill worker's
    busy time; per colocated worker, the ids it admitted and when (queued at t=0)."""
    start: np.ndarray
    done: np.ndarray
    worker: np.ndarray
    pre_busy: np.ndarray
    col_arrive: list[list[int]]
    col_admit: list[list[float]]


def _colocated_turn(dec: _Decoder, nxt: int, tp: list, start: list, done: list, docs: _Docs,
                    done_t: np.ndarray, chip: str) -> int:
    """One turn of a colocated worker: prefill and admit the next queued documents that
    fit (its decode stalls meanwhile) and return how many; else decode one stride (0)."""
    k = dec.how_many_fit(docs.reserve_l[nxt: nxt + dec.free_docs()])
    if k > 0:
        ids = range(nxt, nxt + k)
        for d in ids:
            start[d] = dec.t
            dec.t += tp[d]
            dec.busy += tp[d]
            done[d] = dec.t
        dec.admit(ids, docs)
        return k
    if dec.n_active > 0:
        dec.stride(-1.0, done_t, docs)
        return 0
    raise ValueError(f"colocated worker on {chip} cannot hold one document: "
                     f"{docs.reserve[nxt]:.0f} KV tokens vs {dec.cap:.0f} capacity")


def _pull_global_queue(workers: _Workers, tp: dict[str, list], cols: list[_Decoder], docs: _Docs,
                       done_t: np.ndarray) -> _Prefilled:
    """Phase 1: documents leave the global queue in id order, each to the earliest-free
    prefill or colocated worker (a heap of (free time, kind, id)); colocated workers are
    then drained."""
    n = docs.n
    pre_tp = [tp[c] for c, _ in workers.pre]
    col_tp = [tp[c] for c, _ in workers.col]
    start, done, worker = [0.0] * n, [0.0] * n, [-1] * n
    pre_busy = np.zeros(len(workers.pre))
    col_arrive: list[list[int]] = [[] for _ in cols]
    col_admit: list[list[float]] = [[] for _ in cols]
    heap = [(0.0, 0, i) for i in range(len(workers.pre))] + [(0.0, 1, i) for i in range(len(cols))]
    heapq.heapify(heap)
    nxt = 0
    while heap and nxt < n:
        t, kind, i = heapq.heappop(heap)
        if kind == 0:
            dt = pre_tp[i][nxt]
            start[nxt], done[nxt], worker[nxt] = t, t + dt, i
            pre_busy[i] += dt
            nxt += 1
            heapq.heappush(heap, (t + dt, 0, i))
        else:
            dec = cols[i]
            k = _colocated_turn(dec, nxt, col_tp[i], start, done, docs, done_t, workers.col[i][0])
            if k:
                col_arrive[i].extend(range(nxt, nxt + k))
                col_admit[i].extend([dec.t] * k)
                nxt += k
            heapq.heappush(heap, (dec.t, 1, i))
    for dec in cols:
        while dec.n_active > 0:
            dec.stride(-1.0, done_t, docs)
    return _Prefilled(np.asarray(start), np.asarray(done), np.asarray(worker, dtype=np.int64),
                      pre_busy, col_arrive, col_admit)


@dataclass
class _Transfers:
    """Phase 2, indexed by document id: KV arrival time at its decode worker, transfer
    seconds, decode worker (-1: prefilled on a colocated worker). ``ids``: PD documents."""
    ids: np.ndarray
    arrive: np.ndarray
    xfer: np.ndarray
    assign: np.ndarray


def _transfer_kv(pre: _Prefilled, workers: _Workers, chips: dict[str, ChipProfile], docs: _Docs) -> _Transfers:
    """Phase 2: in prefill-completion order, each document goes to the decode worker with
    the least expected load (assigned / capacity); its bytes hold the prefill worker's
    egress and the decode worker's ingress link (both FIFO) at the slower bandwidth."""
    n = docs.n
    kv = _Transfers(np.flatnonzero(pre.worker >= 0), np.zeros(n), np.zeros(n), np.full(n, -1, dtype=np.int64))
    if not len(kv.ids):
        return kv
    n_dec = len(workers.dec)
    dec_rate = np.array([p.docs_per_s_each if p.docs_per_s_each > 0 else 1.0 for _, p in workers.dec])
    order = kv.ids[np.argsort(pre.done[kv.ids], kind="stable")]
    egress = np.zeros(len(workers.pre))
    ingress = np.zeros(n_dec)
    bw_p = [chips[c].kv_link_bw for c, _ in workers.pre]
    bw_d = [chips[c].kv_link_bw for c, _ in workers.dec]
    load = [(1.0 / dec_rate[j], j) for j in range(n_dec)]
    heapq.heapify(load)
    counts = np.zeros(n_dec)
    pw, pdn, kvb = pre.worker.tolist(), pre.done.tolist(), docs.kv_bytes.tolist()
    for d in order.tolist():
        _, j = heapq.heappop(load)
        counts[j] += 1
        heapq.heappush(load, ((counts[j] + 1) / dec_rate[j], j))
        p = pw[d]
        start = max(pdn[d], egress[p], ingress[j])
        dur = kvb[d] / min(bw_p[p], bw_d[j])
        egress[p] = ingress[j] = start + dur
        kv.arrive[d] = start + dur
        kv.xfer[d] = dur
        kv.assign[d] = j
    return kv


def _decode_arrivals(dec: _Decoder, ids_a: np.ndarray, arrive: np.ndarray, docs: _Docs,
                     done_t: np.ndarray, chip: str) -> list[float]:
    """Run one decode worker on its documents ``ids_a`` (in arrival order): admit, FIFO,
    the arrived ones that fit, then stride until slots free up or the next KV arrives.
    Returns each document's admission time."""
    ids = ids_a.tolist()
    arr = arrive[ids_a].tolist()
    res = docs.reserve[ids_a].tolist()
    adm = [0.0] * len(ids)
    m, q = len(ids), 0
    while q < m or dec.n_active > 0:
        if dec.n_active == 0 and arr[q] > dec.t:
            dec.t = arr[q]
        hi = q
        lim = q + dec.free_docs()
        while hi < m and hi < lim and arr[hi] <= dec.t:
            hi += 1
        if hi > q:
            k = dec.how_many_fit(res[q:hi])
            if k > 0:
                dec.admit(ids[q: q + k], docs)
                for u in range(q, q + k):
                    adm[u] = dec.t
                q += k
        if dec.n_active == 0:
            if q < m and arr[q] <= dec.t:
                raise ValueError(f"decode worker on {chip} cannot hold one document: "
                                 f"{res[q]:.0f} KV tokens vs {dec.cap:.0f} capacity")
            continue
        until = arr[q] if (q < m and arr[q] > dec.t and dec.free_docs() > 0) else -1.0
        dec.stride(until, done_t, docs)
    return adm


def _run_decoders(decs: list[_Decoder], workers: _Workers, kv: _Transfers, docs: _Docs,
                  done_t: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Phase 3: each decode worker on its own arrivals, independently. Returns the
    document ids per decode worker and each document's admission time."""
    admit = np.zeros(docs.n)
    by_dec = _group(kv.assign, len(decs))
    for j, dec in enumerate(decs):
        if len(by_dec[j]):
            ids_a = by_dec[j][np.argsort(kv.arrive[by_dec[j]], kind="stable")]
            admit[ids_a] = _decode_arrivals(dec, ids_a, kv.arrive, docs, done_t, workers.dec[j][0])
    return by_dec, admit


def _prefill_pool(chip: str, idxs: list[int], by_pre: list[np.ndarray], pre: _Prefilled,
                  makespan: float) -> PoolStats:
    """A prefill pool: every document waits in the global queue from t=0 to its start."""
    sel = np.concatenate([by_pre[i] for i in idxs])
    wait = pre.start[sel]
    return PoolStats(chip, "prefill", len(idxs), int(sum(len(by_pre[i]) for i in idxs)),
                     float(pre.pre_busy[idxs].mean() / makespan), 0.0,
                     float(wait.sum() / makespan / len(idxs)),
                     int(max(len(by_pre[i]) for i in idxs)),
                     float(wait.mean()) if len(wait) else 0.0,
                     float(wait.max()) if len(wait) else 0.0)


def _decoder_pool(chip: str, role: str, pool_decs: list[_Decoder], queues, makespan: float) -> PoolStats:
    """A decode or colocated pool; ``queues`` holds each worker's (arrival, admission) times."""
    qlens, qmaxs, waits, wmax, ndocs = [], [], [], [], 0
    for a_t, ad_t in queues:
        ndocs += len(a_t)
        ql, qm, wm, wx = _queue_stats(a_t, ad_t, makespan)
        qlens.append(ql), qmaxs.append(qm), waits.append(wm * len(a_t)), wmax.append(wx)
    occ = [d.slot_steps / (d.slots * d.steps) for d in pool_decs if d.steps]
    return PoolStats(chip, role, len(pool_decs), ndocs,
                     float(np.mean([d.busy for d in pool_decs]) / makespan),
                     float(np.mean(occ)) if occ else 0.0,
                     float(np.mean(qlens)), int(max(qmaxs)),
                     float(sum(waits) / max(ndocs, 1)), float(max(wmax)))


def _pool_stats(workers: _Workers, makespan: float, pre: _Prefilled, cols: list[_Decoder],
                decs: list[_Decoder], by_dec: list[np.ndarray], kv: _Transfers,
                dec_admit: np.ndarray) -> list[PoolStats]:
    by_pre = _group(pre.worker, len(workers.pre))
    stats = []
    for (c, role), idxs in workers.groups().items():
        if role == "prefill":
            stats.append(_prefill_pool(c, idxs, by_pre, pre, makespan))
        elif role == "decode":
            queues = [(kv.arrive[by_dec[i]], dec_admit[by_dec[i]]) for i in idxs]
            stats.append(_decoder_pool(c, role, [decs[i] for i in idxs], queues, makespan))
        else:
            queues = [(np.zeros(len(pre.col_arrive[i])), np.asarray(pre.col_admit[i])) for i in idxs]
            stats.append(_decoder_pool(c, role, [cols[i] for i in idxs], queues, makespan))
    return stats


def _makespan(done_t: np.ndarray) -> float:
    if np.isnan(done_t).any():
        raise RuntimeError(f"simulation left {int(np.isnan(done_t).sum())} documents unfinished")
    return float(done_t.max())


def _result(plan: Plan, n, docs: _Docs, done_t: np.ndarray, makespan: float, pools: list[PoolStats],
            pre: _Prefilled, kv: _Transfers, refill_frac: float, t_wall: float) -> SimResult:
    q10, q90 = np.quantile(done_t, [0.1, 0.9])
    steady = 0.8 * n / (q90 - q10) if q90 > q10 else n / makespan
    return SimResult(
        n_docs=int(n), makespan_s=makespan, docs_per_s=n / makespan, tokens_per_s=docs.tokens / makespan,
        steady_docs_per_s=float(steady), predicted_docs_per_s=float(plan.docs_per_s), pools=pools,
        prefill_mean_wait_s=float(pre.start.mean()), prefill_max_wait_s=float(pre.start.max()),
        kv_transfer_mean_s=float(kv.xfer[kv.ids].mean()) if len(kv.ids) else 0.0,
        wall_seconds=time.perf_counter() - t_wall,
        assumptions=[
            "all documents queued at t=0 (batch job)",
            f"decode advances in strides; freed slots refilled every {refill_frac:.3g} of the slots",
            "KV waiting for decode admission is held off the decoder (no prefill backpressure)",
            "prefill batch constant amortised over the worker's token stream (chunked prefill)",
            "tokens/s counts logical prompt tokens K*(D+S) plus output tokens",
        ])


def simulate(plan: Plan, chips: dict[str, ChipProfile], model: ModelSpec, workload: Workload,
             n_docs: int | None = None, seed: int = 0, max_batch: int = 256, chunk_tokens: int = 8192,
             refill_frac: float = 1.0 / 32) -> SimResult:
    """Simulate ``plan`` on ``n_docs`` documents (default ``workload.n_docs``) drawn from
    ``workload`` with ``seed``. Decode batch per worker is the plan's ``decode_batch``
    (or recomputed from the profile when the plan does not record it).

    Three phases, each complete before the next (no backpressure flows back): the global
    queue (prefill and colocated workers), KV transfer, then each decode worker alone."""
    t_wall = time.perf_counter()
    n = workload.n_docs if n_docs is None else n_docs
    _check_args(plan, chips, n, refill_frac)
    docs = _Docs(workload, model, int(n), seed)
    workers = _Workers.of(plan)
    tp = _prefill_times(chips, [c for c, _ in workers.pre + workers.col], docs, chunk_tokens)
    done_t = np.full(n, np.nan)
    cols = _decoders(workers.col, chips, model, workload, max_batch, chunk_tokens, refill_frac)
    pre = _pull_global_queue(workers, tp, cols, docs, done_t)
    kv = _transfer_kv(pre, workers, chips, docs)
    decs = _decoders(workers.dec, chips, model, workload, max_batch, chunk_tokens, refill_frac)
    by_dec, dec_admit = _run_decoders(decs, workers, kv, docs, done_t)
    makespan = _makespan(done_t)
    pools = _pool_stats(workers, makespan, pre, cols, decs, by_dec, kv, dec_admit)
    return _result(plan, n, docs, done_t, makespan, pools, pre, kv, refill_frac, t_wall)
