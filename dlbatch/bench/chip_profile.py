"""`dlbatch profile`: measure one device running one model with our engine and write a
chip profile (points + fitted cost models) the solver reads.

What is measured, on the real device, with ``dlbatch.LLM`` (the engine the workers run):

* **prefill** over a grid of (new tokens, cached context): for each point a random
  prefix of ``cached`` tokens is prefilled first (``generate(max_tokens=1)``), which
  leaves it in the prefix cache; then ``prefix + new`` is generated with
  ``max_tokens=1`` and timed. The engine reports how many tokens it found cached, and
  that number (not the requested one) is stored, so each point is exactly
  ``(tokens computed, tokens cached, seconds)``. One forward pass per point
  (``max_num_batched_tokens`` is raised above the largest point).
* **decode** over a grid of (batch, context): ``batch`` sequences sharing a prefix of
  ``context - 1`` random tokens plus one distinct token are added with
  ``ignore_eos`` and a known ``max_tokens``; the engine is stepped until every
  sequence has its first token, one more step warms up, then ``steps`` decode steps are
  timed one by one (``LLMEngine.step``). A point is ``(batch, mean Σ context, median
  seconds)`` with Σ context the sum of the sequences' lengths at each timed step.
* **memory**: on CUDA the device's free memory (``torch.cuda.mem_get_info``) before
  loading, of which the engine keeps 85% for weights + KV as it does at run time; on
  CPU the weights plus the KV cache the engine allocates by default (its 1 GiB cap, or
  ``--kv-cache-memory``), capped by the host's available memory (psutil). The host
  figures are kept under ``measured`` in the YAML.
* **KV bandwidth**: ``memcpy`` (torch ``copy_`` of a KV-sized buffer, the floor for any
  same-node transport) by default; ``--kv-transport shm`` or ``object_store`` runs the
  KV transfer benchmark (``dlbatch.bench.kv_transfer``) for that transport.

Fits use ``fit_prefill`` / ``fit_decode`` (non-negative least squares) and the report
prints every point with the fitted value and the R² of each fit. The compute dtype the
engine actually used is recorded (on a CPU without native bf16 the engine computes in
float32 even when bfloat16 is asked).
"""
from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dlbatch.solver.profile import ChipProfile, CostModel, fit_decode, fit_prefill, profile_to_dict

log = logging.getLogger("dlbatch.solver")

MIB = 1 << 20


@dataclass(frozen=True)
class Grid:
    prefill: tuple[tuple[int, int], ...]   # (new tokens, cached tokens)
    decode: tuple[tuple[int, int], ...]    # (batch, context per sequence)
    decode_steps: int
    repeats: int


