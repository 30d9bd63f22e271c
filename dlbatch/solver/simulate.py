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
from collections import Counter
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


def _decoder_for(chip: ChipProfile, model: ModelSpec, workload: Workload, batch: int, refill_frac: float):
    K = workload.tasks_per_doc
    slots = max(K, batch)
    cap = (chip.memory_bytes - model.weight_bytes) / model.kv_bytes_per_token
    return _Decoder(chip, slots, cap, K, int(round(slots * refill_frac)))


def simulate(plan: Plan, chips: dict[str, ChipProfile], model: ModelSpec, workload: Workload,
             n_docs: int | None = None, seed: int = 0, max_batch: int = 256, chunk_tokens: int = 8192,
             refill_frac: float = 1.0 / 32) -> SimResult:
    """Simulate ``plan`` on ``n_docs`` documents (default ``workload.n_docs``) drawn from
    ``workload`` with ``seed``. Decode batch per worker is the plan's ``decode_batch``
    (or recomputed from the profile when the plan does not record it)."""
    t_wall = time.perf_counter()
    n = workload.n_docs if n_docs is None else n_docs
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n_docs must be an integer >= 1, got {n!r}")
    if not (0 < refill_frac <= 1):
        raise ValueError(f"refill_frac must be in (0, 1], got {refill_frac!r}")
    for p in plan.pools:
        if p.chip not in chips:
            raise ValueError(f"plan uses chip {p.chip!r} but no profile was given; have {sorted(chips)}")
    if not plan.pools:
        raise ValueError("plan has no pools")
    docs = _Docs(workload, model, int(n), seed)
    K = docs.K

    def batch_of(pool) -> int:
        if pool.decode_batch:
            return int(pool.decode_batch)
        return role_rates(chips[pool.chip], model, workload, max_batch, chunk_tokens).decode_batch

    pre_workers: list[tuple[str, Any]] = []      # (chip, pool)
    dec_workers: list[tuple[str, Any]] = []
    col_workers: list[tuple[str, Any]] = []
    for pool in plan.pools:
        target = {"prefill": pre_workers, "decode": dec_workers, "colocated": col_workers}[pool.role]
        target.extend([(pool.chip, pool)] * pool.replicas)
    if pre_workers and not dec_workers:
        raise ValueError("plan has prefill workers but no decode workers")
    if dec_workers and not pre_workers:
        raise ValueError("plan has decode workers but no prefill workers")

    # per-chip prefill time per document
    tp: dict[str, np.ndarray] = {}
    for chip in {c for c, _ in pre_workers + col_workers}:
        a, b, c = chips[chip].prefill.as_tuple()
        tp[chip] = a * docs.P / chunk_tokens + b * docs.P + c * docs.Q

    done_t = np.full(n, np.nan)
    cols = [_decoder_for(chips[c], model, workload, batch_of(p), refill_frac) for c, p in col_workers]
    col_arrive: list[list[int]] = [[] for _ in cols]
    col_admit: list[list[float]] = [[] for _ in cols]
    pre_busy = np.zeros(len(pre_workers))

    # --- phase 1: the global queue, pulled by prefill and colocated workers -----------
    heap: list[tuple[float, int, int]] = [(0.0, 0, i) for i in range(len(pre_workers))]
    heap += [(0.0, 1, i) for i in range(len(cols))]
    heapq.heapify(heap)
    nxt = 0
    tp_l = {c: v.tolist() for c, v in tp.items()}
    pre_chip_tp = [tp_l[c] for c, _ in pre_workers]
    col_tp = [tp_l[c] for c, _ in col_workers]
    pf_start_l, pf_done_l, pf_worker_l = [0.0] * n, [0.0] * n, [-1] * n
    while heap and nxt < n:
        t, kind, i = heapq.heappop(heap)
        if kind == 0:
            d = nxt
            nxt += 1
            dt = pre_chip_tp[i][d]
            pf_start_l[d] = t
            pf_done_l[d] = t + dt
            pf_worker_l[d] = i
            pre_busy[i] += dt
            heapq.heappush(heap, (t + dt, 0, i))
        else:
            dec = cols[i]
            k = dec.how_many_fit(docs.reserve_l[nxt: nxt + dec.free_docs()])
            if k > 0:
                ids = range(nxt, nxt + k)
                nxt += k
                tpl = col_tp[i]
                for d in ids:
                    pf_start_l[d] = dec.t
                    dec.t += tpl[d]
                    dec.busy += tpl[d]
                    pf_done_l[d] = dec.t
                dec.admit(ids, docs)
                col_arrive[i].extend(ids)
                col_admit[i].extend([dec.t] * k)
            elif dec.n_active > 0:
                dec.stride(-1.0, done_t, docs)
            else:
                raise ValueError(f"colocated worker on {col_workers[i][0]} cannot hold one document: "
                                 f"{docs.reserve[nxt]:.0f} KV tokens vs {dec.cap:.0f} capacity")
            heapq.heappush(heap, (dec.t, 1, i))
    for dec in cols:                                  # drain colocated decode
        while dec.n_active > 0:
            dec.stride(-1.0, done_t, docs)
    pf_start = np.asarray(pf_start_l)
    pf_done = np.asarray(pf_done_l)
    pf_worker = np.asarray(pf_worker_l, dtype=np.int64)

    # --- phase 2: KV transfer to decode workers --------------------------------------
    pd_ids = np.flatnonzero(pf_worker >= 0)
    arrive = np.zeros(n)
    xfer = np.zeros(n)
    dec_assign = np.full(n, -1, dtype=np.int64)
    decs = [_decoder_for(chips[c], model, workload, batch_of(p), refill_frac) for c, p in dec_workers]
    if len(pd_ids):
        dec_rate = np.array([p.docs_per_s_each if p.docs_per_s_each > 0 else 1.0 for _, p in dec_workers])
        order = pd_ids[np.argsort(pf_done[pd_ids], kind="stable")]
        egress = np.zeros(len(pre_workers))
        ingress = np.zeros(len(decs))
        bw_p = [chips[c].kv_link_bw for c, _ in pre_workers]
        bw_d = [chips[c].kv_link_bw for c, _ in dec_workers]
        load = [(1.0 / dec_rate[j], j) for j in range(len(decs))]
        heapq.heapify(load)
        counts = np.zeros(len(decs))
        pw = pf_worker.tolist()
        pdn = pf_done.tolist()
        kvb = docs.kv_bytes.tolist()
        for d in order.tolist():
            _, j = heapq.heappop(load)
            counts[j] += 1
            heapq.heappush(load, ((counts[j] + 1) / dec_rate[j], j))
            p = pw[d]
            start = max(pdn[d], egress[p], ingress[j])
            dur = kvb[d] / min(bw_p[p], bw_d[j])
            egress[p] = ingress[j] = start + dur
            arrive[d] = start + dur
            xfer[d] = dur
            dec_assign[d] = j

    # --- phase 3: each decode worker on its own arrivals ---------------------------
    dec_admit = np.zeros(n)
    by_dec = _group(dec_assign, len(decs))
    for j, dec in enumerate(decs):
        ids_a = by_dec[j]
        if len(ids_a) == 0:
            continue
        ids_a = ids_a[np.argsort(arrive[ids_a], kind="stable")]
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
                    raise ValueError(f"decode worker on {dec_workers[j][0]} cannot hold one document: "
                                     f"{res[q]:.0f} KV tokens vs {dec.cap:.0f} capacity")
                continue
            until = arr[q] if (q < m and arr[q] > dec.t and dec.free_docs() > 0) else -1.0
            dec.stride(until, done_t, docs)
        dec_admit[ids_a] = adm

    # --- report ------------------------------------------------------------------
    if np.isnan(done_t).any():
        raise RuntimeError(f"simulation left {int(np.isnan(done_t).sum())} documents unfinished")
    makespan = float(done_t.max())
    q10, q90 = np.quantile(done_t, [0.1, 0.9])
    steady = 0.8 * n / (q90 - q10) if q90 > q10 else n / makespan
    stats: list[PoolStats] = []
    groups: dict[tuple[str, str], list[int]] = {}
    for idx, (c, p) in enumerate(pre_workers):
        groups.setdefault((c, "prefill"), []).append(idx)
    for idx, (c, p) in enumerate(dec_workers):
        groups.setdefault((c, "decode"), []).append(idx)
    for idx, (c, p) in enumerate(col_workers):
        groups.setdefault((c, "colocated"), []).append(idx)
    pre_counts = Counter(pf_worker[pf_worker >= 0].tolist())
    by_pre = _group(pf_worker, len(pre_workers))
    for (c, role), idxs in groups.items():
        if role == "prefill":
            sel = np.concatenate([by_pre[i] for i in idxs])
            wait = pf_start[sel]
            stats.append(PoolStats(c, role, len(idxs), int(sum(pre_counts[i] for i in idxs)),
                                   float(pre_busy[idxs].mean() / makespan), 0.0,
                                   float(wait.sum() / makespan / len(idxs)),
                                   int(max(len(by_pre[i]) for i in idxs)),
                                   float(wait.mean()) if len(wait) else 0.0,
                                   float(wait.max()) if len(wait) else 0.0))
            continue
        pool_decs = [decs[i] for i in idxs] if role == "decode" else [cols[i] for i in idxs]
        qlens, qmaxs, waits, wmax, ndocs = [], [], [], [], 0
        for i in idxs:
            if role == "decode":
                ids = by_dec[i]
                a_t, ad_t = arrive[ids], dec_admit[ids]
            else:
                ids = np.asarray(col_arrive[i], dtype=np.int64)
                a_t, ad_t = np.zeros(len(ids)), np.asarray(col_admit[i])
            ndocs += len(ids)
            ql, qm, wm, wx = _queue_stats(a_t, ad_t, makespan)
            qlens.append(ql), qmaxs.append(qm), waits.append(wm * len(ids)), wmax.append(wx)
        occ = [d.slot_steps / (d.slots * d.steps) for d in pool_decs if d.steps]
        stats.append(PoolStats(c, role, len(idxs), ndocs,
                               float(np.mean([d.busy for d in pool_decs]) / makespan),
                               float(np.mean(occ)) if occ else 0.0,
                               float(np.mean(qlens)), int(max(qmaxs)),
                               float(sum(waits) / max(ndocs, 1)), float(max(wmax))))
    first_wait = pf_start
    return SimResult(
        n_docs=int(n), makespan_s=makespan, docs_per_s=n / makespan, tokens_per_s=docs.tokens / makespan,
        steady_docs_per_s=float(steady), predicted_docs_per_s=float(plan.docs_per_s), pools=stats,
        prefill_mean_wait_s=float(first_wait.mean()), prefill_max_wait_s=float(first_wait.max()),
        kv_transfer_mean_s=float(xfer[pd_ids].mean()) if len(pd_ids) else 0.0,
        wall_seconds=time.perf_counter() - t_wall,
        assumptions=[
            "all documents queued at t=0 (batch job)",
            f"decode advances in strides; freed slots refilled every {refill_frac:.3g} of the slots",
            "KV waiting for decode admission is held off the decoder (no prefill backpressure)",
            "prefill batch constant amortised over the worker's token stream (chunked prefill)",
            "tokens/s counts logical prompt tokens K*(D+S) plus output tokens",
        ])
