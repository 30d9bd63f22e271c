"""The user-facing engine API:

    from dlbatch import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16")
    out = llm.generate(["Why is the sky blue?"], SamplingParams(max_tokens=64))
    print(out[0].text)
"""
from __future__ import annotations

import logging

from dlbatch.engine.config import EngineConfig, parse_kv_memory
from dlbatch.engine.engine import LLMEngine
from dlbatch.engine.loader import load_model
from dlbatch.engine.outputs import RequestOutput
from dlbatch.engine.sampling_params import SamplingParams

log = logging.getLogger("dlbatch")


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", dtype: str = "bfloat16", device: str = "cpu",
                 max_model_len: int | None = None, kv_cache_memory: int | float | str | None = None,
                 chat: bool | None = None, block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, enable_prefix_caching: bool = True, admission: str = "reserve",
                 num_kv_blocks: int | None = None, storage_options: dict | None = None,
                 op_overrides: dict | None = None, num_threads: int | None = None, allow_upcast: bool = True,
                 enforce_eager: bool = False, device_share: float = 1.0, kv_cache_dtype: str = "auto"):
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        loaded = load_model(model, storage_options)
        mml = max_model_len or min(loaded.config.max_position_embeddings, 8192)
        if mml > loaded.config.context_limit:
            raise ValueError(f"max_model_len {mml} exceeds the model's max_position_embeddings "
                             f"{loaded.config.max_position_embeddings}"
                             + (f" x dynamic rope factor {loaded.config.rope.factor:g}"
                                if loaded.config.rope.kind == "dynamic" else ""))
        config = EngineConfig(dtype=dtype, device=device, max_model_len=mml, block_size=block_size,
                              kv_cache_memory=parse_kv_memory(kv_cache_memory), num_kv_blocks=num_kv_blocks,
                              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                              enable_prefix_caching=enable_prefix_caching, admission=admission,
                              allow_upcast=allow_upcast, enforce_eager=enforce_eager,
                              device_share=device_share, kv_cache_dtype=kv_cache_dtype)
        self.model_name = model
        self.engine = LLMEngine(loaded, config, op_overrides)
        self.tokenizer = self.engine.tokenizer
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        elif chat and self.tokenizer.chat_template is None:
            raise ValueError(f"chat=True but model {model!r} has no chat template")
        self.chat = chat
        self._counter = 0

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    # ---- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            return self.tokenizer.encode_prompt(prompt, self.chat)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _params_list(self, n: int, params) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    def _next_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: str | list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        return self._run(self._make_sequences(prompts, params), use_tqdm)

    def _make_sequences(self, prompts, params) -> list:
        """Prompts (one or many; strings or token-id lists) -> engine sequences, with
        errors naming the prompt's index."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = self._params_list(len(prompts), params)
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                ids = self.encode(p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            if not ids:
                raise ValueError(f"prompt {i}: empty prompt")
            seqs.append(self.engine.make_sequence(self._next_id(), ids, sp))
        return seqs

    def _run(self, seqs, use_tqdm: bool = False) -> list[RequestOutput]:
        self._add(seqs)
        done = self._step_until_done(len(seqs), use_tqdm)
        return [self.engine.to_output(done[id(s)]) for s in seqs]

    def _add(self, seqs) -> None:
        for s in seqs:
            self.engine.scheduler.add(s)
            self.engine.stats["prompt_tokens"] += len(s.prompt_ids)

    def _step_until_done(self, n: int, use_tqdm: bool = False) -> dict:
        """Step the engine until nothing is left; {id(seq): seq} of what finished. On an
        exception mid-run the engine is left clean (every request aborted)."""
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="generate", unit="req")
        done = {}
        try:
            while self.engine.has_unfinished():
                for seq in self.engine.step():
                    done[id(seq)] = seq
                    if bar:
                        bar.update(1)
        finally:
            if bar:
                bar.close()
            if self.engine.has_unfinished():
                self.engine.scheduler.abort_all()
        return done

    # ---- prefill / decode disaggregation ----------------------------------------------------
    def prefill(self, prompts: str | list, params: SamplingParams | list[SamplingParams] | None = None,
                kv_format: str = "torch", kv_sink_factory=None) -> list:
        """Prefill only: run each prompt, sample its first token, and return a
        `PrefillResult` per prompt carrying the KV (per layer, token-major). kv_format
        "torch" keeps tensors; "payload" wraps them in a transfer payload (numpy,
        self-describing, checksummed) ready for any transport.

        ``kv_sink_factory(index, num_prompt_tokens) -> KVSink`` streams each prompt's KV
        layer by layer while its prefill runs (see engine/pd.py); those results carry
        ``kv=None, kv_streamed=True``."""
        from dlbatch.engine.pd import PrefillResult

        if kv_format not in ("torch", "payload"):
            raise ValueError(f"kv_format must be 'torch' or 'payload', got {kv_format!r}")
        seqs = self._make_sequences(prompts, params)
        for k, seq in enumerate(seqs):
            seq.prefill_only = True
            if kv_sink_factory is not None:
                seq.kv_sink = kv_sink_factory(k, len(seq.prompt_ids))
        self._add(seqs)
        self._step_until_done(len(seqs))
        results = []
        for s in seqs:
            kv = s.kv_export
            if kv is not None and kv_format == "payload":
                from dlbatch.transfer.payload import from_torch_layers

                kv = from_torch_layers(kv, self.fingerprint)
            results.append(PrefillResult(
                request_id=s.seq_id, prompt_ids=list(s.prompt_ids), first_token=s.output_ids[0], params=s.params,
                fingerprint=self.fingerprint, kv=kv, dtype=self.engine.compute_dtype, finish_reason=s.pd_finish,
                truncated=s.truncated, generator_state=s.generator_state,
                metrics={"ttft_s": (s.first_token_time - s.arrival) if s.first_token_time else None},
                kv_streamed=s.kv_streamed))
            s.kv_export = s.kv_sink = None
        return results

    def decode(self, results: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Decode only: import each PrefillResult's KV into our paged cache and continue."""
        from dlbatch.engine.pd import FingerprintMismatch

        seqs = []
        for r in results:
            if r.fingerprint != self.fingerprint:
                raise FingerprintMismatch(
                    f"request {r.request_id}: KV comes from model {r.fingerprint}, this engine runs {self.fingerprint}")
            sp = r.params if params is None else (params if isinstance(params, SamplingParams) else None)
            if sp is None:
                raise ValueError("decode(params=...) must be one SamplingParams or None (use each result's own)")
            layers = self._kv_layers(r)
            seq = self.engine.add_imported(r.request_id, r.prompt_ids, r.first_token, sp, layers, r.generator_state)
            seq.truncated = r.truncated
            seqs.append(seq)
        done = self._step_until_done(len(seqs))
        return [self.engine.to_output(done[id(s)]) for s in seqs]

    def _kv_layers(self, r) -> list:
        kv = r.kv
        if isinstance(kv, (list, tuple)):
            return list(kv)
        from dlbatch.transfer.payload import layer_to_torch, validate

        validate(kv, expected_fingerprint=self.fingerprint)
        return [layer_to_torch(kv, i) for i in range(kv.meta.num_layers)]

    def stats(self) -> dict:
        st = dict(self.engine.stats)
        bm = self.engine.block_manager
        st["prefix_hit_tokens"] = bm.prefix_hit_tokens
        st["prefix_query_tokens"] = bm.prefix_query_tokens
        st["preemptions"] = self.engine.scheduler.num_preemptions
        return st
