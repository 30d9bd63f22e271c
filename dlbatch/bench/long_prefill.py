"""Peak memory of one long-prompt prefill with the engine's chunked prefill.

    python -m dlbatch.bench.long_prefill --tokens 32768 --layers 2 --budget 2048

A random-weight model with the bundled SmolLM2-135M's shape (hidden 576, 9 query / 3 KV
heads of 64, MLP 1536, vocab 49152) but ``--layers`` layers and max_position_embeddings
= ``--tokens`` is written to a temp folder by a child process (transformers), then a
second child loads it with our engine, records its RSS, prefills one prompt of
``--tokens`` tokens (the scheduler's token budget ``--budget`` chunks the prefill) and
generates one token, and reports the peak RSS (``ru_maxrss``) and the KV cache size.
The KV cache grows linearly with layers (bytes per token printed), so the full model's
figure is the measured peak plus (30 - layers) x the per-layer KV of the prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)


def _make(path: str, tokens: int, layers: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=tokens, **SHAPE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(tk.to_str())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _run(path: str, tokens: int, budget: int, dtype: str) -> dict:
    import random
    import resource
    import time

    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=tokens, chat=False, max_num_batched_tokens=budget, max_num_seqs=1,
              enable_prefix_caching=False)
    after_load = _rss_mib()
    peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rng = random.Random(0)
    prompt = [rng.randrange(3, 49152) for _ in range(tokens - 1)]
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    seconds = time.perf_counter() - t0
    c = llm.engine.model.config
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * llm.engine.runner.kv_cache.element_size()
    return {"tokens": tokens, "layers": c.num_layers, "budget": budget, "dtype": dtype,
            "generated": len(out[0].token_ids), "prefill_s": round(seconds, 1),
            "rss_after_load_mib": round(after_load, 1), "peak_rss_before_prefill_mib": round(peak_load, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "kv_cache_mib": round(llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size()
                                  / 2**20, 1),
            "kv_bytes_per_token": kv_per_token}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048, help="scheduler token budget (max_num_batched_tokens)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--child", choices=("make", "run"))
    ap.add_argument("--path")
    a = ap.parse_args(argv)
    if a.child == "make":
        _make(a.path, a.tokens, a.layers)
        return 0
    if a.child == "run":
        print(json.dumps(_run(a.path, a.tokens, a.budget, a.dtype)))
        return 0
    with tempfile.TemporaryDirectory() as d:
        base = [sys.executable, "-m", "dlbatch.bench.long_prefill", "--path", d, "--tokens", str(a.tokens),
                "--layers", str(a.layers), "--budget", str(a.budget), "--dtype", a.dtype]
        subprocess.run(base + ["--child", "make"], check=True)
        out = subprocess.run(base + ["--child", "run"], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    for k, v in result.items():
        print(f"{k:>28}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
