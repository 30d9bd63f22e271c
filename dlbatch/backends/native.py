"""dlbatch's own engine (dlbatch/engine) as a backend: every role, prefill/decode included.

A prefill request's KV leaves through the job's transport: streamed layer by layer from
inside the forward (object store, shm, DLSlime: `dlbatch/transfer/sink.py`), or kept here
until the decode worker pulls it over Ray's direct tensor transport (RDT). A decode request
arrives with its KV already received (`receive_kv`, on the calling thread) and the engine
copies it into its blocks.

Invariant: every live sequence is in ``self.live`` until it is reported by `step` or
dropped by `abort`/`abort_all`; a dropped or failed sequence's KV stream is aborted and its
imported views released (`_drop_transfer`), so no transport buffer outlives its request.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace

from dlbatch.backends.base import DisaggregatedBackend, result_row, sample_row, sampling_extras, wall
from dlbatch.backends.worker_spec import WorkerSpec, engine_config

log = logging.getLogger("dlbatch.backends.native")

# transports fed layer by layer from inside the prefill forward (dlbatch/transfer/sink.py);
# "rdt" keeps the tensors in the prefill worker until the decode worker pulls them
STREAMED = ("object_store", "shm", "dlslime")
RDT_KEEP = 4096  # prefill results kept for an RDT pull at most (oldest dropped, with a warning)


def request_params(r: dict):
    from dlbatch.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=int(r["max_tokens"]), temperature=float(r.get("temperature", 0.0)),
                          top_p=float(r.get("top_p", 1.0)), top_k=int(r.get("top_k", 0)), seed=r.get("seed"),
                          ignore_eos=bool(r.get("ignore_eos", False)), stop=tuple(r.get("stop") or ()),
                          constraint=r.get("constraint"), **sampling_extras(r))


class NativeBackend(DisaggregatedBackend):
    name = "dlbatch"
    feature_note = ("Our engine's model runner has no batched LoRA and no vision encoder: set model.backend: vllm "
                    "(docs/adapters.md, docs/multimodal.md)")

    # ---- the class: configuration -------------------------------------------------------------
    @classmethod
    def validate_model(cls, model) -> None:
        """engine_args are `EngineConfig` fields, less those the job sets elsewhere (model.dtype,
        model.max_model_len, the pool's device and GPU share); no adapters (`check_features`)."""
        cls.check_features(adapters=bool(model.adapters))
        if not model.engine_args:
            return
        from dataclasses import fields

        from dlbatch.engine.config import EngineConfig

        own = {"dtype", "device", "max_model_len", "device_share"}  # set by model.* and cluster.*
        names = {f.name for f in fields(EngineConfig)} - own
        bad = sorted(set(model.engine_args) - names)
        if bad:
            raise ValueError(f"engine_args: unknown argument(s) {', '.join(bad)} of the dlbatch engine; "
                             f"it takes {', '.join(sorted(names))}")

    @classmethod
    def check_model(cls, model, hf_config: dict) -> None:
        """The engine_args (`validate_model`), the architecture (an architecture our engine does
        not run is refused, naming the backend that does) and the context."""
        from dlbatch.engine.config import ModelConfig

        cls.validate_model(model)
        ModelConfig.from_hf(hf_config, source=f"{model.ref}/config.json")
        super().check_model(model, hf_config)

    @classmethod
    def longest_context(cls, hf_config: dict) -> int:
        """max_position_embeddings, times the factor of a dynamic RoPE (the engine's limit)."""
        from dlbatch.engine.config import ModelConfig

        return ModelConfig.from_hf(hf_config).context_limit

    @classmethod
    def worker_spec(cls, model, pool, *, max_model_len: int, max_batch_tokens: int, num_threads: int) -> WorkerSpec:
        """The job's engine_args are `EngineConfig` fields: they go into the engine configuration."""
        engine = engine_config(model, pool, max_model_len, max_batch_tokens, own=dict(model.engine_args))
        return WorkerSpec(model=model.ref, engine=engine, backend=cls.name, chat=model.chat, num_threads=num_threads)

    # ---- the running engine -------------------------------------------------------------------
    def __init__(self, spec, role: str, device: str):
        from dlbatch.engine.llm import LLM

        self.role = role
        self.device = device
        self.spec = spec
        self.llm = LLM(spec.model, replace(spec.engine, device=device), chat=spec.chat,
                       storage_options=spec.storage_options)
        self.engine = self.llm.engine
        self.fingerprint = self.llm.fingerprint
        self.tokenizer = self.llm.tokenizer
        self.live: dict[int, object] = {}  # id(seq) -> seq
        self._transports: dict = {}
        self._rdt_kept: dict = {}
        self._rdt_lock = threading.Lock()

    @property
    def kv_via(self) -> str:
        # auto: the object store (the runner resolves auto before it makes PD workers)
        return self.spec.kv_transport if self.spec.kv_transport != "auto" else "object_store"

    # ---- the interface ----------------------------------------------------------------------
    def add(self, kind: str, item: dict) -> int:
        eng = self.engine
        if item.get("adapter") or item.get("images"):  # refused at job load; never run as the base text model
            raise ValueError(f"request {item['request_id']} carries an adapter or images. {self.feature_note}")
        if kind == "generate":
            seq = eng.add_request(item["request_id"], item["token_ids"], request_params(item))
        elif kind == "prefill":
            seq = eng.add_request(item["request_id"], item["token_ids"], request_params(item), prefill_only=True)
            if self.kv_via in STREAMED:
                seq.kv_sink = self._open_sink(len(seq.prompt_ids))
        elif kind == "decode":
            seq = self._import(item)
        else:
            raise ValueError(f"unknown request kind {kind!r}")
        self.live[id(seq)] = seq
        return id(seq)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[tuple[int, object]]:
        out = []
        for seq in self.engine.step():
            if seq.group:  # n > 1: reported under sample 0's key once all n finished
                seq = seq.group[0]
                if id(seq) not in self.live or any(s.finish_reason is None for s in seq.group):
                    continue
            if self.live.pop(id(seq), None) is None:
                continue
            try:
                out.append((id(seq), self._result(seq)))
            except Exception as e:  # e.g. its KV could not be handed over: it fails alone
                self._drop_transfer(seq)
                out.append((id(seq), e))
        return out

    def abort(self, keys) -> None:
        gone = [self.live.pop(k) for k in keys if k in self.live]
        self.engine.scheduler.abort([s for g in gone for s in self.engine.sequences_of(g)])
        for s in gone:
            self._drop_transfer(s)

    def abort_all(self) -> list[int]:
        keys = list(self.live)
        for seq in self.live.values():
            self._drop_transfer(seq)
        self.live.clear()
        self.engine.scheduler.abort_all()
        return keys

    def stats(self) -> dict:
        st = self.llm.stats()
        bm = self.engine.block_manager
        st.update(free_blocks=bm.num_available, total_blocks=bm.num_blocks,
                  kv_usage=1.0 - bm.num_available / max(1, bm.num_blocks),
                  running=len(self.engine.scheduler.running), waiting=len(self.engine.scheduler.waiting),
                  fingerprint=self.fingerprint, backend=self.name)
        return st

    # ---- results --------------------------------------------------------------------------------
    def _result(self, seq) -> dict:
        if self.role == "prefill":
            via, kv = self.kv_via, None
            sink, seq.kv_sink = seq.kv_sink, None
            if seq.pd_finish is not None:  # the first token ended it: no decode, no KV to move
                if sink is not None:
                    sink.abort()
            elif sink is not None:
                kv = sink.finish(timeout=self.spec.kv_timeout_s)  # the handle the decode worker pulls with
            elif via == "rdt":
                self._keep_for_rdt(seq.seq_id, seq.kv_export)
            seq.kv_export = None
            return {"kv_via": via, "request_id": seq.seq_id, "token_ids": list(seq.prompt_ids),
                    "first_token": seq.output_ids[0], "first_logprobs": seq.logprobs, "finish_reason": seq.pd_finish,
                    "generator_state": seq.generator_state, "kv": kv,
                    "ttft_s": (seq.first_token_time - seq.arrival) if seq.first_token_time else None,
                    "t_first_token": wall(seq.first_token_time), "cached_tokens": seq.num_cached}
        out = self.engine.to_output(seq)
        samples = None
        if out.samples is not None:
            samples = [sample_row(o.text, o.token_ids, o.finish_reason, o.logprobs) for o in out.samples]
        firsts = [s.first_token_time for s in self.engine.sequences_of(seq) if s.first_token_time is not None]
        return result_row(out.request_id, out.text, out.token_ids, out.finish_reason, out.prompt_tokens,
                          out.cached_tokens, out.metrics.get("ttft_s"), out.metrics.get("latency_s"),
                          wall(min(firsts) if firsts else None), logprobs=out.logprobs, samples=samples)

    @staticmethod
    def _drop_transfer(seq) -> None:
        """A failed sequence's KV stream (prefill) or imported views (decode) are let go."""
        sink, seq.kv_sink = seq.kv_sink, None
        if sink is not None:
            sink.abort()
        done, seq.kv_imported = seq.kv_imported, None
        if done is not None:
            done()

    # ---- KV out (prefill) -----------------------------------------------------------------------
    def transport(self, name: str):
        if name not in self._transports:
            from dlbatch.transfer.choose import get_transport

            self._transports[name] = get_transport(name, same_node=True, device=self.device)
        return self._transports[name]

    def _open_sink(self, num_tokens: int):
        from dlbatch.transfer.payload import dtype_name, make_meta
        from dlbatch.transfer.sink import TransportSink

        c = self.engine.mconf
        meta = make_meta(self.fingerprint, dtype_name(self.engine.runner.kv_cache.dtype), c.num_layers,
                         num_tokens, c.num_kv_heads, c.head_dim)
        tr = self.transport(self.kv_via)
        return TransportSink(open=lambda: tr.open_sender(meta))  # buffers taken when the prefill runs

    def _keep_for_rdt(self, request_id: str, layers) -> None:
        with self._rdt_lock:
            self._rdt_kept[request_id] = layers
            while len(self._rdt_kept) > RDT_KEEP:
                old = next(iter(self._rdt_kept))
                self._rdt_kept.pop(old)
                log.warning("dropped the KV of request %s: not pulled over RDT among the last %d", old, RDT_KEEP)

    def rdt_export(self, prefilled: list[dict]) -> dict:
        """{request_id: rdt.pack(meta, layers)} for the prefilled requests that need a decode."""
        from dlbatch.transfer import rdt
        from dlbatch.transfer.payload import dtype_name, make_meta

        c = self.engine.mconf
        out = {}
        with self._rdt_lock:
            for p in prefilled:
                layers = self._rdt_kept.pop(p["request_id"], None)
                if layers is None:
                    continue  # failed, finished at its first token, or not ours
                meta = make_meta(self.fingerprint, dtype_name(layers[0].dtype), c.num_layers, layers[0].shape[1],
                                 c.num_kv_heads, c.head_dim)
                out[p["request_id"]] = rdt.pack(meta, layers)
        return out

    # ---- KV in (decode) -------------------------------------------------------------------------
    def first_token_result(self, prefilled: dict, item: dict) -> dict:
        """The row of a request its first token ended (EOS or a one-token budget): its text is
        that token's (none for EOS), its times the prefill worker's (done at its first token)."""
        p, first = prefilled, prefilled["first_token"]
        logprobs = None
        if p.get("first_logprobs") is not None and item.get("logprobs") is not None:
            from dlbatch.engine.logprobs import logprob_entries

            logprobs = logprob_entries(self.tokenizer, p["first_logprobs"])
        text = self.tokenizer.decode([] if p["finish_reason"] == "stop" else [first])
        return result_row(p["request_id"], text, [first], p["finish_reason"], len(p["token_ids"]),
                          p.get("cached_tokens", 0), p.get("ttft_s"), p.get("ttft_s"), p.get("t_first_token"),
                          logprobs=logprobs, t_done=p.get("t_first_token"))

    def receive_kv(self, item: dict) -> dict:
        """Decode side, on the calling thread (not the engine's): pull a request's KV through
        the transport it came by; the layers stay zero-copy views of the transport's buffers
        (object store, shm) until the engine has copied them into its blocks."""
        from dlbatch.transfer.payload import KVPayload, layer_to_torch, validate

        kv, via = item.get("kv"), item.get("kv_via", "object_store")
        release = None
        if isinstance(kv, KVPayload):  # carried inline (RDT: the tensors that came by the collective)
            payload = kv
        else:
            rx = self.transport(via).open_receiver(kv)
            release = rx.release
            try:
                arrays = [a for _, a in rx.receive_layers(timeout=self.spec.kv_timeout_s)]
                payload = KVPayload(rx.meta, arrays)
            except BaseException:
                rx.release()
                raise
        try:
            validate(payload, expected_fingerprint=self.fingerprint, verify=False)
            layers = [layer_to_torch(payload, i) for i in range(payload.meta.num_layers)]
        except BaseException:
            if release is not None:
                release()
            raise
        return {**item, "kv": None, "kv_layers": layers, "kv_release": release}

    def _import(self, item):
        release = item.get("kv_release")
        try:
            seq = self.engine.add_imported(item["request_id"], item["token_ids"], item["first_token"],
                                           request_params(item), item["kv_layers"], item.get("generator_state"))
        except BaseException:
            if release is not None:
                release()
            raise
        if item.get("first_logprobs") is not None and seq.params.logprobs is not None:
            seq.logprobs = [tuple(e) for e in item["first_logprobs"]]  # the prefill worker's first token
        if release is not None:
            if seq.kv_import is None:  # nothing to copy (the first token ended it)
                release()
            else:
                seq.kv_imported = release
        return seq