def default_grid(max_model_len: int, quick: bool, max_batch: int = 64) -> Grid:
    """A grid that stays inside ``max_model_len``. ``quick`` is small enough for a
    loaded 2-core CPU running a 135M model (about a minute); the full grid is denser and
    repeats each prefill point three times (median)."""
    L = int(max_model_len)
    if L < 32:
        raise ValueError(f"max_model_len must be >= 32 to profile, got {L}")

    def cap(*xs: int) -> list[int]:
        return sorted({max(1, min(x, L)) for x in xs})

    if quick:
        toks = cap(L // 64, L // 16, L // 4)
        ctxs = cap(L // 4)
        pre = [(t, 0) for t in toks] + [(toks[0], c) for c in ctxs] + [(toks[1], c) for c in ctxs]
        batches = sorted({b for b in (1, 4, 12) if b <= max_batch})
        dctx = cap(L // 32, L // 4)
        dec = [(b, c) for b in batches for c in dctx]
        steps, repeats = 3, 1
    else:
        toks = cap(L // 128, L // 32, L // 8, L // 4, L // 2)
        ctxs = cap(L // 8, L // 4, L // 2)
        pre = [(t, 0) for t in toks] + [(t, c) for t in toks[:3] for c in ctxs]
        batches = sorted({b for b in (1, 4, 16, 32, 64) if b <= max_batch})
        dctx = cap(L // 32, L // 8, L // 4, L // 2)
        dec = [(b, c) for b in batches for c in dctx]
        steps, repeats = 6, 3
    pre = [(t, c) for t, c in pre if t + c + 1 <= L]
    dec = [(b, c) for b, c in dec if c + 2 + steps <= L]
    return Grid(tuple(dict.fromkeys(pre)), tuple(dict.fromkeys(dec)), steps, repeats)


@dataclass
class ProfileResult:
    profile: ChipProfile
    measured: dict[str, Any] = field(default_factory=dict)

    def to_yaml_dict(self) -> dict[str, Any]:
        d = profile_to_dict(self.profile)
        d["measured"] = self.measured
        return d


def r_squared(y: np.ndarray, yhat: np.ndarray) -> float:
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    ss = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - yhat) ** 2)) / ss if ss > 0 else 1.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _vocab_tokens(llm, rng: random.Random, n: int) -> list[int]:
    vocab = llm.engine.mconf.vocab_size
    lo = min(8, vocab - 1)  # keep clear of special ids at the start of the vocabulary
    eos = llm.engine.eos_ids
    out = []
    while len(out) < n:
        t = rng.randrange(lo, vocab)
        if t not in eos:
            out.append(t)
    return out


def measure_prefill(llm, grid: Grid, device: str, rng: random.Random, progress=None) -> list[tuple[float, float, float]]:
    from dlbatch.engine.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    points = []
    for tokens, cached in grid.prefill:
        times, hits = [], []
        for _ in range(grid.repeats):
            prefix = _vocab_tokens(llm, rng, cached)
            new = _vocab_tokens(llm, rng, tokens)
            if cached:
                llm.generate([prefix], one)
            _sync(device)
            t0 = time.perf_counter()
            out = llm.generate([prefix + new], one)[0]
            _sync(device)
            times.append(time.perf_counter() - t0)
            hits.append(out.cached_tokens)
        hit = int(statistics.median(hits))
        total = tokens + cached
        point = (float(total - hit), float(hit), float(statistics.median(times)))
        points.append(point)
        if progress:
            progress(f"prefill {int(point[0]):>6} new on {hit:>6} cached: {point[2] * 1e3:9.1f} ms")
    return points


def measure_decode(llm, grid: Grid, device: str, rng: random.Random, progress=None) -> list[tuple[float, float, float]]:
    from dlbatch.engine.sampling_params import SamplingParams

    eng = llm.engine
    points = []
    prefixes: dict[int, list[int]] = {}
    for batch, ctx in grid.decode:
        if ctx not in prefixes:  # compute each context once; every batch then finds it in the prefix cache
            prefixes[ctx] = _vocab_tokens(llm, rng, ctx - 1)
        prefix = prefixes[ctx]
        if ctx > 1:  # (a hit when already cached: cheap)
            llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0))
        params = SamplingParams(max_tokens=grid.decode_steps + 3, temperature=0.0, ignore_eos=True)
        seqs = []
        for i in range(batch):
            last = _vocab_tokens(llm, rng, 1)
            seqs.append(eng.add_request(f"profile-dec-{batch}-{ctx}-{i}-{rng.random()}", prefix + last, params))
        try:
            guard = 0
            while any(len(s.output_ids) == 0 for s in seqs):
                eng.step()
                guard += 1
                if guard > 10 * batch + 100:
                    raise RuntimeError(f"decode profile: prefill of {batch} x {ctx} tokens did not finish; "
                                       f"KV cache has {eng.num_blocks} blocks of {eng.config.block_size}")
            eng.step()  # warm-up decode step
            times, sums = [], []
            for _ in range(grid.decode_steps):
                running = [s for s in eng.scheduler.running]
                if len(running) != batch:
                    break
                sum_ctx = sum(len(s) for s in running)
                _sync(device)
                t0 = time.perf_counter()
                eng.step()
                _sync(device)
                times.append(time.perf_counter() - t0)
                sums.append(sum_ctx)
        finally:
            eng.scheduler.abort_all()
        if not times:
            raise RuntimeError(f"decode profile: batch {batch} never ran all sequences together "
                               f"(max_num_seqs {eng.config.max_num_seqs}, {eng.num_blocks} KV blocks)")
        point = (float(batch), float(statistics.mean(sums)), float(statistics.median(times)))
        points.append(point)
        if progress:
            progress(f"decode  batch {batch:>4} context {ctx:>6}: {point[2] * 1e3:9.1f} ms/step")
    return points


def measure_kv_bandwidth(nbytes: int, transport: str = "memcpy", repeats: int = 3) -> tuple[float, dict]:
    """Bytes/s for moving ``nbytes`` of KV with ``transport`` (memcpy | shm | object_store)."""
    from dlbatch.bench import kv_transfer as tb

    nbytes = max(MIB, int(nbytes))
    if transport == "memcpy":
        res = tb._memcpy(nbytes - nbytes % 2, repeats)
        return res["torch_copy_"] * 1e9, {"transport": "memcpy", "bytes": nbytes, "gbps": res}
    if transport in ("shm", "object_store"):
        res = tb.bench_kv(sizes=(nbytes,), transports=(transport,), repeats=repeats, overlap=False,
                          print_table=False)
        row = next(iter(res["sizes"].values()))
        gbps = row["transports"][transport]["median_gbps"]
        return gbps * 1e9, {"transport": transport, "bytes": row["bytes"], "gbps": gbps,
                            "memcpy_gbps": row["memcpy_gbps"]}
    raise ValueError(f"kv transport must be memcpy, shm or object_store, got {transport!r}")


def runtime_kv_bytes(kv_bytes_per_token: int, max_model_len: int, max_batch: int, block_size: int = 16,
                     kv_cache_memory: int | None = None) -> int:
    """KV cache bytes a CPU worker's engine allocates (``LLMEngine._num_blocks``): the
    requested ``kv_cache_memory``, else ``max_num_seqs * max_model_len`` tokens capped at
    the engine's CPU default (1 GiB)."""
    from dlbatch.engine.engine import _DEFAULT_CPU_KV_BYTES

    per_block = block_size * kv_bytes_per_token
    if kv_cache_memory is not None:
        n = kv_cache_memory // per_block
    else:
        n = min(max_batch * max_model_len // block_size, _DEFAULT_CPU_KV_BYTES // per_block)
    return int(n * per_block)


def _memory(llm, device: str, free_before: float | None, weight_bytes: int, kv_bytes_per_token: int,
            max_batch: int, kv_cache_memory: int | None) -> tuple[float, dict]:
    import psutil

    vm = psutil.virtual_memory()
    eng = llm.engine
    kv_alloc = runtime_kv_bytes(kv_bytes_per_token, eng.config.max_model_len, max_batch, eng.config.block_size,
                                kv_cache_memory)
    info = {"host_total_bytes": int(vm.total), "host_available_bytes": int(vm.available),
            "engine_kv_cache_bytes": int(kv_alloc), "engine_kv_blocks": int(kv_alloc // (eng.config.block_size
                                                                                       * kv_bytes_per_token))}
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        info.update(device_total_bytes=int(total), device_free_before_load_bytes=int(free_before or 0),
                    device_free_after_load_bytes=int(free))
        usable = 0.85 * float(free_before if free_before else total)
        return usable, info
    usable = min(float(vm.available) + weight_bytes, float(weight_bytes + kv_alloc))
    return usable, info


def profile_device(model: str, name: str, device: str = "cpu", dtype: str = "bfloat16", quick: bool = False,
                   max_model_len: int | None = None, num_threads: int | None = None, max_batch: int = 64,
                   kv_cache_memory: str | int | None = None, kv_transport: str = "memcpy",
                   price_per_hour: float = 0.0, grid: Grid | None = None, seed: int = 0,
                   progress=print) -> ProfileResult:
    """Measure ``model`` on ``device`` and return the fitted profile plus what was measured."""
    import torch

    from dlbatch.engine.llm import LLM
    from dlbatch.driver.workload import model_spec_for

    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"profile name must be a non-empty string, got {name!r}")
    if not device.startswith(("cpu", "cuda")):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available here")
    if price_per_hour < 0:
        raise ValueError(f"price per hour must be >= 0, got {price_per_hour!r}")
    threads = num_threads or ((os.cpu_count() or 1) if device == "cpu" else None)
    free_before = None
    if device.startswith("cuda"):
        free_before = float(torch.cuda.mem_get_info(torch.device(device))[0])
    t_load = time.perf_counter()
    mml = max_model_len
    probe = None
    if mml is None:
        from dlbatch.engine.loader import load_model

        probe = load_model(model)
        mml = min(probe.config.max_position_embeddings, 4096)
        del probe
    g = grid or default_grid(mml, quick, max_batch)
    from dlbatch.engine.config import parse_memory

    kv_req = parse_memory(kv_cache_memory)
    biggest = max([t + c for t, c in g.prefill] + [2048])
    # the profiling engine's own KV cache holds the largest decode point (shared context
    # + every sequence's reservation) whatever the run-time cache size is
    need_tokens = max([b * (c + g.decode_steps + 8) + c for b, c in g.decode] + [biggest + 64])
    prof_kv = kv_req
    if not device.startswith("cuda"):
        prof_kv = max(kv_req or 0, need_tokens * spec_kv_bytes(model, dtype, device) + (64 << 20))
    llm = LLM(model, dtype=dtype, device=device, max_model_len=mml, kv_cache_memory=prof_kv, chat=False,
              max_num_batched_tokens=max(biggest, mml), max_num_seqs=max(max_batch, max(b for b, _ in g.decode)),
              num_threads=threads)
    load_s = time.perf_counter() - t_load
    cdt = llm.engine.compute_dtype
    spec = model_spec_for(model, dtype, device, compute_dtype=cdt)
    rng = random.Random(seed)
    from dlbatch.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm.generate([_vocab_tokens(llm, rng, min(64, mml - 8))], SamplingParams(max_tokens=4, ignore_eos=True))
    warm_s = time.perf_counter() - t0
    if progress:
        progress(f"profiling {model} on {device} ({cdt} compute, asked {dtype}; {threads or '-'} threads; "
                 f"max_model_len {mml}); load {load_s:.1f} s, warm-up {warm_s:.2f} s")
    t0 = time.perf_counter()
    pre_pts = measure_prefill(llm, g, device, rng, progress)
    dec_pts = measure_decode(llm, g, device, rng, progress)
    measure_s = time.perf_counter() - t0
    prefill, decode = fit_prefill(pre_pts), fit_decode(dec_pts)
    memory, mem_info = _memory(llm, device, free_before, spec.weight_bytes, spec.kv_bytes_per_token, max_batch,
                               kv_req)
    kv_doc_bytes = spec.kv_bytes_per_token * min(mml, 4096)
    kv_bw, kv_info = measure_kv_bandwidth(kv_doc_bytes, kv_transport)
    # memory bandwidth: what decode's weight read achieves (weights / a), a lower bound
    mem_bw = spec.weight_bytes / decode.a if decode.a > 0 else kv_bw
    r2p = r_squared([p[2] for p in pre_pts], [_pre(prefill, p) for p in pre_pts])
    r2d = r_squared([p[2] for p in dec_pts], [_dec(decode, p) for p in dec_pts])
    prof = ChipProfile(name=name, source="measured", memory_bytes=memory, mem_bw=max(mem_bw, 1.0),
                       kv_link_bw=max(kv_bw, 1.0), price_per_hour=float(price_per_hour), prefill=prefill,
                       decode=decode, peak_flops=None, model=model, prefill_points=tuple(pre_pts),
                       decode_points=tuple(dec_pts))
    measured = {
        "device": device, "device_name": _device_name(device), "requested_dtype": dtype, "compute_dtype": cdt,
        "num_threads": threads, "max_model_len": mml, "max_batch": max_batch, "quick": bool(quick),
        "torch": str(torch.__version__), "platform": platform.platform(),
        "n_params": spec.n_params, "weight_bytes": spec.weight_bytes, "kv_bytes_per_token": spec.kv_bytes_per_token,
        "r2_prefill": round(r2p, 4), "r2_decode": round(r2d, 4), "load_s": round(load_s, 2),
        "measure_s": round(measure_s, 2), "memory": mem_info, "kv_bandwidth": kv_info,
        "mem_bw_note": "weight_bytes / decode.a: the weight read rate decode achieves (a lower bound)",
        "prefill_tokens_per_s_at_largest": round(max(p[0] / p[2] for p in pre_pts), 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return ProfileResult(prof, measured)


def spec_kv_bytes(model: str, dtype: str, device: str) -> int:
    from dlbatch.driver.workload import model_spec_for

    return model_spec_for(model, dtype, device).kv_bytes_per_token


def _pre(c: CostModel, p) -> float:
    a, b, cc = c.as_tuple()
    return a + b * p[0] + cc * p[0] * (p[1] + p[0] / 2.0)


def _dec(c: CostModel, p) -> float:
    a, b, cc = c.as_tuple()
    return a + b * p[0] + cc * p[1]


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or "cpu"


def format_profile(res: ProfileResult) -> str:
    from dlbatch.solver.report import _table

    p, m = res.profile, res.measured
    pa, pb, pc = p.prefill.as_tuple()
    da, db, dc = p.decode.as_tuple()
    pre_rows = [[int(x[0]), int(x[1]), x[2] * 1e3, _pre(p.prefill, x) * 1e3,
                 f"{100 * (_pre(p.prefill, x) / x[2] - 1):+.1f}%", x[0] / x[2]] for x in p.prefill_points]
    dec_rows = [[int(x[0]), int(x[1]), x[2] * 1e3, _dec(p.decode, x) * 1e3,
                 f"{100 * (_dec(p.decode, x) / x[2] - 1):+.1f}%", x[0] / x[2]] for x in p.decode_points]
    return "\n".join([
        f"profile {p.name!r}: {p.model} on {m.get('device')} ({m.get('device_name')}), compute dtype "
        f"{m.get('compute_dtype')} (asked {m.get('requested_dtype')}), {m.get('num_threads')} threads",
        _table(["new tokens", "cached", "ms", "fit ms", "err", "tokens/s"], pre_rows),
        f"prefill fit: t = {pa * 1e3:.3f} ms + {pb * 1e6:.3f} us/token + {pc * 1e9:.4f} ns/(token x context); "
        f"R^2 {m.get('r2_prefill', float('nan')):.4f}", "",
        _table(["batch", "sum context", "ms", "fit ms", "err", "tokens/s"], dec_rows),
        f"decode fit: t = {da * 1e3:.3f} ms + {db * 1e3:.3f} ms/seq + {dc * 1e9:.4f} ns/context token; "
        f"R^2 {m.get('r2_decode', float('nan')):.4f}", "",
        f"memory usable by one worker: {p.memory_bytes / 1e9:,.3f} GB ("
        + (f"engine KV {m['memory']['engine_kv_cache_bytes'] / 1e9:,.3f} GB + weights; host available "
           f"{m['memory']['host_available_bytes'] / 1e9:,.1f} GB" if not str(m.get('device')).startswith('cuda')
           else f"85% of {m['memory'].get('device_free_before_load_bytes', 0) / 1e9:,.1f} GB free")
        + ")",
        f"KV bandwidth ({m['kv_bandwidth']['transport']}): {p.kv_link_bw / 1e9:,.2f} GB/s; weight-read bandwidth "
        f"in decode: {p.mem_bw / 1e9:,.2f} GB/s; price ${p.price_per_hour:,.4g}/h",
        f"measured in {m.get('measure_s')} s (model load {m.get('load_s')} s)",
    ])


def save_profile_result(res: ProfileResult, path: str) -> None:
    import yaml
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(res.to_yaml_dict(), sort_keys=False))


__all__ = ["Grid", "ProfileResult", "default_grid", "format_profile", "measure_decode", "measure_kv_bandwidth",
           "measure_prefill", "profile_device", "r_squared", "save_profile_result"]
