"""The user-facing engine API:

    from dlbatch import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16")
    out = llm.generate(["Why is the sky blue?"], SamplingParams(max_tokens=64))
    print(out[0].text)
"""
from __future__ import annotations

import logging

from dataclasses import fields, replace

from dlbatch.engine.config import EngineConfig
from dlbatch.engine.engine import LLMEngine
from dlbatch.engine.loader import load_model
from dlbatch.engine.outputs import RequestOutput
from dlbatch.engine.sampling_params import SamplingParams

log = logging.getLogger("dlbatch")


class LLM:
    """One engine and its tokenizer. ``config`` is an `EngineConfig` (its defaults when None);
    keyword arguments named like its fields replace them (``LLM(m, dtype="float32",
    max_model_len=4096)``), any other name is an error that names it."""

    def __init__(self, model: str = "smollm2-135m-instruct", config: EngineConfig | None = None, *,
                 chat: bool | None = None, storage_options: dict | None = None, op_overrides: dict | None = None,
                 num_threads: int | None = None, **engine_args):
        import torch

        unknown = sorted(set(engine_args) - {f.name for f in fields(EngineConfig)})
        if unknown:
            raise TypeError(f"LLM: unknown engine argument(s) {', '.join(unknown)}; EngineConfig has "
                            f"{', '.join(f.name for f in fields(EngineConfig))}")
        if num_threads:
            torch.set_num_threads(num_threads)
        loaded = load_model(model, storage_options)
        config = replace(config or EngineConfig(), **engine_args).for_model(loaded.config)
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
        done = self._step_until_done(sum(len(self.engine.sequences_of(s)) for s in seqs), use_tqdm)
        return [self.engine.to_output(done[id(s)]) for s in seqs]

    def _add(self, seqs) -> None:
        for seq in seqs:
            for s in self.engine.sequences_of(seq):  # n > 1: the request's n samples
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
                kv_sink_factory=None) -> list:
        """Prefill only: run each prompt, sample its first token, and return a
        `PrefillResult` per prompt carrying the KV (per layer, token-major torch tensors;
        `dlbatch.transfer.payload.from_torch_layers` makes a transport payload of them).

        ``kv_sink_factory(index, num_prompt_tokens) -> KVSink`` streams each prompt's KV
        layer by layer while its prefill runs (see engine/pd.py); those results carry
        ``kv=None, kv_streamed=True``."""
        from dlbatch.engine.pd import PrefillResult

        seqs = self._make_sequences(prompts, params)
        if any(s.params.n > 1 or s.group for s in seqs):
            raise ValueError("n > 1 runs on colocated workers")
        for k, seq in enumerate(seqs):
            seq.prefill_only = True
            if kv_sink_factory is not None:
                seq.kv_sink = kv_sink_factory(k, len(seq.prompt_ids))
        self._add(seqs)
        self._step_until_done(len(seqs))
        results = []
        for s in seqs:
            kv = s.kv_export
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
        """A result's KV as torch layers: tensors as they are, or any KV object that can
        check itself against this engine's fingerprint and give them (a transfer payload's
        ``torch_layers``): the engine knows no transport format."""
        kv = r.kv
        if isinstance(kv, (list, tuple)):
            return list(kv)
        return kv.torch_layers(expected_fingerprint=self.fingerprint)

    def stats(self) -> dict:
        st = dict(self.engine.stats)
        bm = self.engine.block_manager
        st["prefix_hit_tokens"] = bm.prefix_hit_tokens
        st["prefix_query_tokens"] = bm.prefix_query_tokens
        st["preemptions"] = self.engine.scheduler.num_preemptions
        return st
