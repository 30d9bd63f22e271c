"""The engine loop: add requests, then step (schedule -> run -> postprocess) until done."""
from __future__ import annotations

import logging
import time

import torch

from dlbatch.engine.block_manager import BlockManager
from dlbatch.engine.config import EngineConfig
from dlbatch.engine.loader import LoadedModel
from dlbatch.engine.model import Transformer, torch_dtype
from dlbatch.engine.model_runner import ModelRunner
from dlbatch.engine.ops import get_ops
from dlbatch.engine.outputs import RequestOutput
from dlbatch.engine.sampling_params import SamplingParams
from dlbatch.engine.scheduler import Scheduler
from dlbatch.engine.sequence import Sequence

log = logging.getLogger("dlbatch.engine")

_DEFAULT_CPU_KV_BYTES = 3 << 30  # lazily zeroed pages: only what is used costs memory


def _host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (a kv_cache_memory fraction on CPU is of this)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, op_overrides: dict | None = None):
        self.loaded = loaded
        self.mconf = loaded.config
        self.config = config = config.for_model(loaded.config)
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
        from dlbatch.engine.device import compute_dtype, keep_freed_memory

        if device.type == "cpu":
            keep_freed_memory()
        params = sum(t.numel() for t in loaded.weights.values() if isinstance(t, torch.Tensor))
        self.compute_dtype = compute_dtype(config.dtype, device.type, allow_upcast=config.allow_upcast, params=params,
                                           available=_host_available_bytes() if device.type == "cpu" else None)
        dtype = torch_dtype(self.compute_dtype)
        mem_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.ops = get_ops(device, op_overrides)
        self.model = Transformer(self.mconf, loaded.weights, self.ops, dtype, device, config.max_model_len)
        self.kv_dtype = dtype if config.kv_cache_dtype == "auto" else torch_dtype(config.kv_cache_dtype)
        self.activation_peak = 0
        if device.type == "cuda":  # engine/profile.py: activations measured, kernels compiled (or replaced)
            from dlbatch.engine.profile import start_up_forward

            self.activation_peak, self.ops, self.op_overrides = start_up_forward(
                self.model, self.mconf, config, self.kv_dtype, device, op_overrides)
        own = (torch.cuda.memory_allocated(device) - mem_before if device.type == "cuda" else 0) + self.activation_peak
        self.num_blocks = self._num_blocks(self.kv_dtype, device, own)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          share_partial_blocks=True)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.model, self.mconf, config, self.num_blocks, self.kv_dtype)
        if device.type == "cuda" and not config.enforce_eager:
            from dlbatch.engine.cuda_graph import GraphedModel, graphs_supported

            if graphs_supported(self.ops):
                self.runner.model = GraphedModel(self.model, config.block_size, config.max_model_len,
                                                 config.max_num_seqs)
                self.runner.model.capture_all(self.runner.kv_cache)  # at start-up, not on the first steps
            else:
                log.info("decode runs eagerly: CUDA graphs need the CUDA ops (ops: %s)", self.ops.describe())
        self.scheduler.on_admit = self._on_admit
        self._done_imports: list[Sequence] = []
        self.eos_ids = set(self.mconf.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        from dlbatch.engine.constraint import ConstraintCompiler, ConstraintMasker

        self.constraints = ConstraintCompiler(self.tokenizer, self.mconf.vocab_size)
        self.runner.masker = ConstraintMasker(max(self.mconf.vocab_size, self.tokenizer.vocab_size))
        self.stats = {"steps": 0, "prompt_tokens": 0, "prefill_tokens_computed": 0, "output_tokens": 0,
                      "cached_tokens": 0, "busy_s": 0.0}

    def _num_blocks(self, dtype, device, own: int = 0) -> int:
        """KV blocks of this engine. On CUDA its share of the device less what it holds itself
        (``own``: its weights and its activations' peak), never more than is free: a second
        engine in the process gets its own share, not the first one's leftovers."""
        c = self.config
        per_block = ModelRunner.bytes_per_block(self.mconf, c.block_size, dtype)
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        from dlbatch.engine.device import kv_cache_bytes

        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            n = kv_cache_bytes(c.kv_cache_memory, free, total, own, c.device_share) // per_block
        elif c.kv_cache_memory is not None:
            free = _host_available_bytes() if isinstance(c.kv_cache_memory, float) else 0
            n = kv_cache_bytes(c.kv_cache_memory, free, free) // per_block
        else:
            want = c.max_num_seqs * -(-c.max_model_len // c.block_size)  # every sequence at full length
            n = min(want, _DEFAULT_CPU_KV_BYTES // per_block)
        min_blocks = -(-c.max_model_len // c.block_size)
        if n < min_blocks:
            raise ValueError(
                f"kv_cache_memory holds {n} blocks of {c.block_size} tokens ({n * per_block} bytes) but one "
                f"sequence of max_model_len={c.max_model_len} needs {min_blocks}; raise kv_cache_memory "
                f"to at least {min_blocks * per_block} bytes or lower max_model_len")
        return int(n)

    # ---- requests --------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        vocab = self.mconf.vocab_size
        bad = next((t for t in prompt_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"request {request_id}: token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len - params.max_tokens
        truncated = False
        if len(prompt_ids) > limit:
            if not params.truncate_prompt or limit <= 0:
                raise ValueError(
                    f"request {request_id}: prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} "
                    f"exceeds max_model_len {self.config.max_model_len} (prompt may be at most {max(limit, 0)} "
                    f"tokens; set truncate_prompt=True to keep the head)")
            prompt_ids = prompt_ids[:limit]
            truncated = True
        seq = Sequence(seq_id=request_id, prompt_ids=list(prompt_ids), params=params)
        seq.truncated = truncated
        if params.constraint is not None:  # compiled once per engine; a bad one fails this request alone
            seq.matcher = self.constraints.matcher(params.constraint)
        if params.n > 1:
            self._make_group(seq)
        return seq

    def _make_group(self, seq: Sequence) -> None:
        """n > 1: ``seq`` becomes sample 0 of n sequences of the same prompt (``seq.group``),
        sample i seeded ``seed + i`` (vLLM's rule), so sample 0 is what the request with n = 1
        gives. The others are admitted after sample 0 and share its prompt's KV through the
        prefix cache (the scheduler holds them back while those blocks are computed)."""
        from dataclasses import replace

        p = seq.params
        group = []
        for i in range(p.n):
            sp = replace(p, n=1, seed=None if p.seed is None else p.seed + i)
            s = seq if i == 0 else Sequence(seq_id=f"{seq.seq_id}#{i}", prompt_ids=list(seq.prompt_ids), params=sp)
            s.params, s.truncated, s.group, s.sample_index = sp, seq.truncated, group, i
            if i and sp.constraint is not None:
                s.matcher = self.constraints.matcher(sp.constraint)
            group.append(s)

    @staticmethod
    def sequences_of(seq: Sequence) -> list[Sequence]:
        """The sequences of ``seq``'s request: its group (n > 1), else itself."""
        return list(seq.group) if seq.group else [seq]

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False) -> Sequence:
        if prefill_only and params.n > 1:
            raise ValueError("n > 1 runs on colocated workers")
        seq = self.make_sequence(request_id, prompt_ids, params)
        seq.prefill_only = prefill_only
        for s in self.sequences_of(seq):  # n > 1: all n; the request is done when all are
            self.scheduler.add(s)
            self.stats["prompt_tokens"] += len(s.prompt_ids)
        return seq

    def add_imported(self, request_id: str, prompt_ids: list[int], first_token: int, params: SamplingParams,
                     kv_layers, generator_state=None) -> Sequence:
        """Decode-only mode: continue a request whose prompt was prefilled elsewhere.
        `kv_layers[i]` is layer i's KV, shape (2, len(prompt_ids), kv_heads, head_dim), any
        float dtype (converted on import); the copy into our blocks happens at admission."""
        if params.n > 1:
            raise ValueError("n > 1 runs on colocated workers")
        c = self.mconf
        if len(kv_layers) != c.num_layers:
            raise ValueError(f"request {request_id}: KV has {len(kv_layers)} layers, model has {c.num_layers}")
        want = (2, len(prompt_ids), c.num_kv_heads, c.head_dim)
        for i, kv in enumerate(kv_layers):
            if tuple(kv.shape) != want:
                raise ValueError(f"request {request_id}: KV layer {i} has shape {tuple(kv.shape)}, expected {want}")
        seq = self.make_sequence(request_id, prompt_ids, params)
        if seq.truncated:
            raise ValueError(f"request {request_id}: imported prompt exceeds max_model_len")
        seq.output_ids = [int(first_token)]
        seq.kv_import = kv_layers
        seq.first_token_time = time.perf_counter()
        if generator_state is not None:
            g = torch.Generator(device=self.model.device)
            g.set_state(generator_state)
            seq.generator = g
        reason = self._is_stopped(seq)
        if reason is not None:  # the first token already ended it: nothing to decode
            seq.finish_reason = reason
            seq.kv_import = None
            seq.finish_time = seq.first_token_time
            self._done_imports.append(seq)
            return seq
        self.scheduler.add(seq)
        return seq

    def _on_admit(self, seq: Sequence) -> None:
        """Right after ``seq`` got its blocks (the scheduler unpins a partial hit's source
        when this returns): copy the head of a partially matched block, import a decode-only
        sequence's KV."""
        if seq.kv_copy is not None:
            self.runner.copy_block_head(*seq.kv_copy)
        kv = seq.kv_import
        if kv is None:
            return
        n = len(seq.prompt_ids)
        start = seq.num_computed  # prefix-cache hits already hold the head
        self.block_manager.ensure_slots(seq, n + 1)
        for li, layer in enumerate(kv):
            t = layer if isinstance(layer, torch.Tensor) else torch.from_numpy(layer)
            self.runner.import_kv_layer(seq, li, t, start)
        seq.num_computed = n
        self.block_manager.commit_full_blocks(seq)
        seq.kv_import = None
        if seq.kv_imported is not None:  # the source (views of a transport's buffers) can go now
            done, seq.kv_imported = seq.kv_imported, None
            done()
        self.stats["imported_tokens"] = self.stats.get("imported_tokens", 0) + (n - start)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._done_imports)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        if self._done_imports:
            done, self._done_imports = self._done_imports, []
            return done
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.seq_id} cannot be admitted: KV cache too small")
            return []
        prefill_tokens = sum(min(s.num_new, max(0, len(s.seq.prompt_ids) - s.seq.num_computed)) for s in out.scheduled)
        sampled = self.runner.execute(out)
        self.stats["steps"] += 1
        self.stats["prefill_tokens_computed"] += prefill_tokens
        now = time.perf_counter()
        for s in out.scheduled:
            if id(s.seq) in sampled and s.seq.first_token_time is None:
                s.seq.first_token_time = now
        finished = self.scheduler.postprocess(out, sampled, self._is_stopped)
        self.stats["output_tokens"] += len(sampled)
        for seq in finished:
            seq.finish_time = now
            if seq.prefill_only:
                if seq.kv_sink is None:  # with a sink, its layers went out during this step's forward
                    seq.kv_export = self.runner.export_kv(seq, len(seq.prompt_ids))
                if seq.generator is not None:
                    seq.generator_state = seq.generator.get_state()
        self.scheduler.free_finished(finished)
        self.stats["busy_s"] += time.perf_counter() - t0
        return finished

    def _is_stopped(self, seq: Sequence) -> str | None:
        p = seq.params
        if seq.prefill_only:
            seq.prefill_only = False
            seq.pd_finish = self._is_stopped(seq)  # the real reason, if the first token ends it
            seq.prefill_only = True
            return "prefill"
        last = seq.output_ids[-1]
        if seq.matcher is not None:
            from dlbatch.engine.constraint import advance

            if advance(seq):
                return "stop"
        if not p.ignore_eos and last in self.eos_ids:
            return "stop"
        if last in p.stop_token_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(seq.output_ids)
            lo = max(0, seq.stop_text_len - max(len(s) for s in p.stop))
            for s in p.stop:
                i = text.find(s, lo)
                if i >= 0:
                    seq.text = text[:i]
                    return "stop"
            seq.stop_text_len = len(text)
        if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.config.max_model_len:
            return "length"
        return None

    def to_output(self, seq: Sequence) -> RequestOutput:
        """A finished request: ``seq`` and, with n > 1, the samples of its group (times from
        its first token to its last sample's end)."""
        out = self._one_output(seq)
        if seq.group and len(seq.group) > 1:
            out.samples = [out] + [self._one_output(s) for s in seq.group[1:]]
            firsts = [s.first_token_time for s in seq.group if s.first_token_time is not None]
            ends = [s.finish_time for s in seq.group if s.finish_time is not None]
            out.metrics = {**out.metrics, "ttft_s": (min(firsts) - seq.arrival) if firsts else None,
                           "latency_s": (max(ends) - seq.arrival) if ends else None}
        return out

    def _one_output(self, seq: Sequence) -> RequestOutput:
        ids = seq.output_ids
        if seq.finish_reason == "stop" and ids and ids[-1] in self.eos_ids and not seq.params.ignore_eos:
            ids = ids[:-1]
        text = seq.text if seq.text is not None else self.tokenizer.decode(ids)
        m = {"ttft_s": (seq.first_token_time - seq.arrival) if seq.first_token_time else None,
             "latency_s": (seq.finish_time - seq.arrival) if seq.finish_time else None,
             "preemptions": seq.num_preemptions}
        lps = None
        if seq.params.logprobs is not None:
            from dlbatch.engine.logprobs import logprob_entries

            lps = logprob_entries(self.tokenizer, seq.logprobs or [])
        return RequestOutput(request_id=seq.seq_id, prompt_tokens=len(seq.prompt_ids), token_ids=list(seq.output_ids),
                             text=text, finish_reason=seq.finish_reason or "length", truncated=seq.truncated,
                             cached_tokens=seq.num_cached, metrics=m, logprobs=lps)
